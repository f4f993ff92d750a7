"""Structured outputs: host time per decode step at batch 64 with 0 %, 50 % and 100 % of the requests
constrained by a JSON schema, and grammar compile time per schema.

The model is the host-overhead one (1 layer, hidden 64: its step is the engine's own work) but with
DeepSeek-V3's vocabulary size (129,280) and a real byte-level BPE tokenizer of that size, trained here
on this interpreter's standard library sources (~60 MB, ~20 s): the bitmask's cost is in the
vocabulary (its fill walks the tokens the grammar's state leaves open, its apply is a pass over
[rows, V]), so a 256-token test vocabulary would hide it. The constrained requests' schema asks for
an array of at least 64 objects (an integer, an enum, a bounded string and a boolean each), so no
request ends during the run and every constrained row stays inside real JSON states.

One engine per row; the rows take turns for --rounds rounds, each timing --steps Engine.step()s of
64 decodes, so a burst of load on a shared machine hits one round, not one row. Per row: the median
over rounds of the round's median step, the model's forward time per step (the same forward in
every row: the constraint is applied to the logits after it), and inside the step the matchers'
work (bitmask fill + accepting the sampled tokens: what stays on the host when the logits live on a
GPU) apart from the mask's pass over the [rows, V] logits (on a GPU, device work). On this CPU every
pass over [64, 129,280] logits is host time, and a constrained batch pays one the plain one does not:
the mask (the logprobs are then those of the constrained distribution, as in vLLM, so the draw's
logsumexp serves both).

    python bench/structured.py [--batch 64] [--steps 20] [--rounds 3] [--corpus-mb 60] [--save-as structured]

Last line (JSON): {"host_ms_per_step": {"0%": ..., "50%": ..., "100%": ...}, "ratio_100_vs_0": ...,
"ratio_50_vs_0": ..., "forward_ms_per_step": {...}, "matcher_ms_per_step": {...}, "mask_ms_per_step": {...},
"compile_ms": {schema: ms},
"vocab_size": ..., "rounds": {...}}
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.results import save  # noqa: E402

VOCAB = 129280   # DeepSeek-V3's
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "kind": {"enum": ["alpha", "beta", "gamma"]},
                                         "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "kind", "name", "ok"]}
LONG = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 64}},
        "required": ["items"]}
SCHEMAS = {   # compile time is reported for each
    "long_array_of_objects": LONG,
    "flat_object": ITEM,
    "nested_enums_and_bounds": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                  "tags": {"type": "array", "items": {"type": "string"},
                                                           "minItems": 1, "maxItems": 5}},
                 "required": ["age", "tags"]},
        "level": {"enum": ["low", "mid", "high"]}, "score": {"type": "number"}}, "required": ["user", "level"]},
}


def train_tokenizer(path: str, vocab: int, corpus_mb: int) -> int:
    """A byte-level BPE of `vocab` tokens (BOS id 0, EOS id 1, as the tiny checkpoint's config) -> its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from wideep.launch.tiny.checkpoint import BOS, EOS
    files, total = [], 0
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        try:
            with open(f, encoding="utf-8") as fh:
                total += len(fh.read())
        except (OSError, UnicodeDecodeError):
            continue
        files.append(f)
        if total > corpus_mb * 1e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         special_tokens=[BOS, EOS], show_progress=False))
    tok.save(path)
    return tok.get_vocab_size()


class Timed:
    """Wraps a callable; total seconds spent in it since the last take()."""

    def __init__(self, fn):
        self.fn, self.s = fn, 0.0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.s += time.perf_counter() - t0

    def take(self) -> float:
        s, self.s = self.s, 0.0
        return s


