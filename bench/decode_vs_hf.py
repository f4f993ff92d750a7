"""wideep vs transformers `generate` on the same random DeepSeek-V3 checkpoint, greedy, float32, CPU;
and wideep's decode steps against the memory roofline measured in the same run.

Default shape (issue #2): hidden 512, 8 layers, 64 experts top-6, batch 16, prompt 128, 64 new tokens.
Both engines run in this process, interleaved (wideep, hf, hf-eager, wideep, ...) so machine noise hits
all; the best trial of each counts. `hf` is transformers with its default experts implementation
(grouped_mm in transformers 5), `hf_eager` with the per-expert loop older releases used.

Roofline (issue #19). A decode step must read, at least: every dense weight (attention, dense MLP,
shared experts, router, norms, lm_head), the routed experts the step's tokens chose (counted per
layer from the router's ids), the embedding rows of its tokens and the latent KV of every sequence's
context. The ceilings are measured here, per thread count and trial, three times just before and
three times just after the trial's generate: `read` = a 1 GiB float32 tensor's x.sum(), `copy` =
y.copy_(x) (GB/s of bytes copied), and `read_huge` = the same read of a tensor in 2 MiB pages (as
the engine puts its weights on CPU, cpu/huge_pages.py; where huge pages are not available it equals
`read`); the median of each counts (the best is reported too). Decode steps are timed alone (whole
Engine.step of steps whose every sequence decodes; the prefill step is reported apart), median over
the run's decode steps, best trial; fraction = bytes per step / step time / the best read ceiling
(the higher of `read` and `read_huge`, named in `ceiling`; `fraction_read` and `fraction_huge` against
each alone). On a shared machine wall time swings with the load, so the fraction is also given in this
thread's CPU time (steps and reads alike, the best of the two reads' CPU-time ceilings): `fraction_cpu`.
Prefix caching is off in both wideep engines: the trials repeat the same prompts, and transformers
recomputes every prompt token; `wideep_prefix_cache_hit_tokens` is read from the engine's metrics
after the runs, and the benchmark exits with an error, writing no results, if it is not 0.
The same engine on the torch backends (experts_backend / attention_backend "torch", the reference
paths) runs beside it: "torch_backends" has its prefill and decode step ms; "prefill_ms" and
"prefill_vs_torch_backends" compare the best prefill of each (one thread, same trials).
Printed: a table, one line per thread count (step ms, GB/s streamed, both ceilings, the fraction).
Kept (with --record): bench/results/decode_vs_hf.json (decode_vs_hf_quick.json with --quick, ..._bf16.json with --bf16;
bench/results.py).
Last line: JSON with wideep_tok_s, hf_tok_s, ratio (= hf time / wideep time), hf_eager_tok_s,
ratio_eager, ratio_decode (hf decode step / wideep decode step), decode_step_ms,
decode_roofline_fraction (1 thread), decode_roofline_fraction_2t (2 threads: the same single-threaded
C kernels against the 2-thread ceilings), decode_roofline_ceiling(_gbs), decode_roofline_fraction_cpu_time,
wideep_prefix_cache_hit_tokens (0), and a "roofline" block per thread count (read/copy GB/s, bytes per step
split dense/experts/kv, step ms wall and CPU, prefill ms). --breakdown: one more wideep run at the first thread count with
every C kernel timed (wall time inside the launchers of cpu/gemm.py, layers.py and fused.py during the decode
steps): "breakdown" = ms per decode step in each kernel and the rest ("other": Python, small torch
ops, sampling, scheduling); the decoder layers are one C call (decode_stack) on these steps, so one
more run with that call off gives "breakdown_per_layer_half" (each layer's attention half, mla_layer,
and MoE half, moe_layer, one call each).
--bf16 (issue #28): the same engine in bfloat16 (weights and latent cache bfloat16, read as stored by the C
kernels) beside the float32 one, each trial running float32 then bfloat16 at the first thread count: "bf16"
has its decode step and prefill ms, decode_vs_float32 (the float32 decode step / the bfloat16 one: best of
each, the median of the per-trial ratios, and in this thread's CPU time: _cpu_time), its greedy agreement with the float32 engine, its decode
plan's path counts, and rss_bytes_per_param: a fresh process's resident set grown by loading the model
alone (engine.model.load_model, no KV cache), per parameter, for bfloat16 and float32.
    python bench/decode_vs_hf.py [--quick] [--threads 1,2] [--breakdown] [--bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import rss_kib, save  # noqa: E402
from wideep.cpu.gemm import bf16_dot  # noqa: E402
from wideep.engine import LLM, SamplingParams  # noqa: E402
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402

GIB = 1 << 30


def ceilings(x: torch.Tensor, y: torch.Tensor, xh: torch.Tensor, times: dict | None = None, n: int = 3) -> dict:
    """Seconds of a plain read (x.sum(), wall and this thread's CPU time), of a copy (y.copy_(x)) and of
    a read of xh (in huge pages, wall and CPU time), n of each, appended to `times` -> times."""
    times = times or {"read": [], "read_cpu": [], "copy": [], "read_huge": [], "read_huge_cpu": []}
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        x.sum()
        times["read"].append(time.perf_counter() - t0)
        times["read_cpu"].append(time.thread_time() - c0)
        t0 = time.perf_counter()
        y.copy_(x)
        times["copy"].append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.thread_time()
        xh.sum()
        times["read_huge"].append(time.perf_counter() - t0)
        times["read_huge_cpu"].append(time.thread_time() - c0)
    return times


def gbs(nbytes: int, seconds: list[float]) -> dict:
    return {"median": round(nbytes / statistics.median(seconds) / 1e9, 2),
            "best": round(nbytes / min(seconds) / 1e9, 2)}


class KernelClock:
    """Wall time inside the C kernels' launchers, per step (take() returns and clears it). Every
    caller reaches them as module attributes at call time, so replacing the attributes times them all."""

    KERNELS = {"gemm": ("experts", "linear", "bmm_nt"), "layers": ("mla_decode", "route", "rmsnorm", "rope"),
               "fused": ("decode_stack", "mla_layer", "moe_layer", "mlp_layer")}

    def __init__(self):
        import importlib
        self.step: dict[str, float] = {}
        for mod_name, names in self.KERNELS.items():
            mod = importlib.import_module(f"cpu.{mod_name}")
            for name in names:
                setattr(mod, name, self._timed(name, getattr(mod, name)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] = self.step.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        step, self.step = self.step, {}
        return step


class DecodeMeter:
    """Times every Engine.step of `llm` and counts the bytes each decode step must read."""

    def __init__(self, llm: LLM):
        model, core = llm.model, llm.engine.core
        self.elem = model.dtype.itemsize
        experts = {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
        embed = model.model.embed_tokens.weight
        self.dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                         if n not in experts and p is not embed)
        if model.lm_head is None:   # tied: lm_head reads the whole table
            self.dense += embed.numel() * embed.element_size()
        self.hidden = model.cfg.hidden_size
        self.latent = model.cfg.mla.latent_dim * model.cfg.num_hidden_layers
        self.per_expert = [sum(p[0].numel() * p.element_size() for p in (m.experts.w13, m.experts.w2))
                           for m in model.moe_layers()]
        self.ids: list[torch.Tensor] = []   # each MoE layer's router ids, in layer order
        for m in model.moe_layers():
            m.gate.register_forward_hook(lambda mod, inp, out: self.ids.append(out[0]))
        from wideep.cpu import fused as layers   # the fused MoE half and the whole-step call route inside C: their
        fused, stack = layers.moe_layer, layers.decode_stack   # ids are their results [1] ([T, k], [n_moe, T, k])

        def seen_moe_layer(*args, **kwargs):
            out = fused(*args, **kwargs)
            if self._batch is not None:   # a step of this meter's engine
                self.ids.append(out[1])
            return out

        def seen_stack(*args, **kwargs):
            out = stack(*args, **kwargs)
            if self._batch is not None:
                self.ids.extend(out[1])
            return out
        layers.moe_layer, layers.decode_stack = seen_moe_layer, seen_stack
        self.steps: list[dict] = []
        self._batch = None
        self.clock: KernelClock | None = None    # set: each step's kernel seconds are recorded too
        runner, loop = core.runner, llm.engine.loop
        execute, step = runner.execute, loop.step

        def seen_execute(batch, plan, on_layer=None):
            self._batch = batch
            self.ids.clear()
            return execute(batch, plan, on_layer=on_layer)

        def timed_step():
            t0, c0 = time.perf_counter(), time.thread_time()
            done = step()
            self._record(time.perf_counter() - t0, time.thread_time() - c0)
            return done
        runner.execute, loop.step = seen_execute, timed_step

    def _record(self, seconds: float, cpu_seconds: float) -> None:
        b, self._batch = self._batch, None
        kernels = self.clock.take() if self.clock is not None else {}
        if b is None or not b.seqs:
            return
        decode = all(n == 1 for n in b.num_tokens)
        experts = sum(len(torch.unique(ids)) * per for ids, per in zip(self.ids, self.per_expert))
        kv = sum(s.num_computed for s in b.seqs) * self.latent * self.elem  # after apply: context incl. new
        self.steps.append({"decode": decode, "s": seconds, "cpu_s": cpu_seconds, "tokens": sum(b.num_tokens),
                           "experts": experts, "kernels": kernels,
                           "kv": kv, "dense": self.dense + sum(b.num_tokens) * self.hidden * self.elem})

    def step_ms(self) -> tuple[float, float]:
        """(prefill ms: all steps with a prompt, decode step ms: median)"""
        return (round(sum(s["s"] for s in self.steps if not s["decode"]) * 1e3, 1),
                round(statistics.median(s["s"] for s in self.steps if s["decode"]) * 1e3, 2))

    def breakdown(self) -> dict:
        """ms per decode step (median step's total; mean per kernel) in each C kernel and the rest."""
        dec = [s for s in self.steps if s["decode"]]
        names = sorted({k for s in dec for k in s["kernels"]})
        out = {k: round(statistics.fmean(s["kernels"].get(k, 0.0) for s in dec) * 1e3, 2) for k in names}
        step_ms = statistics.median(s["s"] for s in dec) * 1e3
        out["other"] = round(step_ms - sum(out.values()), 2)
        out["step"] = round(step_ms, 2)
        return out

    def summary(self, times: dict, nbytes: int) -> dict:
        """The run's decode steps against its ceilings. The roofline is the best of the read ceilings
        measured (median of each: the plain read and the read in 2 MiB pages), so a step is never
        scored against the slower of two ways to read the same bytes."""
        dec = [s for s in self.steps if s["decode"]]
        ms = statistics.median(s["s"] for s in dec) * 1e3
        cpu_ms = statistics.median(s["cpu_s"] for s in dec) * 1e3
        mb = {k: statistics.median(s[k] for s in dec) / 1e6 for k in ("dense", "experts", "kv")}
        total = sum(mb.values())
        bw = {k: gbs(nbytes, times[k]) for k in ("read", "read_cpu", "read_huge", "read_huge_cpu", "copy")}
        ceiling = max(("read", "read_huge"), key=lambda k: bw[k]["median"])
        ceiling_cpu = max(("read_cpu", "read_huge_cpu"), key=lambda k: bw[k]["median"])
        return {"read_gbs": bw["read"], "copy_gbs": bw["copy"], "read_huge_gbs": bw["read_huge"],
                "read_cpu_gbs": bw["read_cpu"], "read_huge_cpu_gbs": bw["read_huge_cpu"],
                "ceiling": ceiling, "ceiling_gbs": bw[ceiling]["median"],
                "decode_step_ms": round(ms, 2), "decode_step_cpu_ms": round(cpu_ms, 2), "decode_steps": len(dec),
                "prefill_ms": self.step_ms()[0],
                "bytes_per_step_mb": {k: round(v, 1) for k, v in dict(mb, total=total).items()},
                "decode_gbs": round(total / ms, 2),
                "fraction": round(total / ms / bw[ceiling]["median"], 3),
                "fraction_read": round(total / ms / bw["read"]["median"], 3),
                "fraction_huge": round(total / ms / bw["read_huge"]["median"], 3),
                "fraction_cpu": round(total / cpu_ms / bw[ceiling_cpu]["median"], 3)}


def rss_per_param(model_dir: str, dtype: str) -> dict:
    """Loads the model alone in a fresh process (this one holds other engines) -> its RSS growth per parameter."""
    import subprocess
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss", model_dir, dtype], capture_output=True,
                       text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"the RSS measurement failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _rss_child(model_dir: str, dtype: str) -> None:
    from wideep.engine.model.build import parse_dtype
    from wideep.engine.model.families import load_model
    before = rss_kib()
    model = load_model(model_dir, dtype=parse_dtype(dtype), progress=False)
    after = rss_kib()
    params = sum(p.numel() for p in model.parameters())
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"dtype": dtype, "params": params, "rss_growth_mb": round((after - before) * 1024 / 1e6, 1),
                      "bytes_per_param": round((after - before) * 1024 / params, 3),
                      "stored_bytes_per_param": round(stored / params, 3)}))


