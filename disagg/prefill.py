"""A prefill-pool rank: computes prompts and streams their latent KV to decode ranks, layer by layer.

Messages of one transfer (KVTransfer stream = the transfer id tid, prefill rank -> decode rank), in order:
    header {lo, hi, last}          before the chunk's forward: tokens lo..hi-1 follow
    L payloads [hi-lo, D]          layer i's latents, sent the moment layer i is done (Splitwise)
    ... more chunks (chunked prefill, or a cached prefix sent first from the prefix cache) ...
    trailer {token, logprob, ...}  after sampling: the first token and the prefill's timings
A finished prefill keeps its blocks until every send has completed, so a decode rank that cannot
take the KV yet holds this rank's cache, which in turn stops the scheduler from admitting more:
back-pressure, nothing dropped. Legend: L layers, D = kv_lora_rank + rope dim, T tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.core import EngineCore
from parallel.step_plan import StepPlan
from parallel.watchdog import guard_collective

from .kv_transfer import Handle, send_object
from .roles import Roles

END, SHUTDOWN = 1, 2


@dataclass
class _Job:
    tid: int
    dst: int                                   # global decode rank
    handles: list[Handle] = field(default_factory=list)
    sent_upto: int = 0                         # rows 0 .. sent_upto-1 are sent (or being sent)
    bytes: int = 0
    first_send: float | None = None            # time.time() of the first payload send
    layer_done: list[float] = field(default_factory=list)   # perf_counter, last chunk
    send_start: list[float] = field(default_factory=list)   # perf_counter, last chunk


class PrefillWorker:
    """Built on every prefill-pool rank; run_worker_loop() until the front ends or shuts down the job."""

    def __init__(self, model: str, roles: Roles, **options):
        self.roles, self.kv, self.box = roles, roles.kv, roles.mailbox
        self.core = EngineCore(model, ctx=roles.pool_ctx, **options)
        self.ctx = roles.ctx
        self._jobs: dict[str, _Job] = {}           # request id -> job (prefilling or sending)
        self._sending: dict[str, object] = {}      # request id -> finished Sequence whose sends are in flight
        self._command = 0
        self.prefilled_tokens = 0

    is_front = False

    # -- control ----------------------------------------------------------------------------------
    def _read_mailbox(self) -> None:
        with guard_collective(self.ctx):  # the store lives on rank 0: its loss is named, not a socket error
            msgs = self.box.poll(0)
        for kind, body in msgs:
            if kind == "new":
                seq = self.core.make_sequence(body["request_id"], None, body["ids"], body["params"], 1)
                seq.arrival_time = body["arrival"]
                self._jobs[seq.request_id] = _Job(body["tid"], body["dst"])
                self.core.scheduler.add(seq)
            else:
                self._command = max(self._command, END if kind == "end" else SHUTDOWN)

    def _sync(self, has_batch: bool, num_tokens: int) -> tuple[bool, int, StepPlan]:
        """Pool-wide: (any prefill rank has a batch to run, END/SHUTDOWN seen by any rank, the step's
        plan: normal-mode dispatch, never split)."""
        flags = torch.tensor([int(has_batch), self._command, num_tokens], dtype=torch.int64)
        if self.roles.pool_ctx.world_size > 1:
            with guard_collective(self.ctx):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.roles.pool_ctx.cpu_group)
        any_work, command, max_tokens = flags.tolist()  # SYNC: the loop's control flow
        return bool(any_work), command, StepPlan(max_tokens)

    def _reap(self, block: bool = False) -> None:
        """Free the blocks of finished prefills whose sends have all completed."""
        for rid, seq in list(self._sending.items()):
            job = self._jobs[rid]
            if block:
                for h in job.handles:
                    h.wait()
            if all(h.done() for h in job.handles):
                self.core.blocks.free(seq)
                del self._sending[rid], self._jobs[rid]

    def run_worker_loop(self) -> str:
        idle = self.roles.cfg.idle_sleep_s
        while True:
            self._read_mailbox()
            self._reap()
            sched = self.core.scheduler
            batch = sched.schedule() if sched.has_work() else None
            # a rank whose waiting prompts find no free blocks (its cache held by sends the decode
            # pool has not taken yet) waits here instead of spinning through empty steps
            has_batch = batch is not None and bool(batch.seqs)
            any_work, command, plan = self._sync(has_batch, sum(batch.num_tokens) if has_batch else 0)
            if any_work:
                if has_batch:
                    self._step(batch, plan)
                else:
                    self.core.runner.dummy_step(plan)  # keep the pool's MoE all-to-alls in lockstep
            elif command:
                self._reap(block=True)
                self._command = 0
                if command == SHUTDOWN:
                    self.shutdown()
                    return "shutdown"
                return "end"
            else:
                time.sleep(idle)

    # -- one prefill step -------------------------------------------------------------------------
    def _slots(self, seq, lo: int, hi: int) -> torch.Tensor:
        bs = self.core.kv.block_size
        return torch.tensor([seq.block_ids[j // bs] * bs + j % bs for j in range(lo, hi)], dtype=torch.int64,
                            device=self.core.kv.pools[0].device)

    def _send_rows(self, job: _Job, slots: torch.Tensor, layer: int) -> None:
        rows = self.core.kv.pools[layer].index_select(0, slots)  # [T, D]: a copy, the blocks stay writable
        if job.first_send is None:
            job.first_send = time.time()
        job.handles.append(self.kv.send_start(job.dst, job.tid, rows))
        job.bytes += rows.numel() * rows.element_size()

    def _step(self, batch, plan: StepPlan) -> None:
        core = self.core
        L = len(core.kv.pools)
        chunks = []  # (job, slots of this step's tokens)
        for s, n in zip(batch.seqs, batch.num_tokens):
            job, lo = self._jobs[s.request_id], s.num_computed
            if lo > job.sent_upto:  # a prefix-cache hit: rows never sent for this request go first, from the cache
                job.handles += send_object(self.kv, job.dst, job.tid, {"lo": job.sent_upto, "hi": lo, "last": False})
                slots = self._slots(s, job.sent_upto, lo)
                for i in range(L):
                    self._send_rows(job, slots, i)
            job.sent_upto = max(job.sent_upto, lo + n)
            last = lo + n == len(s.prompt_token_ids)
            job.handles += send_object(self.kv, job.dst, job.tid, {"lo": lo, "hi": lo + n, "last": last})
            if last:
                job.layer_done, job.send_start = [], []
            chunks.append((job, self._slots(s, lo, lo + n), last))

        def on_layer(i: int) -> None:
            now = time.perf_counter()
            for job, slots, last in chunks:
                if last:
                    job.layer_done.append(now)
                    job.send_start.append(time.perf_counter())
                self._send_rows(job, slots, i)

        t0 = time.perf_counter()
        core.runner.execute(batch, plan, on_layer=on_layer)
        self.prefilled_tokens += sum(batch.num_tokens)
        stats = core.stats()
        for s in batch.seqs:
            core.blocks.register_computed(s)
            if not s.finished:
                continue
            job = self._jobs[s.request_id]
            core.scheduler.running.remove(s)  # its blocks stay held until the sends complete (_reap)
            self._sending[s.request_id] = s
            gen = s.generator.get_state() if s.generator is not None and s.params.seed is not None else None
            trailer = {"token": s.output_token_ids[0], "logprob": s.cumulative_logprob,
                       "top": s.logprobs[0] if s.logprobs else None, "prompt_logprobs": s.prompt_logprobs,
                       "generator_state": gen, "prefill_start": s.first_scheduled_time, "first_send": job.first_send,
                       "bytes": job.bytes, "prefill_rank": self.roles.rank, "prefill_stats": stats,
                       "layer_done_s": [t - t0 for t in job.layer_done],
                       "send_start_s": [t - t0 for t in job.send_start], "prefill_done": time.time()}
            job.handles += send_object(self.kv, job.dst, job.tid, trailer)

    def shutdown(self) -> None:
        from parallel import shutdown
        shutdown(self.ctx)