class Bench:
    def __init__(self, model_dir: str, batch: int, constrained: int, steps: int, rounds: int):
        from wideep.engine import Engine, SamplingParams
        self.batch = batch
        n = steps * rounds + 8
        # room for every sequence's whole output: a preempted one would drop out of the timed steps
        self.eng = Engine(model_dir, max_num_seqs=batch, max_num_batched_tokens=8192, block_size=64,
                          kv_cache_blocks=batch * -(-(4 + n) // 64) + 8, enable_prefix_caching=False, progress=False)
        for i in range(batch):
            so = {"json": LONG} if i < constrained else None
            # unseeded, as bench/host_overhead.py: every row draws from the engine's one generator
            sp = SamplingParams(max_tokens=n, ignore_eos=so is None, output_kind="delta", structured_outputs=so)
            self.eng.add_request(str(i), [2 + i % 200, 3, 4, 5], sp)
        core = self.eng.core
        self.forward = core.model.forward = Timed(core.model.forward)
        self.eng.step()
        while any(s.prefilling for s in core.scheduler.running) or core.scheduler.waiting or core.compiling:
            self.eng.step()
        self.grammar = None
        proc = core.runner.logits_proc
        if proc is not None and proc.grammar_rows is not None:
            rows = proc.grammar_rows   # [matchers: fill + accept, the mask's pass over the logits]
            self.grammar = [Timed(rows.plan), Timed(rows.accept), Timed(rows.apply)]
            rows.plan, rows.accept, rows.apply = self.grammar

    def round(self, steps: int) -> tuple[float, float, float, float]:
        """-> (median ms per step, forward ms, matcher ms (bitmask fill + accept), mask ms, per step)."""
        times = []
        self.forward.take()
        for g in self.grammar or []:
            g.take()
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = self.eng.step()
            times.append(time.perf_counter() - t0)
            ended = [(o.request_id, o.outputs[0].finish_reason) for o in outs if o.finished]
            assert len(outs) == self.batch and not ended, f"requests ended mid-run: {ended}"
        g = [t.take() * 1e3 / steps for t in self.grammar] if self.grammar else [0.0, 0.0, 0.0]
        return statistics.median(times) * 1e3, self.forward.take() * 1e3 / steps, g[0] + g[1], g[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus-mb", type=int, default=60)
    ap.add_argument("--save-as", default="structured")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    fractions = {"0%": 0, "50%": a.batch // 2, "100%": a.batch}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", num_hidden_layers=1, first_k_dense_replace=0, hidden_size=64,
                             vocab_size=VOCAB)
        t0 = time.perf_counter()
        vocab = train_tokenizer(os.path.join(d, "tokenizer.json"), VOCAB, a.corpus_mb)
        print(f"tokenizer: {vocab} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
        benches = {name: Bench(d, a.batch, k, a.steps, a.rounds) for name, k in fractions.items()}
        comp = benches["100%"].eng.core.grammars
        from wideep.structured.params import StructuredOutputsParams
        compile_ms = {}
        for name, schema in SCHEMAS.items():   # a fresh compile each (not the cached one)
            t0 = time.perf_counter()
            comp.backend.compile(StructuredOutputsParams(json=schema))
            compile_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)
        rounds: dict[str, list] = {name: [] for name in fractions}
        for r in range(a.rounds):
            for name, b in benches.items():
                rounds[name].append(b.round(a.steps))
                print(f"round {r + 1} {name} constrained: {rounds[name][-1][0]:.2f} ms per step", flush=True)
        for b in benches.values():
            b.eng.shutdown()
    ms = {k: statistics.median(x[0] for x in v) for k, v in rounds.items()}
    out = {"batch": a.batch, "vocab_size": vocab,
           "host_ms_per_step": {k: round(v, 3) for k, v in ms.items()},
           "ratio_100_vs_0": round(ms["100%"] / ms["0%"], 3), "ratio_50_vs_0": round(ms["50%"] / ms["0%"], 3),
           "forward_ms_per_step": {k: round(statistics.median(x[1] for x in v), 3) for k, v in rounds.items()},
           "matcher_ms_per_step": {k: round(statistics.median(x[2] for x in v), 3) for k, v in rounds.items()},
           "mask_ms_per_step": {k: round(statistics.median(x[3] for x in v), 3) for k, v in rounds.items()},
           "compile_ms": compile_ms, "schema": "an object holding an array of >= 64 objects (int, enum, "
                                               "string pattern, boolean) on every constrained request",
           "rounds": {k: [round(x[0], 3) for x in v] for k, v in rounds.items()}}
    save(a.save_as, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
