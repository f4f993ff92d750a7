"""The front: where requests enter and outputs leave (global rank 0's process), off every rank's
critical path.

It validates and routes each request to a DP rank's inbox (least-loaded, or KV-aware: the rank
holding the prompt's prefix, weighed against load — kvstore/router.py), keeps every request's state (prompt,
params, tokens so far — engine/front/outputs.py), turns the ranks' Reports into RequestOutputs, and keeps
each domain's wave going (engine/worker/rank_loop.py): a domain is a set of ranks in lockstep — every rank
when colocated, each pool when disaggregated. The ranks never wait for it: a front slowed by HTTP,
JSON or detokenization only delays its own clients.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from wideep.kvstore.metrics import tier_totals

from ..sampling_params import RequestOutput
from ..worker.messages import Abort, Command, NewRequest, Report, Wake
from .outputs import RequestState
from .resize import Joining, Resizing, ResizingFront
from .samples import SampleGroup


def least_loaded(load: dict[int, int] | list[int]) -> int:
    """The rank with the fewest tokens in flight (lowest rank on ties)."""
    keys = load.keys() if isinstance(load, dict) else range(len(load))
    return min(keys, key=lambda r: (load[r], r))


@dataclass
class Domain:
    """Ranks in lockstep (they share a step sync), and the front's view of their wave."""
    ranks: list[int]
    wave: int = 0
    running: bool = False          # the front woke wave `wave` (or believes it is running)
    load: dict[int, int] = field(default_factory=dict)   # DP rank -> tokens in flight

    def __post_init__(self):
        self.load = {r: 0 for r in self.ranks}


