"""The decode pool, and the front on its first rank (global rank 0).

DecodeHooks make the engine's step loop a decode rank: before each step it advances its KV transfers
(receiver.py); a transfer that completed joins the running batch (Scheduler.adopt) with its first
token, which is reported that step.

DisaggEngine is the Engine confined to its pool, with the front routing across both pools:
add_request picks a prefill rank (KV-aware: the one holding the longest cached prefix of the prompt,
weighed against load; else the least-loaded) and the least-loaded decode rank, sends the prompt to the prefill
rank's inbox (it computes the prompt and streams the KV) and tells the decode rank which transfer to
expect. The prefill rank's load is counted in prompt tokens until the request's first token is back.
"""
from __future__ import annotations

import dataclasses

from wideep.engine.front.engine import Engine
from wideep.engine.front.front import Domain
from wideep.engine.worker.messages import Abort, NewRequest
from wideep.engine.front.outputs import RequestState
from wideep.engine.worker.rank_loop import RankHooks, delta_of
from wideep.engine.sampling_params import SamplingParams

from .kv_transfer import TransferStats
from .receiver import KVReceiver


class DecodeHooks(RankHooks):
    def __init__(self, kv, rank: int):
        self.kv, self.rank = kv, rank
        self.core = None           # set by attach once the engine is built
        self.receiver: KVReceiver | None = None

    def attach(self, core) -> None:
        self.core = core
        self.receiver = KVReceiver(core, self.kv, self.rank)

    def handle(self, msg) -> bool:
        if isinstance(msg, NewRequest):   # the KV comes from a prefill rank: expect its transfer
            self.receiver.expect(self.core.make_sequence(msg), msg.extra["tid"], msg.extra["src"])
            return True
        if isinstance(msg, Abort):        # one still in transfer finishes (aborted) when it arrives
            return self.receiver.abort(msg.request_id)
        return False

    def before_schedule(self) -> list:
        sched, blocks = self.core.scheduler, self.core.blocks
        # preempted sequences get freed blocks before new transfers do
        room = 0 if sched.waiting else sched.max_num_seqs - len(sched.running)
        deltas = []
        for seq in self.receiver.progress(room):
            blocks.register_computed(seq)
            if seq.finished:
                blocks.free(seq)
            else:
                sched.adopt(seq)
            deltas.append(delta_of(seq))
        return deltas

    def has_pending(self) -> bool:
        return bool(self.receiver.pending)

    def stats(self) -> dict:
        return dict(self.receiver.stats(), role="decode")


