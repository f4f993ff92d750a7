"""Online serving benchmark: Poisson arrivals over a mixed-length workload, driven in-process against
Engine (arrival times in wall clock, no HTTP noise), continuous vs static batching of the same engine.

Workload: prompt lengths uniform in [4, 64] (--prompt-len); max_tokens in [1, 64], log-uniform by default (many
short answers, a few long: the long tail of chat traces) or uniform (--lengths uniform); ignore_eos,
so every request makes exactly its max_tokens. Both modes see the same requests and arrival times.
  continuous  requests join the running batch at every step, finished ones leave (the engine as is)
  static      the same engine, but a batch (everything arrived, up to max_num_seqs) is admitted only
              when the previous one has completely finished: a batch waits for its longest request
Throughput: arrivals at 2x the continuous capacity (measured first, all requests at once) so both
modes are saturated: tok/s = generated tokens / (last finish - first arrival), modes interleaved.
Latency: continuous at --load x capacity: TTFT (arrival -> first token seen by the driver), TPOT
((finish - first token) / (tokens - 1)), p50/p99; goodput (DistServe) = requests/s meeting both SLOs,
SLOs = 10 x the single-request TTFT and 5 x its TPOT (--ttft/tpot-slo-scale), measured and printed.
    python bench/serving.py [--quick] [--lengths loguniform|uniform] [--dtype bfloat16]
Last line: JSON with continuous_tok_s, static_tok_s, ratio, goodput_rps, ttft_p99_s, tpot_p99_s, ...
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
             n_group=4, topk_group=2, initializer_range=0.05)


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the run starts


def workload(n: int, seed: int, lengths: str, prompt_len: tuple[int, int]) -> list[Req]:
    """n requests, arrival offsets all 0 (see poisson())."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_len)
        mt = rng.randint(1, 64) if lengths == "uniform" else min(64, int(math.exp(rng.uniform(0, math.log(65)))))
        reqs.append(Req([rng.randrange(2, MODEL["vocab_size"]) for _ in range(plen)], max(1, mt), 0.0))
    return reqs


def poisson(reqs: list[Req], rate: float, seed: int) -> list[Req]:
    """The same requests with exponential inter-arrival gaps (mean 1/rate s); rate inf = all at 0."""
    rng, t = random.Random(seed), 0.0
    out = []
    for r in reqs:
        out.append(Req(r.prompt, r.max_tokens, t))
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return out


def drive(engine, reqs: list[Req], mode: str, batch: int, tag: str) -> tuple[list[dict], int]:
    """Run reqs through engine in wall-clock time. -> (per request {arrival, first, finish, tokens} (s),
    number of engine steps)."""
    from wideep.engine import SamplingParams
    clock = time.perf_counter
    t0 = clock()
    rec = [{"arrival": t0 + r.arrival, "first": None, "finish": None, "tokens": 0} for r in reqs]
    ids = {f"{tag}-{i}": i for i in range(len(reqs))}
    nxt = steps = 0

    def admit(limit: int) -> int:
        nonlocal nxt
        k = 0
        while nxt < len(reqs) and rec[nxt]["arrival"] <= clock() and k < limit:
            r = reqs[nxt]
            engine.add_request(f"{tag}-{nxt}", r.prompt, SamplingParams(
                temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, output_kind="delta"))
            nxt, k = nxt + 1, k + 1
        return k

    while nxt < len(reqs) or engine.has_unfinished_requests():
        if mode == "continuous":
            admit(len(reqs))
        elif not engine.has_unfinished_requests():  # static: the next batch only once all are done
            admit(batch)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, rec[nxt]["arrival"] - clock())))
            continue
        outs = engine.step()
        steps += 1
        now = clock()
        for o in outs:
            r = rec[ids[o.request_id]]
            if o.outputs[0].token_ids and r["first"] is None:
                r["first"] = now
            r["tokens"] += len(o.outputs[0].token_ids)
            if o.finished:
                r["finish"] = now
    return rec, steps


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


def summarize(run: tuple[list[dict], int], slo: dict | None = None) -> dict:
    rec, steps = run
    start, end = min(r["arrival"] for r in rec), max(r["finish"] for r in rec)
    span = end - start
    ttft = [r["first"] - r["arrival"] for r in rec]
    tpot = [(r["finish"] - r["first"]) / (r["tokens"] - 1) for r in rec if r["tokens"] > 1]
    out = {"requests": len(rec), "tokens": sum(r["tokens"] for r in rec), "steps": steps, "span_s": round(span, 3),
           "tok_s": round(sum(r["tokens"] for r in rec) / span, 1), "req_s": round(len(rec) / span, 3),
           "ttft_p50_s": round(pct(ttft, 50), 4), "ttft_p99_s": round(pct(ttft, 99), 4),
           "tpot_p50_s": round(pct(tpot, 50), 4), "tpot_p99_s": round(pct(tpot, 99), 4)}
    if slo is not None:
        good = sum(1 for r in rec if r["first"] - r["arrival"] <= slo["ttft_s"] and
                   (r["tokens"] < 2 or (r["finish"] - r["first"]) / (r["tokens"] - 1) <= slo["tpot_s"]))
        out.update(goodput_rps=round(good / span, 3), slo_attainment=round(good / len(rec), 3))
    return out


