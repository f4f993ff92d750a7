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


class KVReceiver:
    """Each accepted transfer is received by its own thread, message after message as they arrive
    (so the KV lands while the prefill rank is still computing later layers, whatever the decode
    steps are doing); the step loop copies finished chunks into the cache and finishes transfers."""

    def __init__(self, core: EngineCore, kv: TorchKVTransfer, rank: int):
        # the cache's rows arrive as the prefill rank sends them: per chunk, layer by layer, each layer's pieces as
        # the KV cache gathers them (KVCache.staging / scatter: the latents then DSA's indexer keys; DeepSeek-V4's
        # streams, attention_v4/transfer.py)
        self.core, self.kv, self.rank = core, kv, rank
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
        self.core.kv.receiving(inc.seq, n)
        inc.accepted = time.time()
        threading.Thread(target=self._receive, args=(inc,), daemon=True, name=f"kv-recv-{inc.tid}").start()
        return True

    def _receive(self, inc: Incoming) -> None:
        """The transfer's thread: header, L layers (all posted at once, landing as each is sent), ...,
        trailer. Never touches the cache or the blocks."""
        cache = self.core.kv
        try:
            while True:
                header = recv_object(self.kv, inc.src, inc.tid)
                chunk = cache.chunk(inc.seq, header["lo"], header["hi"], header["last"])
                staging = [cache.staging(chunk, layer) for layer in range(cache.transfer_layers)]
                for h in [self.kv.recv_start(inc.src, inc.tid, buf) for layer in staging for buf in layer]:
                    h.wait()
                inc.chunks.append((header, chunk, staging))
                if header["last"]:
                    break
            inc.trailer = recv_object(self.kv, inc.src, inc.tid)
        except BaseException as e:  # a dead peer: raised in the step loop
            inc.error = e
        inc.done.set()

    def _store(self, inc: Incoming) -> None:
        """Copy the chunks received so far into the sequence's blocks."""
        cache = self.core.kv
        while inc.chunks:
            _, chunk, staging = inc.chunks.popleft()
            for layer, rows in enumerate(staging):
                cache.scatter(chunk, layer, rows)
                inc.bytes += sum(b.numel() * b.element_size() for b in rows)

    def _finish(self, inc: Incoming, t: dict) -> None:
        seq, now = inc.seq, time.time()
        seq.num_computed = len(seq.prompt_token_ids)
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