class Front(ResizingFront):
    """channel: the front's end (FrontChannel or the local pair's); domains: the lockstep groups;
    tokenizer: for output text (None: no text)."""

    def __init__(self, channel, domains: list[Domain], tokenizer=None, finished_kept: int = 10000, router=None):
        self.channel, self.domains, self.tokenizer = channel, domains, tokenizer
        self.router = router       # kvstore.PrefixRouter (KV-aware routing) or None (least-loaded)
        self.routing = Counter()   # routing decisions by reason
        self.domain_of = {r: d for d in domains for r in d.ranks}
        self.requests: dict[str, RequestState] = {}   # by the id on the rank (a sample's, when n > 1)
        self.groups: dict[str, SampleGroup] = {}       # requests with n > 1, by the client's id
        self.cost: dict[str, list[tuple[Domain, int, int, bool]]] = {}  # request -> [(domain, rank, tokens,
        #                                                                        until its first token)]
        self.rank_stats: dict[int, dict] = {}
        self.finished: deque[dict] = deque(maxlen=finished_kept)
        self.tokens_log: deque[tuple[float, int]] = deque()
        self.generated = 0
        self.commands = 0
        self.errors: list[str] = []
        self.busy_s = 0.0          # time spent turning reports into outputs (not waiting for them)
        self.reports = 0
        self.lost: set[int] = set()       # ranks lost and survived (on_rank_loss = "continue")
        self.recoveries: list[dict] = []  # one per re-forming: who was lost, how long it took
        self.readmitted = 0
        self.resizing: Resizing | None = None   # a resize on request in progress (engine/front/resize.py)
        self.joining: Joining | None = None     # a grow waiting for its new ranks to load
        self.resizes: list[dict] = []           # the finished ones' figures
        self.next_origin = max(self.domain_of) + 1   # a new rank's origin rank: never one used before

    # -- requests -----------------------------------------------------------------------------------
    def assign(self, domain: Domain, request_id: str, cost: int, until_first_token: bool = False,
               ids: list[int] | None = None) -> int:
        """Book the request on a rank of the domain, until it finishes (or, with until_first_token,
        until its first token is back: a prefill's share). -> that rank. With a router and the
        prompt's ids: the rank whose cached prefix and load cost least; else the least-loaded."""
        if self.router is not None and ids is not None:
            rank, reason, _ = self.router.choose(domain.ranks, domain.load, ids)
        else:   # among the domain's ranks: a rank leaving in a resize keeps its load entry until it has left
            rank, reason = least_loaded({r: domain.load[r] for r in domain.ranks}), "least_loaded"
        self.routing[reason] += 1
        self.book(domain, request_id, rank, cost, until_first_token)
        return rank

    def book(self, domain: Domain, request_id: str, rank: int, cost: int, until_first_token: bool = False) -> None:
        """Count the request's tokens on a chosen rank (the samples of an n > 1 request share one)."""
        domain.load[rank] += cost
        self.cost.setdefault(request_id, []).append((domain, rank, cost, until_first_token))

    def _release(self, request_id: str, first_token_only: bool) -> None:
        kept = []
        for booking in self.cost.pop(request_id, []):
            domain, rank, cost, until_first = booking
            if until_first or not first_token_only:
                domain.load[rank] -= cost
            else:
                kept.append(booking)
        if kept:
            self.cost[request_id] = kept

    def send(self, rank: int, msg) -> None:
        """Send to a rank; wake its domain first when the front believes it idle."""
        d = self.domain_of[rank]
        if not d.running:
            self.channel.broadcast(d.ranks, Wake(d.wave))
            d.running = True
        if isinstance(msg, NewRequest):
            msg.wave = d.wave
        self.channel.send(rank, msg)

    def add(self, state: RequestState, msg: NewRequest) -> None:
        self.requests[state.request_id] = state
        self.send(state.dp_rank, msg)

    def add_group(self, group: SampleGroup, msgs: list[NewRequest], hold: bool) -> None:
        """n > 1 (engine/front/samples.py): sample 0 now; with hold, the others once its first
        token is back (its prompt is then in its rank's prefix cache)."""
        self.groups[group.request_id] = group
        for st in group.states:
            self.requests[st.request_id] = st
        group.held = list(zip(group.states[1:], msgs[1:])) if hold else []
        self.send(group.states[0].dp_rank, msgs[0])
        if not hold:
            for st, msg in zip(group.states[1:], msgs[1:]):
                self.send(st.dp_rank, msg)

    def _release_held(self, group: SampleGroup) -> None:
        held, group.held = group.held, []
        for st, msg in held:
            self.send(st.dp_rank, msg)

    def abort(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is None:
            st = self.requests[request_id]
            self.send(st.dp_rank, Abort(request_id))
            return
        self._release_held(group)   # every sample is on its rank, which reports its abort
        for st in group.states:
            if not st.finished:
                self.send(st.dp_rank, Abort(st.request_id))

    def rank_of(self, request_id: str) -> int:
        group = self.groups.get(request_id)
        return (group.states[0] if group is not None else self.requests[request_id]).dp_rank

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def command(self, kind: int) -> None:
        """END or SHUTDOWN to every rank; each domain leaves its loop in one step."""
        self.commands += 1
        for d in self.domains:
            self.channel.broadcast(d.ranks, Command(kind, self.commands))
            d.running = True

    # -- reports ------------------------------------------------------------------------------------
    def poll(self, timeout_s: float | None) -> list[RequestOutput]:
        """Reports that arrived (waiting up to timeout_s for the first) -> RequestOutputs."""
        return self.apply(self.channel.recv(timeout_s))

    def apply(self, reports: list[Report]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outs: list[RequestOutput] = []
        now = time.time()
        generated = 0
        get, tokenizer = self.requests.get, self.tokenizer
        for rep in reports:
            if rep.rank in self.lost:
                continue   # sent before it died: its requests were re-admitted from what we had
            if rep.recovered is not None:
                self._recovered(rep.recovered)
            self._waves(rep)
            if rep.stats is not None:
                self.rank_stats[rep.rank] = rep.stats
            if rep.kv_events is not None and self.router is not None:
                self.router.update(rep.rank, rep.kv_events)
            if rep.error:
                self.errors.append(f"rank {rep.rank}: {rep.error}")
            generated += rep.generated
            for d in rep.deltas:
                st = get(d.request_id)
                if st is None:
                    continue
                had_token = bool(st.token_ids)
                advanced = st.apply(d, now)
                if not had_token and st.token_ids:
                    self._release(st.request_id, first_token_only=True)
                params = st.params
                if params.stop and st.detokenize(tokenizer):
                    self.send(st.dp_rank, Abort(st.request_id))   # no more tokens for it on its rank
                group = st.group
                if group is not None and group.held and st is group.states[0] and (st.token_ids or st.finished):
                    self._release_held(group)
                finished = st.finish_reason is not None
                kind = params.output_kind
                if (advanced and kind != "final_only") or finished:
                    out = st.output(tokenizer, delta=kind == "delta")
                    if group is not None:
                        out = group.merge(out, kind)
                    if out is not None:
                        outs.append(out)
                if finished:
                    self._finished(st)
            if rep.left and self.resizing is not None:
                self._left(rep.rank)
            if rep.resized is not None and self.resizing is not None:
                if rep.rank not in self.domain_of:
                    self._joined(rep.rank)
                self.resizing.add(rep.rank, rep.resized)
        self.generated += generated
        self.tokens_log.append((time.monotonic(), generated))
        self.reports += len(reports)
        self.busy_s += time.perf_counter() - t0
        return outs

    def _recovered(self, rec: dict) -> None:
        """The ranks re-formed without rec["lost"] (every survivor reports it; act once per epoch):
        take the lost ranks out of their domains and re-admit their requests on the survivors, from
        the prompt, the tokens received so far and (seeded sampling) the generator state."""
        seen = next((r for r in self.recoveries if r["epoch"] == rec["epoch"]), None)
        if seen is not None:   # another survivor's figures for the same re-forming: add them up
            seen["recovery_s"] = max(seen["recovery_s"], rec.get("recovery_s", 0.0))
            for key in ("expert_bytes_peer", "expert_bytes_checkpoint"):
                seen[key] = seen.get(key, 0) + rec.get(key, 0)
            return
        if any(r["epoch"] > rec["epoch"] for r in self.recoveries):
            return
        self.recoveries.append(dict(rec))
        lost = set(rec["lost"]) - self.lost
        self.lost |= lost
        for d in self.domains:
            d.ranks = [r for r in d.ranks if r not in lost]
            for r in lost:
                d.load.pop(r, None)
            d.running = True   # the survivors step at once after re-forming
        for r in lost:
            self.domain_of.pop(r, None)
            self.rank_stats.pop(r, None)
            if self.router is not None:
                self.router.forget_rank(r)   # its cached prefixes went with it
        for rid, st in list(self.requests.items()):
            if st.dp_rank in lost:
                self._readmit(st)

    def _readmit(self, st: RequestState) -> None:
        bookings = self.cost.pop(st.request_id, [])
        domain = next((b[0] for b in bookings if not b[3]), self.domains[0])
        cost = len(st.prompt_token_ids) + st.max_tokens
        if st.group is not None:   # a held sample goes now, readmitted, and never again when released
            st.group.held = [(s, m) for s, m in st.group.held if s is not st]
        st.dp_rank = self.assign(domain, st.request_id, cost)
        st.readmitted += 1
        self.readmitted += 1
        resume = {"output_ids": list(st.token_ids), "cumulative_logprob": st.cumulative_logprob,
                  "generator_state": st.generator_state}
        self.send(st.dp_rank, NewRequest(st.request_id, list(st.prompt_token_ids), st.params, st.max_tokens,
                                         st.arrival_time, extra={"resume": resume}))

    def _finished(self, st: RequestState) -> None:
        del self.requests[st.request_id]
        if st.group is not None and st.group.finished:
            del self.groups[st.group.request_id]
        self._release(st.request_id, first_token_only=False)
        self.finished.append(dict(st.metrics(), request_id=st.request_id))

    def _waves(self, rep: Report) -> None:
        d = self.domain_of.get(rep.rank)
        if d is None:
            return
        if rep.idle_wave is not None and rep.idle_wave > d.wave:
            d.wave, d.running = rep.idle_wave, False
        if rep.start_wave is not None and (rep.start_wave > d.wave or not d.running):
            d.wave = max(d.wave, rep.start_wave)
            self.channel.broadcast(d.ranks, Wake(d.wave))
            d.running = True

    # -- metrics ------------------------------------------------------------------------------------
    def metrics(self, window_s: float = 10.0, waiting_extra: int = 0, ranks: list[int] | None = None) -> dict:
        """Engine-wide: running/waiting, KV blocks, prefix-cache hit rate, tokens/s over the last
        window_s seconds, per-rank stats, and per-request TTFT/TPOT/queue time of finished requests.
        ranks: only these ranks' stats count (a disaggregated job's decode pool; default every rank's)."""
        now = time.monotonic()
        while self.tokens_log and now - self.tokens_log[0][0] > window_s:
            self.tokens_log.popleft()
        span = now - self.tokens_log[0][0] if len(self.tokens_log) > 1 else 0.0
        recent = sum(n for _, n in list(self.tokens_log)[1:])
        st = [self.rank_stats[r] for r in sorted(self.rank_stats) if ranks is None or r in ranks]

        def total(key):
            return sum(s.get(key, 0) for s in st)
        q = total("prefix_queried_tokens")
        return {"running": total("running"), "waiting": total("waiting") + waiting_extra,
                "kv_blocks_used": total("kv_blocks_used"), "kv_blocks_free": total("kv_blocks_free"),
                "prefix_cache_hit_rate": total("prefix_hit_tokens") / q if q else 0.0,
                "preemptions": total("preemptions"), "generation_tokens_total": self.generated,
                "tokens_per_s": recent / span if span > 0 else 0.0,
                "per_rank": st, "finished_requests": list(self.finished),
                "rank_losses": len(self.lost), "recoveries": list(self.recoveries),
                "requests_readmitted": self.readmitted, "resizes": list(self.resizes),
                "recovery_s_last": self.recoveries[-1]["recovery_s"] if self.recoveries else 0.0,
                "expert_bytes_refetched_peer": sum(r.get("expert_bytes_peer", 0) for r in self.recoveries),
                "expert_bytes_refetched_checkpoint": sum(r.get("expert_bytes_checkpoint", 0) for r in self.recoveries),
                "routing_decisions": dict(self.routing), "decode_plan": _decode_plan_totals(st), **tier_totals(st),
                **_spec_totals(st)}


def _spec_totals(per_rank: list[dict]) -> dict:
    """Speculative decoding summed over the ranks (vLLM's spec_decode metrics): drafts (verifications that
    had drafts), draft tokens, accepted tokens, accepted per draft position, acceptance rate, mean accepted
    length (1 + accepted / drafts: tokens a verification step gives), backoffs, MTP retirements. Empty when off."""
    ranks = [s for s in per_rank if "spec_num_drafts" in s]
    if not ranks:
        return {}
    n, d, a = (sum(s[k] for s in ranks) for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                  "spec_num_accepted_tokens"))
    per_pos = [sum(x) for x in zip(*(s["spec_accepted_per_pos"] for s in ranks))]
    return {"spec_decode_num_drafts": n, "spec_decode_num_draft_tokens": d, "spec_decode_num_accepted_tokens": a,
            "spec_decode_num_accepted_tokens_per_pos": per_pos,
            "spec_decode_acceptance_rate": a / d if d else 0.0,
            "spec_decode_mean_acceptance_length": 1 + a / n if n else 0.0,
            "spec_decode_backoffs": sum(s["spec_backoffs"] for s in ranks),
            "spec_decode_paused_seqs": sum(s["spec_paused_seqs"] for s in ranks),
            "spec_decode_steps_batch_off": sum(s["spec_steps_batch_off"] for s in ranks),
            "spec_decode_retired": sum(s.get("spec_retired_seqs", 0) for s in ranks),
            "spec_decode_started_paused": sum(s.get("spec_started_paused", 0) for s in ranks),
            "spec_decode_rank_pause_max": max(s.get("spec_rank_pause", 0) for s in ranks)}


def _decode_plan_totals(per_rank: list[dict]) -> dict:
    """The CPU decode plan's counters summed over the ranks: {"steps": {path: n}, "declined": {reason: n},
    "stack_declined": {reason: n}} (empty without the plan)."""
    out: dict[str, dict] = {}
    for group, prefix in (("steps", "decode_steps_"), ("declined", "decode_declined_"),
                          ("stack_declined", "decode_stack_declined_")):
        for st in per_rank:
            for key, v in st.items():
                if key.startswith(prefix):
                    d = out.setdefault(group, {})
                    d[key[len(prefix):]] = d.get(key[len(prefix):], 0) + v
    return out
