"""The README's "Benchmarks (summary)" table, generated from bench/results/*.json.

Every row is computed from the results files the benchmarks wrote (bench/results.py): the command
they ran with, the result formatted from their fields, the target with met / not met decided here
from those fields, and the commit each ran on. A benchmark without a results file gets a row saying
so, never an older figure. The table sits between the markers START and END in README.md.

    python bench/summary.py            rewrite README.md's table from bench/results/
    python bench/summary.py --check    exit 1 if README.md's table is not what the results give
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
START, END = "<!-- bench-summary:start -->", "<!-- bench-summary:end -->"
NOT_RUN = "not run on this commit range"


def n(x) -> str:
    """A number to at most 4 significant digits, whole numbers without a point (1.0 -> "1",
    16.3621 -> "16.36", 2220.65 -> "2221")."""
    if isinstance(x, float):
        x = round(x) if abs(x) >= 1000 or x.is_integer() else float(format(x, ".4g"))
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def per_size(d: dict, unit: str = "") -> str:
    """{"4": a, "8": b} -> "a / b<unit> at 4 / 8"."""
    keys = sorted(d, key=int)
    return f"{' / '.join(n(d[k]) for k in keys)}{unit} at {' / '.join(keys)}"


@dataclass(frozen=True)
class Run:
    """One results file of a row: bench/results/<name>.json."""
    name: str
    command: str                           # what the row says when the file is absent
    result: Callable[[dict], str]          # record -> the result cell
    checks: Callable[[dict], list[bool]] = lambda r: []   # one per part of the row's target
    tag: str = ""                          # names the run in a row of several ("default", "--quick")


@dataclass(frozen=True)
class Row:
    label: str
    target: str                            # the parts of a target separated by " / " match checks()
    runs: tuple[Run, ...]


def _decode(r: dict) -> str:
    t = r["threads"]
    one = r["roofline"][f"{t[0]}t"]
    out = (f"{n(r['ratio'])}× transformers' tok/s ({n(r['wideep_tok_s'])} vs {n(r['hf_tok_s'])}); decode step "
           f"{n(one['decode_step_ms'])} ms streaming {n(one['decode_gbs'])} GB/s = **{n(one['fraction'])}** of the "
           f"best read ceiling ({n(one['ceiling_gbs'])} GB/s, `{one['ceiling']}`) at {t[0]} thread")
    if len(t) > 1:
        two = r["roofline"][f"{t[1]}t"]
        out += f", {n(two['fraction'])} of {n(two['ceiling_gbs'])} GB/s at {t[1]}"
    return out + (f" (in CPU time: {n(r['decode_roofline_fraction_cpu_time'])}); {r['trials']} trials; "
                  f"prefix-cache hit tokens {r['wideep_prefix_cache_hit_tokens']}")


def _bf16(r: dict) -> str:
    b = r["bf16"]
    return (f"decode step {n(b['decode_step_ms'])} ms vs float32 {n(b['float32_decode_step_ms'])} ms: "
            f"**{n(b['decode_vs_float32'])}×** (median of trials {n(b['decode_vs_float32_median_of_trials'])}×, "
            f"in CPU time {n(b['decode_vs_float32_cpu_time'])}×); prefill {n(b['prefill_ms'])} vs "
            f"{n(b['float32_prefill_ms'])} ms; RSS after load **{n(b['rss_bytes_per_param'])}** bytes/param "
            f"(float32 {n(b['rss']['float32']['bytes_per_param'])}); {len(b['trials'])} trials")


def _bf16_gemm(r: dict) -> str:
    s = {(x["M"], x["N"], x["K"]): x for x in r["shapes"]}
    one, big = s[(1, 4096, 4096)], s[(512, 2048, 2048)]
    out = (f"AVX512-BF16 kernel ÷ float32 kernel: {n(one['f32_over_dot'])}× at 1 row (4096²), "
           f"{n(s[(16, 4096, 4096)]['f32_over_dot'])}× at 16; torch's bf16 GEMM ÷ our dot products at 512 rows "
           f"{n(big['torch_bf16_over_dot'])}×")
    if r.get("amx_tiles"):
        out += (f"; on AMX tiles, torch's ÷ ours {n(s[(16, 4096, 4096)]['torch_bf16_over_tiles'])}× at 16 rows, "
                f"{n(s[(64, 2048, 1024)]['torch_bf16_over_tiles'])}× at 64, "
                f"{n(s[(2048, 2048, 1024)]['torch_bf16_over_tiles'])}× at 2048 (past 256 rows torch's runs)")
    else:
        out += " (prefill past 64 rows uses torch's)"
    return out


def _scale(r: dict) -> str:
    cb, so = set(r["control_bytes_per_sync"].values()), set(r["store_ops_per_rank_s"].values())
    sizes = sorted(r["startup_s"], key=int)
    return (f"{' / '.join(map(n, sorted(cb)))} control bytes per step sync and {' / '.join(map(n, sorted(so)))} "
            f"store ops per rank per s at {sizes[0]}–{sizes[-1]} ranks; 32 ranks start in "
            f"{n(r['startup_32_vs_8'])}× the 8-rank time; 8-rank run {n(r['total_s']['8'])} s; "
            f"front slowed 50 ms: workers' step {n(r['slow_front_ratio'])}×")


def _scale_checks(r: dict) -> list[bool]:
    return [len(set(r["control_bytes_per_sync"].values())) == 1 and not any(r["store_ops_per_rank_s"].values()),
            r["startup_32_vs_8"] <= 4.5, r["total_s"]["8"] <= 20, r["slow_front_ratio"] <= 1.1 and not r["failed"]]


def _dispatch(r: dict) -> str:
    b = r["inter_node_bytes_vs_min"]
    two = "exactly 1.0" if b["two_level"] == 1.0 else n(b["two_level"])
    out = (f"inter-node bytes {two}× the minimum (flat: {n(b['flat_best'])}–{n(b['flat'])}×); "
           f"wall step time two-level ÷ flat ")
    if "step_time_two_level_vs_flat_best" in r:
        out += f"{n(r['step_time_two_level_vs_flat_best'])}–"
    link = r["link"]
    return (out + f"{n(r['step_time_two_level_vs_flat'])}× over {', '.join(r['detail'])} ranks×nodes "
            f"(simulated link: inter-node {n(link['inter_us'])} µs + {n(link['inter_gbps'])} GB/s); "
            f"outputs equal: {'yes' if r['outputs_equal'] else 'NO'}")


def _dbo(r: dict) -> str:
    return (f"overlap efficiency {n(r['overlap_efficiency_prefill_two_tier'])} on prefill (2 ranks as 2 nodes, "
            f"simulated inter-node link calibrated to the compute); `auto` {n(r['auto_vs_off'])}× of off")


def _eplb(r: dict) -> str:
    out = f"step time {n(r['step_time_ratio_rank_per_core'])}× of off (2 ranks, a core each)"
    if "balancedness_before" in r:
        out += f"; balancedness {n(r['balancedness_before'])} → {n(r['balancedness_after'])} (ep 4)"
    return out


def _kv_fp8(r: dict) -> str:
    b = r["bytes_per_token"]["bf16"]
    fp4 = (f"; fp4 {b['fp4'] / 1000:.0f} KB ({n(r['cache_ratio_fp4']['bf16'])}×), decode ÷ fp32 "
           f"{' / '.join(map(n, r['fp4_vs_fp32']))}" if "fp4_vs_fp32" in r else "")
    return (f"DeepSeek-V3: {b['fp8'] / 1000:.0f} KB per token vs {b['auto'] / 1000:.0f} KB bf16 "
            f"({n(r['cache_ratio']['bf16'])}×); paged decode fp8 ÷ fp32 {' / '.join(map(n, r['fp8_vs_fp32']))} at "
            f"{' / '.join(f'{c // 1024}k' for c in r['contexts'])} context{fp4}")


def _kv_fp8_v4(r: dict) -> str:
    m, d = r["models"]["v4_flash"], r["drift"]
    return (f"DeepSeek-V4: entry {r['entry_bytes']['kv_fp8']} B vs {r['entry_bytes']['kv_bf16']} B bf16; V4-Flash "
            f"compressed {n(m['fp8']['compressed_per_token'])} vs {n(m['auto']['compressed_per_token'])} B per token "
            f"({n(m['compressed_ratio'])}×); tiny V4 drift mean {n(d['mean_abs_logprob_diff'])} nats, greedy "
            f"{n(d['greedy_agreement'])}")


def _disagg(r: dict) -> str:
    return (f"TPOT p99 {n(r['tpot_p99_ratio'])}× of colocated ({r['workload']['long_prompts']} long prompts; "
            f"goodput {n(r['disagg_goodput_rps'])} vs {n(r['colocated_goodput_rps'])} req/s)")


def _spec(r: dict) -> str:
    w, t = r["workloads"], r["targets"]

    def at(m, B):   # the best k at batch B
        row = w[m]["batch"][B]["k"]
        k = max((k for k in row if k != "0"), key=lambda k: row[k]["speedup"])
        return f"{n(row[k]['speedup'])}× (k {k}, {n(100 * row[k]['acceptance'])} %)"
    sizes = sorted(w["ngram"]["batch"], key=int)
    L = r["model"]["num_hidden_layers"]
    dd = r.get("mtp_draft_dtype", "float32")
    layer = f" ({dd} MTP layer)" if dd != r.get("dtype", "float32") else ""
    return (f"decode tok/s vs none at batch {' / '.join(sizes)}: n-gram {' / '.join(at('ngram', B) for B in sizes)}; "
            f"MTP{layer} {' / '.join(at('mtp', B) for B in sizes)}; drafts rejected, worst: n-gram "
            f"{n(t['ngram']['rejected_worst_speedup'])}×, MTP {n(t['mtp']['rejected_worst_speedup'])}× "
            f"({L}-layer model: the MTP layer is 1 of {L + 1})")


def _fp8_weights(r: dict) -> str:
    d, c = r["decode"], r["cold"]
    return (f"resident {n(r['rss_bytes_per_param_fp8'])} bytes per parameter (bf16 {n(r['rss']['bfloat16']['bytes_per_param'])}); "
            f"decode step {n(d['fp8_decode_step_ms'])} vs {n(d['bf16_decode_step_ms'])} ms bf16 ({n(d['bf16_over_fp8'])}×, "
            f"batch {d['batch']}); 1 GiB GEMM sweep bf16 ÷ fp8 {' / '.join(n(x['bf16_over_fp8']) for x in c)} at "
            f"{' / '.join(str(x['M']) for x in c)} rows")


def _vs_vllm(r: dict) -> str:
    def ratio(x: dict, key: str) -> str:   # the median of the rounds' ratios, their range where there were rounds
        lo_hi = x.get(key + "_range")
        return f"{n(x[key])}×" + (f" ({n(lo_hi[0])}–{n(lo_hi[1])})" if lo_hi else "")
    out = []
    for c, x in r["ratios"].items():
        w = r["serve"]["wideep"][x["best_dtype"]["wideep"]][c]
        v = r["serve"]["vllm"][x["best_dtype"]["vllm"]][c]
        out.append(f"c{c}: {n(w['output_tok_s'])} vs {n(v['output_tok_s'])} tok/s ({ratio(x, 'throughput')}), TPOT p50 "
                   f"{ratio(x, 'tpot_p50')}, TTFT p50 {ratio(x, 'ttft_p50')}")
    best = {e: "/".join(sorted({x["best_dtype"][e] for x in r["ratios"].values()})) for e in ("wideep", "vllm")}
    rounds = f" ({r['rounds']} rounds, engines alternating)" if r.get("rounds", 1) > 1 else ""
    return f"wideep {best['wideep']} vs vLLM {r['vllm']} {best['vllm']}{rounds}: " + "; ".join(out)


def _vs_vllm_checks(r: dict) -> list[bool]:
    t = [r["targets"].get(c, {}) for c in ("16", "64")]
    return [all(x.get("throughput_ge_1p5", False) for x in t), all(x.get("tpot_le_0p7", False) for x in t),
            all(x.get("ttft_le_0p8", False) for x in t)]


SPEC_TARGET = "≥ 1.5× at batch 1 with ≥ 70 % acceptance: n-gram / MTP; rejected drafts ≥ 0.95×: n-gram / MTP"


def _spec_checks(r: dict) -> list[bool]:
    """bench/speculative.py's four targets, in SPEC_TARGET's order."""
    t = r["targets"]
    return [t["ngram"]["met_1p5x_at_70pct"], t["mtp"]["met_1p5x_at_70pct"], t["ngram"]["met_within_5pct_when_rejected"],
            t["mtp"]["met_within_5pct_when_rejected"]]

def _shapes(r: dict) -> str:
    d = {x["batch"]: x for x in r["decode"]}
    fp8 = f", {n(r['fp8_bytes_per_param'])} bytes per fp8 weight" if r.get("fp8_bytes_per_param") else ""
    return (f"{r['like']} × {r['layers']} layers ({r['quantization']}): decode "
            + ", ".join(f"{n(x['tok_s'])} tok/s at {b}" for b, x in d.items())
            + f", **{n(r['decode_bandwidth_fraction'])}** of {n(r['decode'][0]['ceiling_gbs'])} GB/s at batch 1; "
            f"load {n(r['load']['load_s'])} s ({n(r['load']['gbs'])} GB/s), peak RSS {n(r['load_peak_rss_ratio'])}× "
            f"after{fp8}; prefill {n(r['prefill']['tok_s'])} tok/s at {r['prefill']['tokens']}")


def _v4_decode(r: dict) -> str:
    s = r["steps"]
    v3 = (f" vs V3's {n(r['v3_reference']['bytes_per_s'])}: **{n(r['v4_vs_v3'])}×**" if "v4_vs_v3" in r else "")
    return ("native / torch step " + ", ".join(f"**{n(x['ratio'])}** at {b} ({n(x['native_ms'])} vs "
                                                            f"{n(x['torch_ms'])} ms)" for b, x in s.items())
            + f"; {n(s['1']['gb_per_s'])} GB/s of weights at 1{v3}")


def _multinode(r: dict) -> str:
    rates = r["per_rate"]
    slow = r["dbo"]["rate"]
    return (f"2 namespace hosts × 2 ranks vs 1 host × 4, prefill / decode: "
            + ", ".join(f"{n(v['prefill']['x_vs_1x4'])}× / {n(v['decode']['x_vs_1x4'])}× at {k}"
                        for k, v in rates.items())
            + "; wire ÷ computed (TCP payload): "
            + ", ".join(f"**{n(v['tcp_payload'])}** at {k}" for k, v in r["wire_over_computed"].items())
            + f"; DBO prefill on ÷ off at {slow}: **{n(r['dbo_prefill_ratio'])}**; outputs equal: "
            + ("yes" if r["outputs_equal"] else "NO"))


ROWS = (
    Row("decode vs transformers", "roofline ≥ 0.7 / 0 prefix-cache hits", (
        Run("decode_vs_hf", "python bench/decode_vs_hf.py --trials 3", _decode,
            lambda r: [r["decode_roofline_fraction"] >= 0.7, r["wideep_prefix_cache_hit_tokens"] == 0]),)),
    Row("bfloat16 on CPU (weights read as stored)", "decode ≥ 1.7× float32 / RSS ≤ 2.2 bytes per param", (
        Run("decode_vs_hf_bf16", "python bench/decode_vs_hf.py --bf16 --threads 1 --trials 6", _bf16,
            lambda r: [r["bf16"]["decode_vs_float32"] >= 1.7, r["bf16"]["rss_bytes_per_param"] <= 2.2]),)),
    Row("bfloat16 GEMM, one thread", "—", (Run("bf16_gemm", "python bench/bf16_gemm.py", _bf16_gemm),)),
    Row("host overhead per decode step", "≤ 5 ms / ≤ 5 ms with processing / 1024 ÷ 256 ≤ 4.5", (
        Run("host_overhead", "python bench/host_overhead.py",
            lambda r: (f"{n(r['host_ms_per_step']['256'])} ms at batch 256 (rounds "
                       f"{', '.join(map(n, r['rounds']['256']))}); 1024 ÷ 256 = {n(r['ratio_1024_vs_256'])}"
                       + (f"; with penalties, logit_bias and stop strings on every request "
                          f"{n(r['host_ms_per_step']['256+processing'])} ms (rounds "
                          f"{', '.join(map(n, r['rounds']['256+processing']))})"
                          if "256+processing" in r["host_ms_per_step"] else "")),
            lambda r: [r["host_ms_per_step"]["256"] <= 5,
                       r["host_ms_per_step"].get("256+processing", float("inf")) <= 5,   # a row not run: not met
                       r["ratio_1024_vs_256"] <= 4.5]),)),
    Row("structured outputs at batch 64 (129k vocab)", "100 % constrained ≤ 1.5× of none", (
        Run("structured", "python bench/structured.py",
            lambda r: (f"{n(r['ratio_100_vs_0'])}× at 100 %, {n(r['ratio_50_vs_0'])}× at 50 % "
                       f"({n(r['host_ms_per_step']['0%'])} → {n(r['host_ms_per_step']['100%'])} ms per step; matchers "
                       f"{n(r['matcher_ms_per_step']['100%'])} ms, mask {n(r['mask_ms_per_step']['100%'])} ms of it); compile "
                       f"{' / '.join(n(v) for v in r['compile_ms'].values())} ms per schema"),
            lambda r: [r["ratio_100_vs_0"] <= 1.5]),)),
    Row("speculative decoding (n-gram, MTP), float32", SPEC_TARGET, (
        Run("speculative", "python bench/speculative.py", _spec,
            _spec_checks),)),
    Row("DeepSeek-V4 speculative decoding (n-gram, MTP), float32", SPEC_TARGET, (
        Run("speculative_v4", "python bench/speculative.py --model v4", _spec,
            _spec_checks),)),
    Row("FP8 weights kept on CPU", "RSS ≤ 1.2 bytes per param", (
        Run("fp8_weights", "python bench/fp8_weights.py", _fp8_weights,
            lambda r: [r["rss_bytes_per_param_fp8"] <= 1.2]),)),
    Row("vs vLLM's CPU backend, served on one core", "≥ 1.5× throughput / TPOT p50 ≤ 0.7× / TTFT p50 ≤ 0.8× "
        "(concurrency 16 and 64)", (
        Run("vs_vllm", "python bench/vs_vllm.py", _vs_vllm, _vs_vllm_checks, tag="Intel Xeon with AMX tiles"),
        Run("vs_vllm_noamx", "python bench/vs_vllm.py --save-as vs_vllm_noamx", _vs_vllm, _vs_vllm_checks,
            tag="AMD EPYC, AVX512-BF16, no AMX"))),
    Row("vs vLLM on a DeepSeek-V3-shaped checkpoint (its 3 dense layers, FP8), one core", "≥ 1.5× throughput / "
        "TTFT p50 ≤ 0.8× (concurrency 16)", (
        Run("vs_vllm_v3_shaped", "python bench/vs_vllm.py --dir DIR --one-at-a-time --concurrency 16 --dtypes bfloat16 "
            "--input-len 256 --output-len 128 --prompts-per-slot 1 --rounds 2 --no-offline --save-as vs_vllm_v3_shaped",
            _vs_vllm, lambda r: [r["targets"]["16"]["throughput_ge_1p5"], r["targets"]["16"]["ttft_le_0p8"]],
            tag="Intel Xeon with AMX tiles"),)),
    Row("width, 1–32 ranks", "flat in width / 32 vs 8 start ≤ 4.5× / 8 ranks ≤ 20 s / slow front ≤ 1.1", (
        Run("scale", "python bench/scale.py", _scale, _scale_checks),)),
    Row("surviving a lost rank", "≤ 30 s at 16, 0 lost, outputs equal", (
        Run("elastic", "python bench/elastic.py",
            lambda r: (f"recovery {per_size(r['recovery_s'], ' s')} ranks, {r['requests_lost']} requests lost, "
                       f"outputs equal: {'yes' if r['outputs_equal'] else 'NO'}"),
            lambda r: [r["recovery_s"]["16"] <= 30 and r["requests_lost"] == 0 and r["outputs_equal"]]),)),
    Row("two-level dispatch", "bytes 1.0× the minimum, outputs equal", (
        Run("dispatch", "python bench/dispatch.py", _dispatch,
            lambda r: [r["inter_node_bytes_vs_min"]["two_level"] == 1.0 and r["outputs_equal"]]),)),
    Row("dual-batch overlap, a core per rank, simulated link", "≥ 0.6", (
        Run("dbo", "python bench/dbo.py --skip-old", _dbo,
            lambda r: [r["overlap_efficiency_prefill_two_tier"] >= 0.6]),)),
    Row("online EPLB, a core per rank", "≤ 0.8", (
        Run("eplb", "python bench/eplb.py --skip-old", _eplb, lambda r: [r["step_time_ratio_rank_per_core"] <= 0.8]),)),
    Row("KV tiers + KV-aware routing", "≤ 0.5 / ≤ 0.6", (
        Run("kv_cache", "python bench/kv_cache.py",
            lambda r: (f"prefill tokens {n(r['prefill_tokens_ratio'])}×, TTFT p50 {n(r['ttft_p50_ratio'])}× of "
                       f"least-loaded device-only ({r['workload']['conversations']} conversations); outputs equal: "
                       f"{'yes' if r['outputs_equal'] else 'NO'}"),
            lambda r: [r["prefill_tokens_ratio"] <= 0.5 and r["outputs_equal"], r["ttft_p50_ratio"] <= 0.6]),)),
    Row("DeepSeek-V4 KV tiers + KV-aware routing", "— (report)", (
        Run("kv_cache_v4_quick", "python bench/kv_cache.py --quick --model v4",
            lambda r: (f"prefill tokens {n(r['prefill_tokens_ratio'])}× of least-loaded device-only "
                       f"({r['prefill_tokens_saved']} saved; hits at multiples of 128), TTFT p50 "
                       f"{n(r['ttft_p50_ratio'])}×; outputs equal: {'yes' if r['outputs_equal'] else 'NO'}")),)),
    Row("DeepSeek Sparse Attention", "≤ 0.5", (
        Run("dsa", "python bench/dsa.py",
            lambda r: (f"{n(r['dsa_vs_dense_attention_8k'])}× dense MLA's decode attention {r['time']} time "
                       f"at 8k context"),
            lambda r: [r["dsa_vs_dense_attention_8k"] <= 0.5]),)),
    Row("FP8 latent KV cache", "—", (Run("kv_fp8", "python bench/kv_fp8.py", _kv_fp8),)),
    Row("FP8 DeepSeek-V4 KV streams", "—", (Run("kv_fp8_v4", "python bench/kv_fp8.py --model v4", _kv_fp8_v4),)),
    Row("DeepSeek-V4 KV streams", "— (report)", (
        Run("v4_kv", "python bench/v4_kv.py",
            lambda r: (f"bytes per sequence at 128k: V4-Flash {n(r['v4_flash_kv_bytes_128k'] / 2**20)} MiB, V4-Pro "
                       f"{n(r['v4_pro_kv_bytes_128k'] / 2**20)} MiB, V3.2 {n(r['v32_kv_bytes_128k'] / 2**20)} MiB; "
                       f"pools equal the dense streams: {'yes' if r['measured']['paged_equals_dense'] else 'NO'}")),)),
    Row("continuous vs static batching", "3×", tuple(
        Run(name, "python bench/serving.py" + flag,
            lambda r: (f"{n(r['ratio'])}× throughput, {n(r['step_ratio'])}× fewer steps "
                       f"({r['workload']['requests']} requests, rounds: {r['workload']['rounds']})"),
            lambda r: [r["ratio"] >= 3], tag=tag)
        for name, flag, tag in (("serving", "", "float32"), ("serving_bf16", " --dtype bfloat16", "bfloat16")))),
    Row("prefill/decode disaggregation", "≤ 0.5×", (
        Run("disagg", "python bench/disagg.py", _disagg, lambda r: [r["tpot_p99_ratio"] <= 0.5], tag="default"),
        Run("disagg_quick", "python bench/disagg.py --quick", _disagg, lambda r: [r["tpot_p99_ratio"] <= 0.5],
            tag="`--quick`"))),
    Row("CPU decode plan at ep 2, a core per rank", "— (before/after)", (
        Run("ep_decode_plan", "python bench/ep_scaling.py --decode-ab",
            lambda r: (f"decode step {n(r['decode_step_ms_plan_on'])} ms with the fused attention halves vs "
                       f"{n(r['decode_step_ms_plan_off'])} ms op by op ({n(r['on_over_off'])}×; "
                       f"{r['rounds']} interleaved rounds); outputs equal: {'yes' if r['outputs_equal'] else 'NO'}")),)),
    Row("published shapes, random weights", "decode ≥ 0.7 of read bandwidth / load peak RSS ≤ 1.15× / load ≥ 1 GB/s", (
        Run("shapes_quick", "python bench/shapes.py --quick", _shapes,
            lambda r: [r["decode_bandwidth_fraction"] >= 0.7, r["load_peak_rss_ratio"] <= 1.15,
                       r["load"]["gbs"] >= 1.0]),)),
    Row("DeepSeek-V4 decode step", "≤ 0.35× torch at batch 1 / at 16 / ≤ 1.3× a V3 step of the same bytes", tuple(
        Run(name, "python bench/v4_decode.py --quick" + flag, _v4_decode,
            lambda r: [r["ratio_b1"] <= 0.35, r["ratio_b16"] <= 0.35, r["v4_vs_v3"] <= 1.3], tag=tag)
        for name, flag, tag in (("v4_decode_quick", "", "float32"),
                                ("v4_decode_quick_bf16", " --dtype bfloat16", "bfloat16"))) + (
        Run("v4_decode_bf16_dir", "python bench/v4_decode.py --dir DIR --one-at-a-time --dtype bfloat16 --prompt 64 "
                                  "--steps 6 --trials 2 (DIR: wideep make-shaped --like deepseek-v4-flash --layers 4)",
            _v4_decode, lambda r: [r["ratio_b1"] <= 0.35, r["ratio_b16"] <= 0.35], tag="V4-Flash × 4 layers"),)),
    Row("many nodes: network-namespace hosts, shaped links",
        "wire ≤ 1.05× computed / DBO prefill ≤ 0.75× at 1 Gbit/s", (
        Run("multinode_quick", "python bench/multinode.py --quick", _multinode,
            lambda r: [max(v["tcp_payload"] for v in r["wire_over_computed"].values()) <= 1.05,
                       r["dbo_prefill_ratio"] <= 0.75]),)),
    Row("EP scaling", "baseline", (
        Run("ep_scaling", "python bench/ep_scaling.py",
            lambda r: f"ep {' / '.join(r['ep'])}: {' / '.join(n(v['tok_s']) for v in r['ep'].values())} tok/s "
                      f"(ranks share {r['machine']['nproc']} cores)"),)),
)


def load(results: Path) -> dict[str, dict]:
    """name -> record of every bench/results/<name>.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results).glob("*.json"))}


