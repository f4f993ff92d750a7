"""Published model shapes with random weights, measured end to end (issue 47): a checkpoint written by
`wideep make-shaped` (launch/tiny/shaped.py: the published configuration, tensor names, dtypes and shards, truncated
to --layers), loaded and served on one rank with one torch thread.

- load: in a fresh process (this one holds other tensors), `load_model` of the checkpoint from the page cache (its
  files read once before): seconds, GB/s of checkpoint bytes, the resident set after the load and its peak during it
  (VmHWM) -> load_peak_rss_ratio = peak / after; fp8_bytes_per_param = the bytes of every weight kept FP8 (one a
  weight plus its float32 block scales) per such weight.
- decode: an LLM (prefix caching off) generating --new tokens for B prompts of 32 tokens at each batch of
  --batches: the median decode step, tok/s = B / step, the bytes the step must read (bench/decode_vs_hf.py
  DecodeMeter: every non-expert weight, the experts the router chose, the KV read) over the step time against the
  best read ceiling measured here (a 1 GiB read, plain and in 2 MiB pages) -> decode_bandwidth_fraction at batch 1.
- prefill: one prompt of --prefill tokens in one chunk (max_num_batched_tokens = --prefill): tok/s.
- kv: the latent cache's bytes per token (every layer of this checkpoint, and of the published depth), and the
  longest context the memory left after loading holds (MemAvailable / bytes per token, this checkpoint's layers).
    python bench/shapes.py [--quick] [--like deepseek-v2-lite] [--layers 4] [--quantization fp8] [--dtype bfloat16]
                           [--dir DIR (an existing checkpoint: not written again)]
--quick (<= 10 minutes here): a DeepSeek-V2-Lite-shaped checkpoint of 4 layers with online FP8 (quantization
"fp8": bf16 weights quantised at load into DeepSeek's e4m3 128 x 128 tiles), batches 1 and 16, an 2048-token prefill.
Last line: JSON with decode_bandwidth_fraction, load_peak_rss_ratio, fp8_bytes_per_param, load, decode, prefill, kv.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode_vs_hf import GIB, DecodeMeter, ceilings  # noqa: E402
from bench.results import save  # noqa: E402


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _load_child(model_dir: str, dtype: str, quantization: str) -> None:
    """(in a fresh process) load the model alone; print its figures as JSON."""
    from wideep.engine.model.build import parse_dtype
    from wideep.engine.model.families import load_model
    from wideep.moe.fp8 import FP8_DTYPE
    torch.set_num_threads(1)
    before = _status()
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype=parse_dtype(dtype), progress=False, quantization=quantization)
    load_s = time.perf_counter() - t0
    after = _status()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    n8 = sum(t.numel() for t in tensors.values() if t.dtype == FP8_DTYPE)
    experts = {n: t for n, t in tensors.items() if ".experts." in n}
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    logical = 0   # the routed experts' weights as the checkpoint's config counts them: E x 3 x H x I per MoE layer
    if experts:
        import re
        layers = {int(m.group(1)) for m in (re.search(r"layers\.(\d+)\.", n) for n in experts) if m}
        logical = (len(layers) * cfg["n_routed_experts"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"])
    scales = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith("scale_inv"))
    print(json.dumps({"load_s": round(load_s, 2), "rss_before_mb": round(before["VmRSS"] / 1024, 1),
                      "rss_after_mb": round(after["VmRSS"] / 1024, 1), "peak_rss_mb": round(after["VmHWM"] / 1024, 1),
                      "params": sum(t.numel() for t in tensors.values()),
                      "param_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                      "fp8_params": n8, "fp8_bytes": n8 + scales,
                      "routed_expert_params": logical,
                      "routed_expert_bytes": sum(t.numel() * t.element_size() for t in experts.values()),
                      "backends": {k: v for k, v in model.backends.items() if isinstance(v, (str, bool, int))}}))


def _per(load: dict, nbytes: str, count: str) -> float | None:
    return round(load[nbytes] / load[count], 4) if load[count] else None


def _checkpoint_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


def _warm_page_cache(d: str) -> float:
    """Read every shard once (the load is then measured from the page cache) -> seconds."""
    t0 = time.perf_counter()
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass
    return time.perf_counter() - t0


def _decode(llm, meter: DecodeMeter, batch: int, new: int, x, y, xh) -> dict:
    from wideep.engine import SamplingParams
    meter.steps.clear()
    prompts = [[(97 * b + 13 * j) % 5000 + 10 for j in range(32)] for b in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    s = meter.summary(ceilings(x, y, xh), x.numel() * x.element_size())
    return {"batch": batch, "step_ms": s["decode_step_ms"], "tok_s": round(batch / s["decode_step_ms"] * 1e3, 2),
            "steps": s["decode_steps"], "bytes_per_step_mb": s["bytes_per_step_mb"], "decode_gbs": s["decode_gbs"],
            "ceiling": s["ceiling"], "ceiling_gbs": s["ceiling_gbs"], "fraction": s["fraction"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="V2-Lite shape, 4 layers, online FP8, batches 1,16")
    ap.add_argument("--like", default="deepseek-v2-lite", help="deepseek-v2-lite | deepseek-v3 (launch/tiny/published.py)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="fp8", help="auto | fp8 | none (engine/model/build.py)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per request in the decode runs")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the one-chunk prefill")
    ap.add_argument("--dir", help="an existing make-shaped checkpoint (not written again)")
    ap.add_argument("--ceiling-gib", type=float, default=1.0, help="size of each read-ceiling buffer (three of them)")
    ap.add_argument("--load-only", action="store_true", help="the load figures only (no engine: DeepSeek-V4)")
    ap.add_argument("--load-child", nargs=3, metavar=("DIR", "DTYPE", "QUANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load_child:
        _load_child(*a.load_child)
        return
    if a.quick:
        a.like, a.layers, a.quantization, a.batches, a.new = "deepseek-v2-lite", 4, "fp8", "1,16", 12
    batches = [int(b) for b in a.batches.split(",")]
    log = lambda *m: print(*m, file=sys.stderr, flush=True)  # noqa: E731
    torch.set_num_threads(1)
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.tiny.shaped import make_shaped_checkpoint
    with tempfile.TemporaryDirectory(dir=os.environ.get("WIDEEP_SHAPES_TMP")) as tmp:
        d = a.dir or os.path.join(tmp, "ckpt")
        write_s = None
        if not a.dir:
            t0 = time.perf_counter()
            make_shaped_checkpoint(d, a.like, a.layers)
            write_s = round(time.perf_counter() - t0, 1)
        cfg = json.load(open(os.path.join(d, "config.json")))
        nbytes = _checkpoint_bytes(d)
        log(f"checkpoint {a.like} x {cfg['num_hidden_layers']} layers: {nbytes / 1e9:.2f} GB"
            + (f", written in {write_s} s" if write_s else ""))
        warm_s = _warm_page_cache(d)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--load-child", d, a.dtype, a.quantization],
                           capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode:
            raise RuntimeError(f"the load child failed:\n{r.stderr[-3000:]}")
        load = json.loads(r.stdout.strip().splitlines()[-1])
        load["gbs"] = round(nbytes / load["load_s"] / 1e9, 2)
        log(f"load: {load}")
        if a.load_only:
            out = {"like": a.like, "layers": cfg["num_hidden_layers"], "dtype": a.dtype, "quantization": a.quantization,
                   "checkpoint": {"bytes": nbytes, "write_s": write_s}, "load": load,
                   "load_peak_rss_ratio": round(load["peak_rss_mb"] / load["rss_after_mb"], 3),
                   "routed_expert_bytes_per_param": _per(load, "routed_expert_bytes", "routed_expert_params")}
            save(f"shapes_load_{a.like.removeprefix('deepseek-')}_{a.layers}", out)
            print(json.dumps(out), flush=True)
            return
        mem_before = _mem_available()
        llm = LLM(d, dtype=a.dtype, quantization=a.quantization, progress=False, enable_prefix_caching=False,
                  max_num_seqs=max(batches), max_num_batched_tokens=max(a.prefill, 64))
        meter = DecodeMeter(llm)
        from wideep.cpu.huge_pages import collapse
        x, xh = torch.rand(int(a.ceiling_gib * GIB) // 4), torch.rand(int(a.ceiling_gib * GIB) // 4)
        y = torch.empty_like(x)
        collapse([xh])
        decode = []
        for b in batches:
            decode.append(_decode(llm, meter, b, a.new, x, y, xh))
            log(f"decode: {decode[-1]}")
        meter.steps.clear()
        prompt = [(31 * j) % 5000 + 10 for j in range(a.prefill)]
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        pre_s = sum(s["s"] for s in meter.steps if not s["decode"])
        prefill = {"tokens": a.prefill, "ms": round(pre_s * 1e3, 1), "tok_s": round(a.prefill / pre_s, 1),
                   "chunks": sum(1 for s in meter.steps if not s["decode"])}
        log(f"prefill: {prefill}")
        mcfg = llm.model.cfg
        per_token = mcfg.mla.latent_dim * mcfg.num_hidden_layers * llm.model.dtype.itemsize
        from wideep.launch.tiny.published import PUBLISHED
        full_layers = PUBLISHED.get(a.like, cfg)["num_hidden_layers"]
        left = _mem_available()
        kv = {"bytes_per_token": per_token, "layers": mcfg.num_hidden_layers,
              "bytes_per_token_published_depth": per_token // mcfg.num_hidden_layers * full_layers,
              "published_layers": full_layers, "mem_available_gb": round(left / 1e9, 2),
              "longest_context_tokens": left // per_token}
        llm.shutdown()
    out = {"like": a.like, "layers": cfg["num_hidden_layers"], "dtype": a.dtype, "quantization": a.quantization,
           "threads": 1, "checkpoint": {"bytes": nbytes, "write_s": write_s, "warm_read_s": round(warm_s, 1)},
           "load": load, "load_peak_rss_ratio": round(load["peak_rss_mb"] / load["rss_after_mb"], 3),
           "fp8_bytes_per_param": _per(load, "fp8_bytes", "fp8_params"),
           "routed_expert_bytes_per_param": _per(load, "routed_expert_bytes", "routed_expert_params"),
           "decode": decode, "decode_bandwidth_fraction": decode[0]["fraction"], "prefill": prefill, "kv": kv,
           "mem_available_before_engine_gb": round(mem_before / 1e9, 2)}
    save("shapes" + ("_quick" if a.quick else "" if a.like == "deepseek-v2-lite" and a.layers == 4
                     else f"_{a.like.removeprefix('deepseek-')}_{a.layers}"), out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
