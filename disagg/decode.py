"""The decode pool, and the front on its first rank (global rank 0).

DecodeEngine is the colocated Engine confined to the decode pool (its broadcast, step sync, MoE
all-to-all and gather run over the pool's groups), with two changes:
- add_request (front): picks the least-loaded prefill rank and decode rank, posts the request to the
  prefill rank's mailbox at once (the prefill pool does not wait for the front's steps) and tells
  the decode rank, in the next step's broadcast, which transfer to expect;
- every step, before scheduling, each decode rank advances its KV transfers (receiver.py); a
  completed one joins the running batch with its first token, which is reported in that step.
The prefill pool's load is counted in prompt tokens until the request's first token comes back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.engine import Engine, _Control, _New
from engine.sampling_params import RequestOutput, SamplingParams
from engine.spmd import least_loaded

from .receiver import KVReceiver
from .roles import Roles


@dataclass
class _Expect(_New):
    tid: int = 0          # transfer id: the KVTransfer stream
    src: int = 0          # global prefill rank


class DecodeEngine(Engine):
    def __init__(self, model: str, roles: Roles, **options):
        super().__init__(model, ctx=roles.pool_ctx, **options)
        self.roles = roles
        self.receiver = KVReceiver(self.core, roles.kv, roles.rank)
        self.prefill_blocks: tuple[int, int] | None = None   # (blocks, block_size) of the smallest prefill rank
        self._tid = 0
        self._pload = [0] * len(roles.cfg.prefill_ranks)      # prompt tokens in flight per prefill rank
        self._pcost: dict[str, tuple[int, int]] = {}

    # -- front ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate against both pools, route, and post to the prefill rank. Errors change nothing."""
        request_id, text, ids, params, max_tokens = self._accept(request_id, prompt, params)
        d = self._assign(request_id, len(ids) + max_tokens)
        p = least_loaded(self._pload)
        self._pload[p] += len(ids)
        self._pcost[request_id] = (p, len(ids))
        self._tid += 1
        cfg, now = self.roles.cfg, time.time()
        src, dst = cfg.prefill_ranks[p], cfg.decode_ranks[d]
        self.roles.mailbox.post(src, ("new", {"request_id": request_id, "ids": ids, "params": params,
                                              "tid": self._tid, "dst": dst, "arrival": now}))
        self._new.append(_Expect(request_id, d, text, ids, params, max_tokens, now, self._tid, src))

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request against both pools; -> its max_tokens."""
        max_tokens = super().validate(ids, params)  # the decode rank holds prompt + output
        blocks, bs = self.prefill_blocks
        if -(-len(ids) // bs) > blocks:
            raise ValueError(f"prompt ({len(ids)} tokens) needs {-(-len(ids) // bs)} KV blocks on a prefill rank; "
                             f"its cache has {blocks} (disagg.prefill.kv_cache_blocks)")
        return max_tokens

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        for o in outs:
            pc = self._pcost.pop(o.request_id, None)
            if pc is not None:  # its first token is back: the prefill (and the transfer) is over
                self._pload[pc[0]] -= pc[1]
        if not outs and not any(st["running"] for st in self._rank_stats):
            time.sleep(self.roles.cfg.idle_sleep_s)  # only transfers in flight: leave the cores to the prefill pool
        return outs

    def _tell_prefill(self, command: str) -> None:
        for r in self.roles.cfg.prefill_ranks:
            self.roles.mailbox.post(r, (command, None))

    def end_worker_loop(self) -> None:
        if self.is_front:
            self._tell_prefill("end")
        super().end_worker_loop()

    def shutdown(self) -> None:
        if self.is_front and not self._closed:
            self._tell_prefill("shutdown")
        super().shutdown()

    # -- every decode rank ------------------------------------------------------------------------
    def _local_step(self, ctl: _Control) -> tuple[list[RequestOutput], dict]:
        core, sched = self.core, self.core.scheduler
        for n in ctl.new:
            if n.dp_rank == self.ctx.dp_rank:
                seq = core.make_sequence(n.request_id, n.text, n.ids, n.params, n.max_tokens)
                seq.arrival_time = n.arrival
                self.receiver.expect(seq, n.tid, n.src)
        aborts = [rid for rid in ctl.aborts if not self.receiver.abort(rid)]
        # preempted sequences get freed blocks before new transfers do
        room = 0 if sched.waiting else sched.max_num_seqs - len(sched.running)
        outs = []
        for seq in self.receiver.progress(room):
            core.blocks.register_computed(seq)
            if seq.finished:
                core.blocks.free(seq)
            else:
                self._seqs[seq.request_id] = seq
                sched.running.append(seq)
            kind = seq.params.output_kind
            if kind != "final_only" or seq.finished:
                outs.append(core.output(seq, delta=kind == "delta"))
        more, stats = super()._local_step(_Control(ctl.command, [], aborts))
        stats = dict(stats, **self.receiver.stats(), generated=stats["generated"] + len(outs))
        return outs + more, stats

    # -- metrics ----------------------------------------------------------------------------------
    def metrics(self, window_s: float = 10.0) -> dict:
        """The colocated metrics for the decode pool, plus per-pool views: the prefill ranks' latest
        stats (carried with each transfer) and KV-transfer totals; per-request transfer bytes and
        time are in finished_requests."""
        m = super().metrics(window_s)
        st = self._rank_stats
        prefill = {}
        for s in st:
            prefill.update(s.get("prefill_stats", {}))
        fin = [f for f in m["finished_requests"] if "kv_transfer_bytes" in f]
        m["pools"] = {"decode": {"ranks": self.roles.cfg.decode_ranks, "running": m["running"],
                                 "waiting": m["waiting"], "kv_blocks_used": m["kv_blocks_used"],
                                 "kv_blocks_free": m["kv_blocks_free"], "tokens_per_s": m["tokens_per_s"],
                                 "kv_transfers_waiting_for_blocks": sum(s.get("kv_transfers_waiting_for_blocks", 0)
                                                                        for s in st)},
                      "prefill": {"ranks": self.roles.cfg.prefill_ranks,
                                  "prompt_tokens_in_flight": list(self._pload),
                                  "per_rank": [prefill.get(r) for r in self.roles.cfg.prefill_ranks]}}
        m["kv_transfer"] = {"requests": len(fin), "bytes": sum(f["kv_transfer_bytes"] for f in fin),
                            "seconds": sum(f["kv_transfer_s"] for f in fin)}
        m.update(kv_transfer_bytes_total=sum(s.get("kv_bytes_received", 0) for s in st),
                 kv_transfers_total=sum(s.get("kv_transfers_done", 0) for s in st),
                 kv_transfers_waiting_for_blocks=m["pools"]["decode"]["kv_transfers_waiting_for_blocks"],
                 prefill_prompt_tokens_in_flight=sum(self._pload))
        return m