def hit_tokens(llm: LLM) -> int:
    """Prompt tokens the engine took from its prefix cache, as its own metrics count them."""
    return sum(r.get("prefix_hit_tokens", 0) for r in llm.engine.metrics()["per_rank"])


def table(res: dict) -> str:
    """The figures a reader compares, one line per thread count."""
    lines = [f"wideep {res['wideep_tok_s']} tok/s, transformers {res['hf_tok_s']} ({res['ratio']}x), "
             f"eager {res['hf_eager_tok_s']}; prefix-cache hit tokens {res['wideep_prefix_cache_hit_tokens']}",
             "threads  step ms  decode GB/s  read GB/s  read 2MiB GB/s  ceiling         fraction  (vs read, vs 2MiB)"]
    for t, r in res["roofline"].items():
        lines.append(f"{t:>7}  {r['decode_step_ms']:7.2f}  {r['decode_gbs']:11.2f}  {r['read_gbs']['median']:9.2f}  "
                     f"{r['read_huge_gbs']['median']:14.2f}  {r['ceiling']:<14}  {r['fraction']:8.3f}  "
                     f"({r['fraction_read']:.3f}, {r['fraction_huge']:.3f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--threads", default="1,2", help="thread counts for the roofline (the first runs hf too)")
    ap.add_argument("--quick", action="store_true", help="smaller shape for a smoke run")
    ap.add_argument("--breakdown", action="store_true", help="one more run with every C kernel timed")
    ap.add_argument("--bf16", action="store_true", help="a bfloat16 engine beside the float32 one, interleaved")
    ap.add_argument("--rss", nargs=2, metavar=("DIR", "DTYPE"), help=argparse.SUPPRESS)   # rss_per_param's child
    a = ap.parse_args()
    if a.rss:
        _rss_child(*a.rss)
        return
    if a.quick:
        a.hidden, a.layers, a.batch, a.prompt, a.new, a.trials = 256, 4, 8, 64, 16, 1
    threads = [int(t) for t in a.threads.split(",")]
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from wideep.cpu.huge_pages import collapse
    x, xh = torch.rand(GIB // 4), torch.rand(GIB // 4)
    y = torch.empty_like(x)
    huge_ceiling = collapse([xh])
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=4096, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                             moe_intermediate_size=a.hidden // 2, num_hidden_layers=a.layers, first_k_dense_replace=1,
                             num_attention_heads=8, num_key_value_heads=8, q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 4,
                             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=a.experts,
                             num_experts_per_tok=a.topk, n_group=8, topk_group=4, max_position_embeddings=1024,
                             initializer_range=0.05)
        # Prefix caching off: every trial repeats the same prompts, and transformers recomputes them all.
        llm = LLM(d, dtype="float32", progress=False, enable_prefix_caching=False)
        meter = DecodeMeter(llm)
        # the same engine on the torch backends (the reference paths): prefill must not be slower
        ref = LLM(d, dtype="float32", progress=False, experts_backend="torch", attention_backend="torch",
                  enable_prefix_caching=False)
        ref_meter = DecodeMeter(ref)
        llm16 = LLM(d, dtype="bfloat16", progress=False, enable_prefix_caching=False) if a.bf16 else None
        meter16 = DecodeMeter(llm16) if a.bf16 else None
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        hf_eager = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager").eval()
        hf_forward_s: list[float] = []
        hf.register_forward_pre_hook(lambda *_: hf_forward_s.append(-time.perf_counter()))
        hf.register_forward_hook(lambda *_: hf_forward_s.append(hf_forward_s.pop() + time.perf_counter()))
        prompts = torch.randint(2, 4096, (a.batch, a.prompt))
        sp = SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True)

        def run_wideep(engine=llm, m=meter) -> tuple[float, list[list[int]]]:
            m.steps.clear()
            t0 = time.perf_counter()
            outs = engine.generate(prompts.tolist(), sp)
            return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

        @torch.inference_mode()
        def run_hf(model=hf) -> tuple[float, list[list[int]]]:
            t0 = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new,
                                 min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0, out[:, a.prompt:].tolist()

        llm.generate(prompts[:2, :8].tolist(), SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        if a.bf16:
            llm16.generate(prompts[:2, :8].tolist(), SamplingParams(temperature=0.0, max_tokens=2))
        bf16_trials: list[dict] = []
        hf.generate(prompts[:2, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        roof: dict[int, dict] = {}
        tw, th, te, hf_steps, torch_ms, prefill_ms = [], [], [], [], [], []
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            best = None
            for _ in range(a.trials):
                times = ceilings(x, y, xh)
                t, ours = run_wideep()
                summ = meter.summary(ceilings(x, y, xh, times), x.numel() * x.element_size())
                if best is None or summ["decode_step_ms"] < best["decode_step_ms"]:
                    best = summ
                if n_threads != threads[0]:
                    continue
                if a.bf16:   # right after the float32 run of the same trial
                    prefill32 = meter.step_ms()[0]
                    _, ours16 = run_wideep(llm16, meter16)
                    s16 = meter16.summary(times, x.numel() * x.element_size())
                    bf16_trials.append({"decode_step_ms": s16["decode_step_ms"],
                                        "decode_step_cpu_ms": s16["decode_step_cpu_ms"], "prefill_ms": s16["prefill_ms"],
                                        "float32_decode_step_ms": summ["decode_step_ms"],
                                        "float32_decode_step_cpu_ms": summ["decode_step_cpu_ms"],
                                        "float32_prefill_ms": prefill32})
                tw.append(t)
                prefill_ms.append(meter.step_ms()[0])
                _, ref_ours = run_wideep(ref, ref_meter)
                torch_ms.append(ref_meter.step_ms())
                hf_forward_s.clear()
                t, theirs = run_hf()
                th.append(t)
                hf_steps.append(statistics.median(hf_forward_s[1:]) * 1e3)   # [0] is the prefill
                t, _ = run_hf(hf_eager)
                te.append(t)
            roof[n_threads] = best
        breakdown = breakdown_layers = None
        if a.breakdown:
            torch.set_num_threads(threads[0])
            meter.clock = KernelClock()
            run_wideep()
            breakdown = meter.breakdown()
            llm.model.decode_plan.fuse_stack = False   # the same steps a layer half at a time: where the stack's time goes
            run_wideep()
            breakdown_layers = meter.breakdown()
            llm.model.decode_plan.fuse_stack = True
        agree = sum(p == q for p, q in zip(ours, theirs)) / len(ours)
        hits = {"wideep": hit_tokens(llm), "torch_backends": hit_tokens(ref)}
        bf16 = None
        if a.bf16:
            hits["bf16"] = hit_tokens(llm16)
            best16 = min(t["decode_step_ms"] for t in bf16_trials)
            best32 = min(t["float32_decode_step_ms"] for t in bf16_trials)
            bf16 = {"decode_step_ms": best16, "float32_decode_step_ms": best32,
                    "decode_vs_float32": round(best32 / best16, 2),
                    "decode_vs_float32_median_of_trials": round(statistics.median(
                        t["float32_decode_step_ms"] / t["decode_step_ms"] for t in bf16_trials), 2),
                    "decode_step_cpu_ms": min(t["decode_step_cpu_ms"] for t in bf16_trials),
                    "float32_decode_step_cpu_ms": min(t["float32_decode_step_cpu_ms"] for t in bf16_trials),
                    "decode_vs_float32_cpu_time": round(min(t["float32_decode_step_cpu_ms"] for t in bf16_trials)
                                                        / min(t["decode_step_cpu_ms"] for t in bf16_trials), 2),
                    "prefill_ms": min(t["prefill_ms"] for t in bf16_trials),
                    "float32_prefill_ms": min(t["float32_prefill_ms"] for t in bf16_trials),
                    "trials": bf16_trials,
                    "greedy_sequences_equal_float32": sum(p == q for p, q in zip(ours, ours16)) / len(ours),
                    "backends": llm16.model.backends,
                    "decode_plan_steps": dict(llm16.model.decode_plan.steps),
                    "bf16_dot": bf16_dot(),
                    "rss": {dt: rss_per_param(d, dt) for dt in ("bfloat16", "float32")}}
            bf16["rss_bytes_per_param"] = bf16["rss"]["bfloat16"]["bytes_per_param"]
    if any(hits.values()):
        raise SystemExit(f"prefix-cache hit tokens {hits}: a trial reused cached prompt KV, so wideep did less "
                         f"work than transformers; the figures would not compare")
    n = a.batch * a.new
    first, second = roof[threads[0]], roof[threads[1]] if len(threads) > 1 else None
    res = {"shape": {"hidden": a.hidden, "layers": a.layers, "experts": a.experts, "topk": a.topk,
                     "batch": a.batch, "prompt": a.prompt, "new_tokens": a.new},
           "wideep_prefix_cache_hit_tokens": hits["wideep"],
           "torch_backends_prefix_cache_hit_tokens": hits["torch_backends"],
           "wideep_s": round(min(tw), 3), "hf_s": round(min(th), 3),
           "wideep_tok_s": round(n / min(tw), 1), "hf_tok_s": round(n / min(th), 1),
           "ratio": round(min(th) / min(tw), 2), "hf_eager_tok_s": round(n / min(te), 1),
           "ratio_eager": round(min(te) / min(tw), 2), "greedy_sequences_equal": agree,
           "hf_decode_step_ms": round(min(hf_steps), 2),
           "ratio_decode": round(min(hf_steps) / first["decode_step_ms"], 2),
           "prefill_ms": min(prefill_ms),
           "prefill_vs_torch_backends": round(min(prefill_ms) / min(p for p, _ in torch_ms), 3),
           "torch_backends": {"prefill_ms": min(p for p, _ in torch_ms), "decode_step_ms": min(d for _, d in torch_ms),
                              "greedy_sequences_equal": sum(p == q for p, q in zip(ours, ref_ours)) / len(ours),
                              "greedy_sequences_equal_transformers":
                                  sum(p == q for p, q in zip(ref_ours, theirs)) / len(ours)},
           "decode_step_ms": first["decode_step_ms"], "decode_roofline_fraction": first["fraction"],
           "decode_roofline_fraction_2t": second["fraction"] if second else None,
           "decode_roofline_ceiling": first["ceiling"], "decode_roofline_ceiling_gbs": first["ceiling_gbs"],
           "decode_roofline_ceiling_gbs_2t": second["ceiling_gbs"] if second else None,
           "decode_step_ms_2t": second["decode_step_ms"] if second else None,
           "decode_roofline_fraction_cpu_time": first["fraction_cpu"],
           "decode_roofline_fraction_vs_huge_pages": first["fraction_huge"],
           "huge_pages": {"weights_mb": round(llm.model.huge_page_bytes / 1e6, 1),
                          "ceiling_mb": round(huge_ceiling / 1e6, 1)},
           "roofline": {f"{t}t": r for t, r in roof.items()}, "breakdown_ms": breakdown,
           "breakdown_per_layer_half_ms": breakdown_layers,
           "backends": llm.model.backends, "bf16": bf16,
           "torch": torch.__version__, "threads": threads, "trials": a.trials}
    print(table(res), flush=True)
    if bf16:
        print(f"bfloat16: decode step {bf16['decode_step_ms']} ms vs float32 {bf16['float32_decode_step_ms']} ms "
              f"({bf16['decode_vs_float32']}x; median of trials {bf16['decode_vs_float32_median_of_trials']}x; "
              f"in CPU time {bf16['decode_vs_float32_cpu_time']}x), "
              f"prefill {bf16['prefill_ms']} vs {bf16['float32_prefill_ms']} ms, RSS "
              f"{bf16['rss_bytes_per_param']} bytes/param", flush=True)
    save("decode_vs_hf" + ("_quick" if a.quick else "") + ("_bf16" if a.bf16 else ""), res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