class DisaggEngine(Engine):
    """Every rank of a disaggregated job builds one (make_engine); the front API is global rank 0's."""

    def __init__(self, model: str, roles, hooks, **options):
        cfg = roles.cfg
        self.roles = roles
        domains = [Domain(cfg.decode_ranks), Domain(cfg.prefill_ranks)]
        super().__init__(model, ctx=roles.pool_ctx, job_ctx=roles.ctx, hooks=hooks, domains=domains, **options)
        self.loop.idle_sleep_s = cfg.idle_sleep_s
        self.prefill_blocks: tuple[int, int] | None = None   # (blocks, block_size) of the smallest prefill rank

    def extra_stats(self) -> dict:
        """This rank's KV-transfer counters (LLM.stats): bytes and messages sent and received over the
        transfer group, KV rows and the pickled headers/trailers alike, per peer (global ranks)."""
        return {"kv_transfer": dataclasses.asdict(self.roles.kv.stats)}

    def reset_extra_stats(self) -> None:
        self.roles.kv.stats = TransferStats()   # between generations: no transfer is in flight

    def know_prefill_capacity(self, blocks: int, block_size: int) -> None:
        """The smallest prefill rank's cache (make_engine learns it once the pools are up): prompts that could
        never fit it are refused at the front."""
        self.prefill_blocks = (blocks, block_size)
        self._tid = 0

    @property
    def receiver(self) -> KVReceiver | None:
        """This decode rank's KV receiver (None on prefill ranks)."""
        return getattr(self.loop.hooks, "receiver", None)

    @property
    def prefills_in_flight(self) -> list[str]:
        """Front: requests whose first token is not back yet (prefilling or in transfer)."""
        return [rid for rid, st in self.front.requests.items() if not st.token_ids]

    # -- front --------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate against both pools, route, and send to both ranks. Errors change nothing."""
        request_id, text, ids, params, max_tokens = self._accept(request_id, prompt, params)
        if params.n > 1:   # the samples would have to share one transferred prompt: not built yet
            raise ValueError(f"SamplingParams.n={params.n}: n > 1 is not supported with disaggregation yet")
        decode, prefill = self.front.domains
        d = self.front.assign(decode, request_id, len(ids) + max_tokens)
        p = self.front.assign(prefill, request_id, len(ids), until_first_token=True, ids=ids)  # its cached prefix
        self._tid += 1
        st = RequestState(request_id, text, ids, params, max_tokens, d)
        req = NewRequest(request_id, ids, params, max_tokens, st.arrival_time)
        self._ensure_worker()
        self.front.add(st, dataclasses.replace(req, extra={"tid": self._tid, "src": p}))
        self.front.send(p, dataclasses.replace(req, extra={"tid": self._tid, "dst": d}))

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request against both pools; -> its max_tokens."""
        max_tokens = super().validate(ids, params)  # the decode rank holds prompt + output
        blocks, bs = self.prefill_blocks
        if -(-len(ids) // bs) > blocks:
            raise ValueError(f"prompt ({len(ids)} tokens) needs {-(-len(ids) // bs)} KV blocks on a prefill rank; "
                             f"its cache has {blocks} (disagg.prefill.kv_cache_blocks)")
        return max_tokens

    # -- metrics ------------------------------------------------------------------------------------
    def metrics(self, window_s: float = 10.0) -> dict:
        """The decode pool's view (running, KV blocks, tokens/s) plus per-pool views: each prefill
        rank's own latest stats and KV-transfer totals; per-request transfer bytes and time are in
        finished_requests."""
        self._front_only("metrics")
        front, cfg = self.front, self.roles.cfg
        decode = {r: front.rank_stats[r] for r in cfg.decode_ranks if r in front.rank_stats}
        prefill = {r: front.rank_stats.get(r) for r in cfg.prefill_ranks}
        m = front.metrics(window_s, ranks=cfg.decode_ranks)
        st = list(decode.values())
        fin = [f for f in m["finished_requests"] if "kv_transfer_bytes" in f]
        waiting_for_blocks = sum(s.get("kv_transfers_waiting_for_blocks", 0) for s in st)
        load = front.domains[1].load
        m["pools"] = {"decode": {"ranks": cfg.decode_ranks, "running": m["running"], "waiting": m["waiting"],
                                 "kv_blocks_used": m["kv_blocks_used"], "kv_blocks_free": m["kv_blocks_free"],
                                 "tokens_per_s": m["tokens_per_s"],
                                 "kv_transfers_waiting_for_blocks": waiting_for_blocks},
                      "prefill": {"ranks": cfg.prefill_ranks,
                                  "prompt_tokens_in_flight": [load[r] for r in cfg.prefill_ranks],
                                  "per_rank": [prefill[r] for r in cfg.prefill_ranks]}}
        m["kv_transfer"] = {"requests": len(fin), "bytes": sum(f["kv_transfer_bytes"] for f in fin),
                            "seconds": sum(f["kv_transfer_s"] for f in fin)}
        m.update(kv_transfer_bytes_total=sum(s.get("kv_bytes_received", 0) for s in st),
                 kv_transfers_total=sum(s.get("kv_transfers_done", 0) for s in st),
                 kv_transfers_waiting_for_blocks=waiting_for_blocks,
                 prefill_prompt_tokens_in_flight=sum(load.values()))
        return m
