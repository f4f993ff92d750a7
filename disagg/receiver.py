"""Decode side of a KV transfer: wait for blocks, receive the prefill's latent KV into the paged
cache, and hand back a Sequence that is ready to decode (its first token already sampled).

Per transfer (see prefill.py for the message order; with MTP the drafter's layer is one more payload and
its first drafts ride in the trailer): wait for blocks, then a thread receives
header -> L layer payloads (into staging) -> header ... -> trailer, and each step copies the
chunks that have arrived into the sequence's blocks. Nothing is received before the blocks for the
whole prompt are allocated: until then the prefill rank's sends wait (back-pressure). Transfers are
accepted first come, first served; an abort of one still in flight takes effect when it completes.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from wideep.attention_v4.transfer import pieces, scatter, staging as v4_staging
from wideep.engine.worker.core import EngineCore
from wideep.engine.sched.sequence import Sequence
from wideep.parallel.watchdog import guard_collective

from .kv_transfer import TorchKVTransfer, recv_object


@dataclass
class Incoming:
    seq: Sequence
    tid: int
    src: int                                   # global prefill rank
    accepted: float | None = None              # time.time() when blocks were allocated
    chunks: deque = field(default_factory=deque)   # (header, staging per layer) received, not yet in the cache
    trailer: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    bytes: int = 0
    aborted: bool = False
    views: list | None = None                  # DeepSeek-V4: the layers' views of its blocks (attention_v4/paged.py)


class KVReceiver:
    """Each accepted transfer is received by its own thread, message after message as they arrive
    (so the KV lands while the prefill rank is still computing later layers, whatever the decode
    steps are doing); the step loop copies finished chunks into the cache and finishes transfers."""

    def __init__(self, core: EngineCore, kv: TorchKVTransfer, rank: int):
        self.core, self.kv, self.rank = core, kv, rank
        # every per-layer tensor of the cache, in the order the prefill rank sends them (layer by layer:
        # the latents, then DSA's indexer keys); DeepSeek-V4: each layer's pieces (attention_v4/transfer.py)
        self.v4 = core.config.v4 is not None
        self.pools = None if self.v4 else core.kv.all_pools()
        self.pending: dict[str, Incoming] = {}   # request id -> transfer, in arrival order
        self.bytes_received = 0
        self.transfers_done = 0

    def expect(self, seq: Sequence, tid: int, src: int) -> None:
        """seq: made for this rank (its prompt is computed by the prefill rank src)."""
        self.pending[seq.request_id] = Incoming(seq, tid, src)

    def abort(self, request_id: str) -> bool:
        inc = self.pending.get(request_id)
        if inc is not None:
            inc.aborted = True  # finished when its transfer is (the prefill rank is sending regardless)
        return inc is not None

    def _accept(self, inc: Incoming, room: int) -> bool:
        n = len(inc.seq.prompt_token_ids)
        blocks = self.core.blocks
        if room <= 0 or not blocks.can_grow(inc.seq, n):
            return False
        blocks.grow(inc.seq, n)
        if self.v4:   # the layers' views of its blocks, and what its own chunks did not write (the window's head)
            inc.views = self.core.kv.views(inc.seq)
            inc.seq.stream_tables.first_written = max(0, n - self.core.kv.geometry.window)
        inc.accepted = time.time()
        threading.Thread(target=self._receive, args=(inc,), daemon=True, name=f"kv-recv-{inc.tid}").start()
        return True

    def _receive(self, inc: Incoming) -> None:
        """The transfer's thread: header, L layers (all posted at once, landing as each is sent), ...,
        trailer. Never touches the cache or the blocks."""
        try:
            while True:
                chunk = recv_object(self.kv, inc.src, inc.tid)
                rows = chunk["hi"] - chunk["lo"]
                if self.v4:
                    staging = [b for layer in inc.views for b in v4_staging(layer, chunk["lo"], chunk["hi"],
                                                                            chunk["last"])]
                else:
                    staging = [torch.empty(rows, p.shape[1], dtype=p.dtype, device=p.device) for p in self.pools]
                for h in [self.kv.recv_start(inc.src, inc.tid, buf) for buf in staging]:
                    h.wait()
                inc.chunks.append((chunk, staging))
                if chunk["last"]:
                    break
            inc.trailer = recv_object(self.kv, inc.src, inc.tid)
        except BaseException as e:  # a dead peer: raised in the step loop
            inc.error = e
        inc.done.set()

    def _store(self, inc: Incoming) -> None:
        """Copy the chunks received so far into the sequence's blocks."""
        kv = self.core.kv
        while inc.chunks:
            chunk, staging = inc.chunks.popleft()
            if self.v4:
                lo, hi, last = chunk["lo"], chunk["hi"], chunk["last"]
                for layer in inc.views:
                    k = len(pieces(layer, lo, hi, last))
                    scatter(layer, staging[:k], lo, hi, last)
                    inc.bytes += sum(b.numel() * b.element_size() for b in staging[:k])
                    staging = staging[k:]
                continue
            slots = kv.slots(inc.seq.block_ids, chunk["lo"], chunk["hi"])
            for pool, buf in zip(self.pools, staging, strict=True):
                pool.index_copy_(0, slots, buf)
                inc.bytes += buf.numel() * buf.element_size()

    def _finish(self, inc: Incoming, t: dict) -> None:
        seq, now = inc.seq, time.time()
        seq.num_computed = len(seq.prompt_token_ids)
        if self.v4:
            self.core.kv.adopt(seq)
        seq.first_scheduled_time = t["prefill_start"]
        seq.prompt_logprobs = t["prompt_logprobs"]
        if t["generator_state"] is not None:
            seq.generator.set_state(t["generator_state"])
        seq.append(t["token"], t["logprob"], t["top"])   # stamps first_token_time: TTFT includes the transfer
        spec = self.core.scheduler.speculator
        if t["mtp_drafts"] and spec is not None:   # the MTP drafter's, from the prompt's last row: verified next step
            spec.state(seq).mtp_drafts = list(t["mtp_drafts"])
        # kv_transfer_s: first layer sent -> last message in (overlaps the prefill's later layers and
        # chunks); kv_exposed_s: prefill done -> first token usable here (what the transfer adds to TTFT)
        seq.extra_metrics.update({"kv_transfer_bytes": inc.bytes, "kv_transfer_s": now - (t["first_send"] or now),
                        "kv_exposed_s": now - t["prefill_done"],
                        "kv_wait_for_blocks_s": inc.accepted - seq.arrival_time, "prefill_rank": t["prefill_rank"],
                        "decode_rank": self.rank, "prefill_layer_done_s": t["layer_done_s"],
                        "kv_send_start_s": t["send_start_s"]})
        self.bytes_received += inc.bytes
        self.transfers_done += 1
        if inc.aborted:
            seq.abort()

    def progress(self, room: int) -> list[Sequence]:
        """Accept transfers in order while blocks and `room` (free running slots) allow, store what has
        arrived; -> the sequences whose transfer completed (finished ones included)."""
        done, blocked = [], False
        room -= sum(1 for i in self.pending.values() if i.accepted is not None)
        for rid, inc in list(self.pending.items()):
            if inc.accepted is None:
                # first come, first served: once one waits, later ones wait behind it
                blocked = blocked or not self._accept(inc, room)
                if blocked:
                    continue
                room -= 1
            finished = inc.done.is_set()
            if inc.error is not None:
                with guard_collective(self.kv.ctx):
                    raise inc.error
            self._store(inc)
            if finished:
                self._finish(inc, inc.trailer)
                done.append(inc.seq)
                del self.pending[rid]
        return done

    def stats(self) -> dict:
        waiting = sum(1 for i in self.pending.values() if i.accepted is None)
        return {"kv_transfers_waiting_for_blocks": waiting, "kv_transfers_in_flight": len(self.pending) - waiting,
                "kv_bytes_received": self.bytes_received, "kv_transfers_done": self.transfers_done}