def slos(eng, plen: tuple[int, int], ttft_scale: float, tpot_scale: float, B: int) -> dict:
    """Scaled single-request TTFT and TPOT (median prompt, 32 tokens, alone; best of 3). TTFT gets the
    larger scale: under load a new request first waits for the running step, then shares its own."""
    solo = [summarize(drive(eng, [Req([7] * (sum(plen) // 2), 32, 0.0)], "continuous", B, f"solo{i}"))
            for i in range(3)]
    return {"ttft_s": ttft_scale * min(s["ttft_p50_s"] for s in solo),
            "tpot_s": tpot_scale * min(s["tpot_p50_s"] for s in solo)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests, one round (< 3 min here)")
    ap.add_argument("--lengths", choices=["loguniform", "uniform"], default="loguniform")
    ap.add_argument("--prompt-len", default="4,64", help="prompt lengths: uniform in [MIN,MAX]")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="batch size of both modes")
    ap.add_argument("--load", type=float, default=0.5, help="latency run's arrival rate / continuous capacity")
    ap.add_argument("--ttft-slo-scale", type=float, default=10.0, help="TTFT SLO = this x single-request TTFT")
    ap.add_argument("--tpot-slo-scale", type=float, default=5.0, help="TPOT SLO = this x single-request TPOT")
    ap.add_argument("--rounds", type=int, help="interleaved continuous/static rounds (ratio: median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared cores)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    a = ap.parse_args()
    import torch

    from wideep.engine.front.engine import Engine
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    torch.set_num_threads(a.threads)
    plen = tuple(int(x) for x in a.prompt_len.split(","))
    n, rounds, B = a.requests or (96 if a.quick else 240), a.rounds or (1 if a.quick else 3), a.max_num_seqs
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    modes = ("continuous", "static")
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, **MODEL)
        # Prefix caching off: both modes replay the same prompts, and the second must not find the
        # first's blocks cached.
        eng = Engine(d, progress=False, max_num_seqs=B, max_num_batched_tokens=512, kv_cache_blocks=4 * B * 6,
                     enable_prefix_caching=False, dtype=a.dtype)
        base = workload(n, 0, a.lengths, plen)
        drive(eng, poisson(base[:B], math.inf, 0), "continuous", B, "warm")
        slo = slos(eng, plen, a.ttft_slo_scale, a.tpot_slo_scale, B)
        log(f"SLOs ({a.ttft_slo_scale} x / {a.tpot_slo_scale} x single request): ttft <= {slo['ttft_s']:.4f}s, "
            f"tpot <= {slo['tpot_s']:.4f}s")
        cap = summarize(drive(eng, poisson(base, math.inf, 0), "continuous", B, "cap"))
        rate = 2.0 * cap["req_s"]
        log(f"continuous capacity (all {n} at once): {cap['req_s']} req/s, {cap['tok_s']} tok/s; "
            f"throughput rounds at {rate:.2f} req/s")
        sat = poisson(base, rate, 1)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(rounds):  # interleaved: load from other users of the machine hits both modes
            for m in modes:
                runs[m].append(summarize(drive(eng, sat, m, B, f"{m}{i}"), slo))
                log(f"round {i} {m}: {runs[m][-1]}")
        lat_rate = a.load * cap["req_s"]
        lat_reqs = poisson(base, lat_rate, 2)
        lat = {m: summarize(drive(eng, lat_reqs, m, B, f"lat-{m}"), slo) for m in modes}
        for m in modes:
            log(f"latency run ({lat_rate:.2f} req/s = {a.load} x capacity) {m}: {lat[m]}")
        eng.shutdown()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    pairs = list(zip(runs["continuous"], runs["static"]))
    c, s = (sorted(runs[m], key=lambda r: r["tok_s"])[rounds // 2] for m in modes)
    lc, ls = lat["continuous"], lat["static"]
    mt = [r.max_tokens for r in base]
    out = {
        "continuous_tok_s": c["tok_s"], "static_tok_s": s["tok_s"],
        "ratio": round(med([x["tok_s"] / y["tok_s"] for x, y in pairs]), 2),
        "ratios": [round(x["tok_s"] / y["tok_s"], 2) for x, y in pairs],
        # static steps / continuous steps for the same tokens: the ratio where step time does not grow
        # with the batch (memory-bound GPU decode); step_ms shows how much it grows here.
        "step_ratio": round(med([y["steps"] / x["steps"] for x, y in pairs]), 2),
        "step_ms": {"continuous": round(1000 * c["span_s"] / c["steps"], 1),
                    "static": round(1000 * s["span_s"] / s["steps"], 1)},
        "goodput_rps": lc["goodput_rps"], "slo_attainment": lc["slo_attainment"],
        "static_goodput_rps": ls["goodput_rps"], "static_slo_attainment": ls["slo_attainment"],
        "ttft_p50_s": lc["ttft_p50_s"], "ttft_p99_s": lc["ttft_p99_s"],
        "tpot_p50_s": lc["tpot_p50_s"], "tpot_p99_s": lc["tpot_p99_s"],
        "static_ttft_p99_s": ls["ttft_p99_s"], "static_tpot_p99_s": ls["tpot_p99_s"],
        "slo": {k: round(v, 4) for k, v in slo.items()}, "latency_rate_rps": round(lat_rate, 3),
        "throughput_rate_rps": round(rate, 3), "capacity_rps": cap["req_s"],
        "workload": {"requests": n, "prompt_len": list(plen), "max_tokens": [1, 64], "lengths": a.lengths,
                     "mean_max_tokens": round(sum(mt) / n, 1), "max_num_seqs": B, "rounds": rounds,
                     "threads": a.threads, "dtype": a.dtype, **{k: MODEL[k] for k in ("hidden_size", "num_hidden_layers",
                                                                   "n_routed_experts", "num_experts_per_tok")}}}
    save("serving" + ("" if a.dtype == "float32" else "_bf16"), out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