def _verdict(checks: list[bool]) -> str:
    """[True, True] -> "met", [True, False] -> "met / not met", [] -> ""."""
    words = ["met" if c else "not met" for c in checks]
    return words[0] if len(set(words)) == 1 else " / ".join(words)


def _cell(run: Run, rec: dict | None) -> tuple[str, str, list[bool]]:
    """-> (command, result, checks) of one run; a file without the fields a row reads says so."""
    if rec is None:
        return run.command, NOT_RUN, []
    cmd = rec.get("command", run.command)
    try:
        return cmd, run.result(rec), run.checks(rec)
    except (KeyError, IndexError, TypeError) as e:
        return cmd, f"results file lacks {e!s} (rerun the benchmark)", []


def row(r: Row, records: dict[str, dict]) -> str:
    runs = [(run, records.get(run.name)) for run in r.runs]
    cells = [_cell(run, rec) for run, rec in runs]          # (command, result, checks) per run
    command = " / ".join(f"`{cmd}`" for cmd, _, _ in cells)
    if len(runs) == 1:
        (_, result, checks), = cells
        target = f"{r.target} ({_verdict(checks)})" if checks else r.target
    else:
        result = "; ".join(f"{run.tag}: {res}" for (run, _), (_, res, _) in zip(runs, cells))
        verdicts = ["not run" if rec is None else _verdict(checks) or "—"
                    for (_, rec), (_, _, checks) in zip(runs, cells)]
        target = r.target
        if any(rec is not None for _, rec in runs):
            target += " (" + "; ".join(f"{run.tag}: {v}" for (run, _), v in zip(runs, verdicts)) + ")"
    commits = dict.fromkeys(rec.get("commit", "?") for _, rec in runs if rec is not None)
    cpus = dict.fromkeys(cpu_of(rec.get("machine", {})) for _, rec in runs if rec is not None)
    return (f"| {r.label} | {command} | {result} | {target} | {' / '.join(cpus) or '—'} | "
            f"{' / '.join(commits) or '—'} |")


