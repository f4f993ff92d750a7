"""Decode side of a KV transfer: wait for blocks, receive the prefill's latent KV into the paged
cache, and hand back a Sequence that is ready to decode (its first token already sampled).

Per transfer (see prefill.py for the message order) the states are
    waiting for blocks -> header -> L layer payloads (into staging, then copied into the
    sequence's blocks) -> header ... -> trailer -> done.
Nothing is received before the blocks for the whole prompt are allocated: until then the prefill
rank's sends wait (back-pressure). Transfers are accepted first come, first served.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.core import EngineCore
from engine.sequence import Sequence

from .kv_transfer import Handle, ObjectRecv, TorchKVTransfer


@dataclass
class TransferredSequence(Sequence):
    """A Sequence whose prompt was computed elsewhere; its metrics add the transfer's."""
    transfer: dict = field(default_factory=dict)

    def metrics(self) -> dict:
        return {**super().metrics(), **self.transfer}


@dataclass
class Incoming:
    seq: TransferredSequence
    tid: int
    src: int                                   # global prefill rank
    accepted: float | None = None              # time.time() when blocks were allocated
    header: ObjectRecv | None = None
    chunk: dict | None = None                  # the header being received: lo, hi, last
    layers: list[Handle] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)
    trailer: ObjectRecv | None = None
    bytes: int = 0
    aborted: bool = False


class KVReceiver:
    def __init__(self, core: EngineCore, kv: TorchKVTransfer, rank: int):
        self.core, self.kv, self.rank = core, kv, rank
        self.pending: dict[str, Incoming] = {}   # request id -> transfer, in arrival order
        self.bytes_received = 0
        self.transfers_done = 0
        self.prefill_stats: dict[int, dict] = {}  # prefill global rank -> its stats when it last sent here

    def expect(self, core_seq: Sequence, tid: int, src: int) -> None:
        seq = TransferredSequence(**{k: getattr(core_seq, k) for k in Sequence.__dataclass_fields__})
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
        inc.accepted = time.time()
        inc.header = ObjectRecv(self.kv, inc.src, inc.tid)
        return True

    def _advance(self, inc: Incoming) -> bool:
        """Move one transfer as far as the arrived messages allow; -> True when the trailer is in."""
        pools = self.core.kv.pools
        while True:
            if inc.header is not None:
                chunk = inc.header.poll()
                if chunk is None:
                    return False
                inc.header, inc.chunk = None, chunk
                rows = chunk["hi"] - chunk["lo"]
                inc.staging = [torch.empty(rows, p.shape[1], dtype=p.dtype, device=p.device) for p in pools]
                inc.layers = [self.kv.recv_start(inc.src, inc.tid, buf) for buf in inc.staging]
            elif inc.layers:
                if not all(h.done() for h in inc.layers):
                    return False
                lo, hi = inc.chunk["lo"], inc.chunk["hi"]
                bs = self.core.kv.block_size
                slots = torch.tensor([inc.seq.block_ids[j // bs] * bs + j % bs for j in range(lo, hi)],
                                     dtype=torch.int64, device=pools[0].device)
                for pool, buf in zip(pools, inc.staging):
                    pool.index_copy_(0, slots, buf)
                    inc.bytes += buf.numel() * buf.element_size()
                inc.layers, inc.staging = [], []
                if inc.chunk["last"]:
                    inc.trailer = ObjectRecv(self.kv, inc.src, inc.tid)
                else:
                    inc.header = ObjectRecv(self.kv, inc.src, inc.tid)
            elif inc.trailer is not None:
                t = inc.trailer.poll()
                if t is None:
                    return False
                self._finish(inc, t)
                return True
            else:
                return False

    def _finish(self, inc: Incoming, t: dict) -> None:
        seq, now = inc.seq, time.time()
        seq.num_computed = len(seq.prompt_token_ids)
        seq.first_scheduled_time = t["prefill_start"]
        seq.prompt_logprobs = t["prompt_logprobs"]
        if t["generator_state"] is not None:
            seq.generator.set_state(t["generator_state"])
        seq.append(t["token"], t["logprob"], t["top"])   # stamps first_token_time: TTFT includes the transfer
        seq.transfer = {"kv_transfer_bytes": inc.bytes, "kv_transfer_s": now - (t["first_send"] or now),
                        "kv_wait_for_blocks_s": inc.accepted - seq.arrival_time, "prefill_rank": t["prefill_rank"],
                        "decode_rank": self.rank, "prefill_layer_done_s": t["layer_done_s"],
                        "kv_send_start_s": t["send_start_s"]}
        self.prefill_stats[t["prefill_rank"]] = t["prefill_stats"]
        self.bytes_received += inc.bytes
        self.transfers_done += 1
        if inc.aborted:
            seq.finish_reason, seq.finish_time = "abort", now

    def progress(self, room: int) -> list[TransferredSequence]:
        """Accept transfers in order while blocks and `room` (free running slots) allow, advance every
        accepted one; -> the sequences whose transfer completed (finished ones included)."""
        done, blocked = [], False
        room -= sum(1 for i in self.pending.values() if i.accepted is not None)
        for rid, inc in list(self.pending.items()):
            if inc.accepted is None:
                # first come, first served: once one waits, later ones wait behind it
                blocked = blocked or not self._accept(inc, room)
                if blocked:
                    continue
                room -= 1
            if self._advance(inc):
                done.append(inc.seq)
                del self.pending[rid]
        return done

    def stats(self) -> dict:
        waiting = sum(1 for i in self.pending.values() if i.accepted is None)
        return {"kv_transfers_waiting_for_blocks": waiting, "kv_transfers_in_flight": len(self.pending) - waiting,
                "kv_bytes_received": self.bytes_received, "kv_transfers_done": self.transfers_done,
                "prefill_stats": dict(self.prefill_stats)}
