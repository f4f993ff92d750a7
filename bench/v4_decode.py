"""DeepSeek-V4's decode step: the native path (attention_backend "auto" on the CPU: projections, norms, head and
hyper-connections on the C kernels, the routed experts on the C experts kernel, each decode step's attention batched
over its sequences, attention_v4/decode.py) against the torch path (attention_backend "torch": every op on torch, a
decode step's attention one sequence at a time; the routed experts as before this path existed: torch's grouped
GEMMs, or the C kernel for FP4 experts kept packed), same checkpoint, same dtype, one torch thread, prefix caching off.

- step: B prompts of --prompt tokens, generating; after the prefill and two warm-up steps, the median of --steps
  decode steps, per batch of --batches; one engine at a time (one process serves one engine), a new one per trial,
  the trials alternating torch, native, torch, native ..., so the ratio native / torch is measured in one run
  (--one-at-a-time, for a big checkpoint: each side once, in its own process, all its trials in a row).
- bytes: what a batch-1 decode step must read of the weights: every parameter but the routed experts and the embedding
  (one row), plus the experts the routers chose (counted per layer from the gates' outputs); bytes_per_s = that / the
  step. The V3 reference: a DeepSeek-V3 of the same hidden size and expert shapes (its CPU decode plan, the fused
  stack), its batch-1 step's bytes (bench/decode_vs_hf.py DecodeMeter) over its step -> v4_vs_v3 = V3's bytes/s over
  V4's native bytes/s (how much slower V4 streams its weights than a V3 step of the same bytes; target <= 1.3).
    python bench/v4_decode.py [--quick] [--dtype bfloat16] [--dir CHECKPOINT] [--batches 1,16]
--quick (<= 5 minutes): the default mid-size V4 (hidden 1024, 5 layers in the Flash order, 32 experts of 512), float32.
Last line: JSON with ratio_b<B> (native / torch step) per batch, v4_vs_v3, the steps and the bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402

# hidden 1024, 16 heads of 128, the Flash layer order (SWA, SWA, CSA, HCA, CSA), windows and ratios as released
MID_V4 = dict(vocab_size=2000, hidden_size=1024, moe_intermediate_size=512, num_attention_heads=16, head_dim=128,
              q_lora_rank=256, n_routed_experts=32, num_experts_per_tok=4, sliding_window=128, o_groups=4,
              o_lora_rank=256, index_n_heads=8, index_head_dim=64, index_topk=64, qk_rope_head_dim=32,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
# the V3 of the same hidden size, layers and experts (one dense layer first, as V3)
MID_V3 = dict(vocab_size=2000, hidden_size=1024, intermediate_size=1536, moe_intermediate_size=512,
              num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256, kv_lora_rank=256,
              qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
              n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.05)


class V4Meter:
    """The weight bytes a V4 decode step reads: dense (every parameter but routed experts and the embedding) + the
    routed experts its gates chose (unique ids per layer, from forward hooks)."""

    def __init__(self, model):
        embed = model.embed.weight
        self.dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                         if ".ffn.experts." not in n and p is not embed and not n.startswith("mtp."))
        self.per_expert, self.ids = [], []
        for layer in model.layers:
            ex = layer.ffn.experts
            self.per_expert.append(sum(t[0].numel() * t.element_size() for t in ex.parameters()))
            layer.ffn.gate.register_forward_hook(lambda mod, inp, out: self.ids.append(out[0]))

    def take(self) -> int:
        b = self.dense + sum(len(torch.unique(i)) * per for i, per in zip(self.ids, self.per_expert))
        self.ids.clear()
        return b


def _engine(d: str, dtype: str, backend: str, batch: int):
    from wideep.engine.front.engine import Engine
    return Engine(d, progress=False, dtype=dtype, attention_backend=backend, max_num_seqs=max(batch, 1),
                  max_num_batched_tokens=4096, enable_prefix_caching=False)


def _start(eng, batch: int, prompt: int, tag: str) -> None:
    from wideep.engine import SamplingParams
    for i in range(batch):
        eng.add_request(f"{tag}-{i}", [5 + (i * 7 + j) % 1000 for j in range(prompt)],
                        SamplingParams(temperature=0.0, max_tokens=700, ignore_eos=True))
    eng.step()   # the prefill
    eng.step()
    eng.step()


def _time(eng, meter: V4Meter | None, steps: int) -> tuple[list[float], list[int]]:
    ts, nbytes = [], []
    for _ in range(steps):
        if meter is not None:
            meter.ids.clear()
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
        if meter is not None:
            nbytes.append(meter.take())
    return ts, nbytes


def _stop(eng, batch: int, tag: str) -> None:
    for i in range(batch):
        eng.abort(f"{tag}-{i}")
    while eng.has_unfinished_requests():
        eng.step()


def _side(d: str, dtype: str, name: str, batch: int, prompt: int, steps: int, trials: int):
    """One engine of `name` ("torch" / "native"): its decode step times, and at batch 1 the native side's bytes."""
    eng = _engine(d, dtype, "torch" if name == "torch" else "auto", batch)
    meter = V4Meter(eng.core.model) if name == "native" and batch == 1 else None
    _start(eng, batch, prompt, name)
    times, nbytes = [], []
    for _ in range(trials):
        ts, nb = _time(eng, meter, steps)
        times += ts
        nbytes += nb
    _stop(eng, batch, name)
    eng.shutdown()
    return times, nbytes


