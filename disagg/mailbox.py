"""Mailbox: small control messages (new requests, shutdown) from the front to ranks that do not step
in lockstep with it (the prefill pool), through the rendezvous TCPStore every rank already holds.

    box.post(dst, obj)          # any rank -> global rank dst, never blocks on dst
    box.poll(src) -> [obj, ...] # this rank's messages from src, in order; [] when none (one store round trip)

Key mb/<dst>/<src>/<n>: the sender numbers its messages to each destination, the receiver reads them
in order and deletes them, so nothing is lost or read twice and no lock is needed.
"""
from __future__ import annotations

import pickle

import torch.distributed as dist

PREFIX = "wideep/disagg/mb/"


class Mailbox:
    def __init__(self, store, rank: int):
        self._store = dist.PrefixStore(PREFIX, store)
        self.rank = rank
        self._sent: dict[int, int] = {}   # dst -> messages posted
        self._read: dict[int, int] = {}   # src -> messages read

    def post(self, dst: int, obj) -> None:
        n = self._sent.get(dst, 0)
        self._store.set(f"{dst}/{self.rank}/{n}", pickle.dumps(obj))
        self._sent[dst] = n + 1

    def poll(self, src: int) -> list:
        out = []
        while True:
            n = self._read.get(src, 0)
            key = f"{self.rank}/{src}/{n}"
            if not self._store.check([key]):
                return out
            out.append(pickle.loads(self._store.get(key)))
            self._store.delete_key(key)
            self._read[src] = n + 1
