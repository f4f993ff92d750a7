"""GrammarCompiler: compiles specs on a small thread pool, off the caller's thread, and keeps the
results by spec (one compiler per backend and tokenizer: the key is the spec alone).

The front compiles a request's spec before admitting it, so a bad schema is the caller's ValueError
(a 400) and never a rank's failure; each rank compiles it again for itself (ranks are processes),
off its step loop: its request waits beside the scheduler until the grammar is ready. Rank 0 shares
its process, hence its compiler and cache, with the front.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from .backend import BACKENDS, Backend
from .params import StructuredOutputsParams

CACHE_ENTRIES = 1024   # compiled grammars kept per compiler (least recently used leaves first)


class GrammarCompiler:
    def __init__(self, backend: Backend, vocab_size: int, threads: int = 2, entries: int = CACHE_ENTRIES):
        self.backend, self.vocab_size = backend, vocab_size
        self.entries = entries
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="wideep-grammar")
        self.cache: OrderedDict[tuple, Future] = OrderedDict()
        self.lock = threading.Lock()
        self.compiled = 0                 # specs compiled (cache misses)
        self.compile_s = 0.0              # their total compile time
        self.last_compile_s = 0.0

    @classmethod
    def build(cls, name: str, tokenizer, vocab_size: int) -> "GrammarCompiler":
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (tokenizer.json)")
        return cls(make_backend(name, tokenizer, vocab_size), vocab_size)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """-> a Future of the compiled grammar (its exception: ValueError naming the problem). The
        same spec compiles once; a failure is kept too, so a bad spec sent again fails at once."""
        key = spec.key
        with self.lock:
            fut = self.cache.get(key)
            if fut is not None:
                self.cache.move_to_end(key)
                return fut
            fut = self.pool.submit(self._compile, spec)
            self.cache[key] = fut
            while len(self.cache) > self.entries:
                self.cache.popitem(last=False)
            return fut

    def get(self, spec: StructuredOutputsParams):
        """The compiled grammar, compiling it here and now if it is not cached (raises its ValueError)."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams):
        t0 = time.perf_counter()
        try:
            return self.backend.compile(spec)
        finally:
            dt = time.perf_counter() - t0
            with self.lock:
                self.compiled += 1
                self.compile_s += dt
                self.last_compile_s = dt

    def stats(self) -> dict:
        return {"grammar_compiled": self.compiled, "grammar_compile_s": self.compile_s,
                "grammar_cached": len(self.cache)}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def make_backend(name: str, tokenizer, vocab_size: int) -> Backend:
    """tokenizer: the checkpoint's tokenizers.Tokenizer; vocab_size: the model's logits width."""
    if name == "xgrammar":
        from .xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size)
    if name == "guidance":
        from .guidance_backend import GuidanceBackend
        return GuidanceBackend(tokenizer, vocab_size)
    raise ValueError(f"structured outputs backend must be one of {list(BACKENDS)}, got {name!r}")