def _v3_bytes_per_s(dtype: str, prompt: int, steps: int) -> dict:
    """The V3 reference's batch-1 decode: seconds and bytes per step (DecodeMeter) -> bytes/s."""
    from bench.decode_vs_hf import DecodeMeter
    from wideep.engine import SamplingParams
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    from wideep.llm import LLM
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, **MID_V3)
        llm = LLM(d, progress=False, dtype=dtype, enable_prefix_caching=False, max_num_seqs=1)
        meter = DecodeMeter(llm)
        llm.generate([[5 + j % 1000 for j in range(prompt)]],
                     SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
        dec = [s for s in meter.steps if s["decode"]][2:]
        llm.shutdown()
    s = statistics.median(x["s"] for x in dec)
    b = statistics.median(x["dense"] + x["experts"] for x in dec)   # the weights (as V4Meter counts them)
    return {"step_ms": round(s * 1e3, 3), "bytes": int(b), "bytes_per_s": b / s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dir", default=None, help="an existing DeepSeek-V4 checkpoint (e.g. wideep make-shaped --like "
                                                "deepseek-v4-flash --layers 4)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--one-at-a-time", action="store_true", help="each side in its own process, once (a big checkpoint)")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)   # (a child of --one-at-a-time)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.side is not None:
        times, nbytes = _side(a.dir, a.dtype, a.side, int(a.batches), a.prompt, a.steps, a.trials)
        print(json.dumps({"times": times, "bytes": nbytes}), flush=True)
        return
    batches = [int(b) for b in a.batches.split(",")]
    if a.quick:
        a.steps, a.trials = 10, 2
    tmp = None
    d = a.dir
    if d is None:
        from wideep.launch.tiny.v4 import tiny_v4_model
        tmp = tempfile.TemporaryDirectory()
        d = tmp.name
        tiny_v4_model(0, **MID_V4).save_pretrained(d)
    out: dict = {"checkpoint": a.dir or "MID_V4", "dtype": a.dtype, "prompt": a.prompt, "threads": 1,
                 "interleaved": not a.one_at_a_time, "steps": {}}
    for batch in batches:
        times = {"torch": [], "native": []}
        nbytes = []
        if a.one_at_a_time:   # each side in its own process, one after the other: a freed engine's memory is
            for name in ("torch", "native"):   # not all given back, and two big ones do not fit
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", name, "--dir", d, "--dtype",
                                    a.dtype, "--batches", str(batch), "--prompt", str(a.prompt), "--steps",
                                    str(a.steps), "--trials", str(a.trials)], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"the {name} side failed:\n{r.stderr[-3000:]}")
                got = json.loads(r.stdout.strip().splitlines()[-1])
                times[name], nbytes = times[name] + got["times"], nbytes + got["bytes"]
        else:
            for _ in range(a.trials):   # trials alternate torch, native, torch, native ...
                for name in ("torch", "native"):
                    ts, nb = _side(d, a.dtype, name, batch, a.prompt, a.steps, 1)
                    times[name] += ts
                    nbytes += nb
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {f"{k}_ms": round(v * 1e3, 3) for k, v in med.items()}
        row["ratio"] = round(med["native"] / med["torch"], 4)
        row["native_tok_s"] = round(batch / med["native"], 2)
        if nbytes:
            row["bytes"] = int(statistics.median(nbytes))
            row["bytes_per_s"] = row["bytes"] / med["native"]
        out["steps"][str(batch)] = row
        out[f"ratio_b{batch}"] = row["ratio"]
        print(json.dumps({"batch": batch, **row}), flush=True)
    if "1" in out["steps"] and a.dir is None:
        v3 = _v3_bytes_per_s(a.dtype, a.prompt, a.steps)
        out["v3_reference"] = {k: (round(v / 1e9, 3) if k == "bytes_per_s" else v) for k, v in v3.items()}
        out["v4_vs_v3"] = round(v3["bytes_per_s"] / out["steps"]["1"]["bytes_per_s"], 4)
    for row in out["steps"].values():
        if "bytes_per_s" in row:
            row["gb_per_s"] = round(row.pop("bytes_per_s") / 1e9, 3)
    if tmp is not None:
        tmp.cleanup()
    name = "v4_decode" + ("_quick" if a.quick else "") + ("" if a.dtype == "float32" else "_" + a.dtype.replace(
        "bfloat16", "bf16")) + ("_dir" if a.dir else "")
    save(name, out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