def cpu_of(m: dict) -> str:
    """A run's CPU in a few words: its model and, where the file says, its widest vector ISA and the native kernels'
    build when not for this CPU."""
    name = m.get("cpu_model", "?").replace("(R)", "").replace("(TM)", "").replace(" Processor", "").strip()
    isa = m.get("isa")
    if isa:
        name += " (" + ("AMX" if "amx_bf16" in isa else "AVX-512" if "avx512f" in isa else
                        "AVX2" if "avx2" in isa else isa[-1]) + ")"
    march = m.get("kernels", {}).get("march", "native")
    return name if march == "native" else f"{name}, kernels for {march}"


def conditions(records: dict[str, dict]) -> str:
    """One line: the machines the files ran on and the load each run ended in."""
    if not records:
        return "No benchmark has a results file in bench/results/."
    machines = dict.fromkeys(f"{m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores"
                             for m in (rec.get("machine", {}) for rec in records.values()))
    loads = ", ".join(f"{name} {rec['machine']['load_avg_1_5_15m'][0]}" for name, rec in records.items()
                      if rec.get("machine", {}).get("load_avg_1_5_15m"))
    return f"Machine: {'; '.join(machines)}. Load average (1 min) when each run ended: {loads or 'not recorded'}."


def table(results: Path) -> str:
    """The generated block, markers included."""
    records = load(results)
    lines = [START, "", "| benchmark | command | result | target | CPU | commit |",
             "|---|---|---|---|---|---|",
             *(row(r, records) for r in ROWS), "", conditions(records), "", END]
    return "\n".join(lines)


def rewrite(readme: str, block: str) -> str:
    """README text with the block between the markers replaced by `block`."""
    i, j = readme.find(START), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {START} ... {END} block")
    return readme[:i] + block + readme[j + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs from the results")
    ap.add_argument("--results", default=str(BENCH / "results"))
    ap.add_argument("--readme", default=str(BENCH.parent / "README.md"))
    a = ap.parse_args(argv)
    path = Path(a.readme)
    old = path.read_text()
    new = rewrite(old, table(Path(a.results)))
    if a.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(path),
                                                       "from bench/results"))
            print(f"{path}: the benchmark table is not what {a.results} gives; run python bench/summary.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != old:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
