"""Online engine for serving stacks: add_request / step / abort, continuous batching on every DP rank.

Rank 0 is the front: it validates requests, assigns each to the DP rank with the fewest tokens in
flight, and at every step broadcasts the step's new and aborted requests; each rank runs its own
scheduler and attention, all ranks run the MoE all-to-alls in lockstep (a rank without work runs a
zero-token step), and the requests that advanced come back to rank 0. Other ranks call
run_worker_loop() until rank 0 calls shutdown().

    engine = Engine(model=dir, kv_cache_blocks=..., block_size=64, max_num_seqs=..., enable_prefix_caching=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from parallel.watchdog import guard_collective

from .core import EngineCore
from .sampling_params import RequestOutput, SamplingParams
from .sequence import Sequence
from .spmd import Doorbell, least_loaded


@dataclass
class _New:
    request_id: str
    dp_rank: int
    text: str | None
    ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: float  # time.time() when add_request accepted it: TTFT and queue time count from here


@dataclass
class _Control:
    """What rank 0 broadcasts before every step."""
    command: str = "step"  # "step" | "end" (leave the worker loop) | "shutdown"
    new: list[_New] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class Engine:
    """Options (LLM takes the same): model (HF dir), dtype, device, max_model_len, block_size (64),
    kv_cache_blocks or kv_cache_memory (bytes), max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, seed, dp_size, ep_size, dispatch_backend, parallel (dict), ctx,
    experts_backend ("auto" | "torch" | "triton" | "deepgemm"), attention_backend ("auto" | "torch" | "triton")."""

    def __init__(self, model: str, **options):
        self.core = EngineCore(model, **options)
        self.ctx = self.core.ctx
        self._seqs: dict[str, Sequence] = {}           # this rank's live sequences
        # front (rank 0) state
        self._new: list[_New] = []
        self._aborts: list[str] = []
        self._owner: dict[str, int] = {}                # unfinished request -> DP rank
        self._cost: dict[str, int] = {}
        self._load = [0] * self.ctx.dp_size             # tokens in flight per DP rank
        self._rank_stats: list[dict] = [self.core.stats()] * self.ctx.dp_size
        self._finished: deque[dict] = deque(maxlen=10000)  # per-request metrics of finished requests
        self._tokens_log: deque[tuple[float, int]] = deque()
        self._generated = 0
        self._closed = False
        self._bell = Doorbell(self.ctx)

    @property
    def is_front(self) -> bool:
        return self.ctx.rank == 0

    # -- front API (rank 0) -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; it joins the batch at the next step. Errors leave the engine as it was."""
        request_id, text, ids, params, max_tokens = self._accept(request_id, prompt, params)
        rank = self._assign(request_id, len(ids) + max_tokens)
        self._new.append(_New(request_id, rank, text, ids, params, max_tokens, time.time()))

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and cache; -> its max_tokens."""
        return self.core.validate(ids, params)

    def _accept(self, request_id, prompt, params: SamplingParams | None) -> tuple:
        """Front-side checks that change nothing. -> (request_id, text, ids, params, max_tokens)."""
        if not self.is_front:
            raise RuntimeError(f"add_request is for rank 0 (the front); this is rank {self.ctx.rank}")
        request_id = str(request_id)
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        params = params if params is not None else SamplingParams()
        text, ids = self.core.tokenize(prompt)
        return request_id, text, ids, params, self.validate(ids, params)

    def _assign(self, request_id: str, cost: int) -> int:
        """Book the request on the least-loaded DP rank (cost: its tokens in flight); -> that rank."""
        rank = least_loaded(self._load)
        self._load[rank] += cost
        self._owner[request_id], self._cost[request_id] = rank, cost
        return rank

    def abort(self, request_id: str) -> None:
        if not self.is_front:
            raise RuntimeError(f"abort is for rank 0 (the front); this is rank {self.ctx.rank}")
        request_id = str(request_id)
        if request_id not in self._owner:
            raise ValueError(f"unknown request id {request_id!r} (never added, or already finished)")
        if request_id not in self._aborts:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[RequestOutput]:
        """Collective. -> a RequestOutput for every request that advanced (or finished) this step."""
        if not self.is_front:
            raise RuntimeError("step() is driven by rank 0; other ranks call run_worker_loop()")
        ctl = _Control("step", self._new, self._aborts)
        self._new, self._aborts = [], []
        self._broadcast(ctl)
        outs, stats = self._local_step(ctl)
        per_rank = [(outs, stats)] if self.ctx.is_single else self._gather((outs, stats))
        outs = [o for rank_outs, _ in per_rank for o in rank_outs]
        self._rank_stats = [st for _, st in per_rank]
        now = time.monotonic()
        for o in outs:
            if o.finished and o.request_id in self._owner:
                rank = self._owner.pop(o.request_id)
                self._load[rank] -= self._cost.pop(o.request_id)
                self._finished.append(dict(o.metrics or {}, request_id=o.request_id))
        n = sum(st["generated"] for st in self._rank_stats)
        self._generated += n
        self._tokens_log.append((now, n))
        return outs

    def shutdown(self) -> None:
        """Rank 0: tell the workers to stop, then leave the process group. Others: leave it."""
        if self._closed:
            return
        self._closed = True
        if self.is_front and not self.ctx.is_single:
            self._broadcast(_Control("shutdown"))
        if not self.ctx.is_single:
            from parallel import shutdown
            shutdown(self.ctx)

    # -- workers ------------------------------------------------------------------------------------
    def run_worker_loop(self) -> str:
        """Ranks other than 0: follow rank 0's steps until it ends the loop ("end") or shuts down."""
        if self.is_front:
            raise RuntimeError("run_worker_loop is for ranks other than 0")
        while True:
            ctl = self._broadcast(None)
            if ctl.command == "shutdown":
                self.shutdown()
                return "shutdown"
            if ctl.command == "end":
                return "end"
            self._gather(self._local_step(ctl))

    def end_worker_loop(self) -> None:
        """Rank 0: let the workers return from run_worker_loop (without shutting down)."""
        if self.is_front and not self.ctx.is_single:
            self._broadcast(_Control("end"))

    # -- one step on this rank ----------------------------------------------------------------------
    def _local_step(self, ctl: _Control) -> tuple[list[RequestOutput], dict]:
        core, sched = self.core, self.core.scheduler
        outs: list[RequestOutput] = []
        for n in ctl.new:
            if n.dp_rank == self.ctx.dp_rank:
                seq = core.make_sequence(n.request_id, n.text, n.ids, n.params, n.max_tokens)
                seq.arrival_time = n.arrival
                self._seqs[n.request_id] = seq
                sched.add(seq)
        for rid in ctl.aborts:
            seq = self._seqs.pop(rid, None)
            if seq is not None:
                sched.finish(seq)
                seq.finish_reason, seq.finish_time = "abort", time.time()
                outs.append(core.output(seq, delta=seq.params.output_kind == "delta"))
        generated = 0
        batch = sched.schedule() if sched.has_work() else None
        tokens = batch.num_tokens if batch is not None else []
        can_split, vote = core.split_votes(tokens)
        any_work, plan = core.sync.sync(sched.has_work(), can_split, vote, sum(tokens))
        if any_work:
            t0 = time.perf_counter()
            if batch is not None and batch.seqs:
                before = {id(s): len(s.output_token_ids) for s in batch.seqs}
                core.runner.execute(batch, plan)
                for s in batch.seqs:
                    core.blocks.register_computed(s)
                    advanced = len(s.output_token_ids) > before[id(s)]
                    generated += advanced
                    if s.finished:
                        sched.finish(s)
                        self._seqs.pop(s.request_id, None)
                    kind = s.params.output_kind
                    if (advanced and kind != "final_only") or s.finished:
                        outs.append(core.output(s, delta=kind == "delta"))
            elif self.ctx.is_single:
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            else:
                core.runner.dummy_step(plan)  # keep the MoE all-to-alls in lockstep
            core.after_step(tokens, plan.split, time.perf_counter() - t0)
        return outs, dict(core.stats(), generated=generated)

    # -- collectives --------------------------------------------------------------------------------
    def _broadcast(self, ctl: _Control | None) -> _Control:
        if self.ctx.is_single:
            return ctl
        if self.is_front:
            self._bell.ring()
        else:
            self._bell.wait()   # however long the front stays idle
        box = [ctl]
        with guard_collective(self.ctx):
            dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
        return box[0]

    def _gather(self, item):
        """-> on rank 0 every rank's item in rank order; None elsewhere."""
        if self.ctx.is_single:
            return [item]
        out = [None] * self.ctx.world_size if self.is_front else None
        with guard_collective(self.ctx):
            dist.gather_object(item, out, dst=0, group=self.ctx.cpu_group)
        if self.is_front:
            self._bell.ack()
        return out

    # -- metrics ------------------------------------------------------------------------------------
    def metrics(self, window_s: float = 10.0) -> dict:
        """Engine-wide (rank 0): running/waiting, KV blocks, prefix-cache hit rate, tokens/s over the
        last window_s seconds, and per-request TTFT/TPOT/queue time of finished requests."""
        now = time.monotonic()
        while self._tokens_log and now - self._tokens_log[0][0] > window_s:
            self._tokens_log.popleft()
        span = now - self._tokens_log[0][0] if len(self._tokens_log) > 1 else 0.0
        recent = sum(n for _, n in list(self._tokens_log)[1:])
        st = self._rank_stats
        q = sum(s["prefix_queried_tokens"] for s in st)
        return {"running": sum(s["running"] for s in st), "waiting": sum(s["waiting"] for s in st) + len(self._new),
                "kv_blocks_used": sum(s["kv_blocks_used"] for s in st),
                "kv_blocks_free": sum(s["kv_blocks_free"] for s in st),
                "prefix_cache_hit_rate": sum(s["prefix_hit_tokens"] for s in st) / q if q else 0.0,
                "preemptions": sum(s["preemptions"] for s in st),
                "generation_tokens_total": self._generated,
                "tokens_per_s": recent / span if span > 0 else 0.0,
                "per_rank": list(st), "finished_requests": list(self._finished)}
