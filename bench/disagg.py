"""Prefill/decode disaggregation vs colocated serving at equal ranks, on a mixed workload: many
decoding requests (short prompts, long answers) with long prompts arriving among them, the load
under which a colocated step that prefills a long prompt stalls every running decode (the seed's
"pause-burst" token streams).

  colocated  4 ranks, DP4 attention + EP4 experts, one engine (chunked prefill at --chunk tokens)
  disagg     2 prefill ranks (EP2) + 2 decode ranks (EP2), layer-by-layer latent-KV transfer
Both see the same requests at the same wall-clock arrival times, driven in-process on rank 0 (the
front) after a warm-up. Per request: TTFT (arrival -> first token at the front; the KV transfer
included when disaggregated), TPOT ((finish - first token) / (tokens - 1)), and every inter-token
gap (ITL) of the decoding requests. Goodput (DistServe) = requests meeting both the TTFT and the
TPOT SLO per second of the run, at the offered rate (also over a grid of SLOs: goodput_grid).
    python bench/disagg.py [--quick] [--model v3|v4]
--model v4: a small random DeepSeek-V4 (MODEL_V4, built and saved by transformers 5.24) instead of the V3-shaped
one; its streams travel layer by layer (attention_v4/transfer.py); the results go to disagg_v4[_quick].json.
Last line: JSON with colocated_tpot_p99_s, disagg_tpot_p99_s, colocated_goodput_rps, disagg_goodput_rps, ...
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
             n_group=4, topk_group=2, initializer_range=0.05, max_position_embeddings=2048)
BLOCK = 16
# window 128, CSA 4:1, HCA 128:1 as in V4-Flash/Pro; the rest small (launch/tiny/v4.py randomises what transformers
# initialises to degenerate values)
MODEL_V4 = dict(vocab_size=2048, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                head_dim=64, q_lora_rank=128, n_routed_experts=32, num_experts_per_tok=6, sliding_window=128, o_groups=2,
                o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=64, qk_rope_head_dim=16,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                max_position_embeddings=2048, initializer_range=0.05)


def workload(quick: bool, seed: int, n_long: int | None = None, long_len: tuple[int, int] = (896, 1024)) -> list[dict]:
    """Decoding requests arriving as a Poisson stream, and long prompts at regular intervals among them."""
    rng = random.Random(seed)
    n_dec = 40 if quick else 120
    n_long = n_long if n_long is not None else (12 if quick else 36)
    reqs, t = [], 0.0
    for _ in range(n_dec):
        reqs.append(dict(kind="decode", prompt=[rng.randrange(2, 2048) for _ in range(rng.randint(16, 48))],
                         max_tokens=rng.randint(48, 96), arrival=t))
        t += rng.expovariate(6.0)
    for i in range(n_long):
        reqs.append(dict(kind="long", prompt=[rng.randrange(2, 2048) for _ in range(rng.randint(*long_len))],
                         max_tokens=8, arrival=0.8 + i * t / n_long))
    return sorted(reqs, key=lambda r: r["arrival"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


# -- on every rank ----------------------------------------------------------------------------------
def build(mode: str, model_dir: str, a):
    common = dict(progress=False, block_size=BLOCK, enable_prefix_caching=False, parallel={"timeout_s": 120.0})
    if mode == "colocated":
        from wideep.engine.front.engine import Engine
        return Engine(model_dir, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.chunk,
                      kv_cache_blocks=a.kv_blocks, **common)
    from wideep.disagg import make_engine
    pools = {"prefill": {"dp_size": 2, "ep_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": a.chunk,
                         "kv_cache_blocks": a.kv_blocks},
             "decode": {"dp_size": 2, "ep_size": 2, "max_num_seqs": a.max_num_seqs,
                        "max_num_batched_tokens": a.chunk, "kv_cache_blocks": a.kv_blocks}}
    return make_engine(model_dir, pools, **common)


def drive(eng, reqs: list[dict], tag: str) -> list[dict]:
    """Feed reqs at their wall-clock arrival offsets; -> per request arrival and token times (s)."""
    from wideep.engine import SamplingParams
    clock = time.perf_counter
    t0 = clock()
    rec = [dict(kind=r["kind"], arrival=t0 + r["arrival"], times=[], prompt=len(r["prompt"])) for r in reqs]
    index, nxt = {f"{tag}-{i}": i for i in range(len(reqs))}, 0
    while nxt < len(reqs) or eng.has_unfinished_requests():
        while nxt < len(reqs) and rec[nxt]["arrival"] <= clock():
            r = reqs[nxt]
            eng.add_request(f"{tag}-{nxt}", r["prompt"], SamplingParams(
                temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, output_kind="delta"))
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, min(0.005, rec[nxt]["arrival"] - clock())))
            continue
        outs = eng.step()
        now = clock()
        for o in outs:
            rec[index[o.request_id]]["times"] += [now] * len(o.outputs[0].token_ids)
    return [dict(r, arrival=r["arrival"] - t0, times=[x - t0 for x in r["times"]]) for r in rec]


def worker(mode: str, model_dir: str, a) -> None:
    eng = build(mode, model_dir, a)
    if not eng.is_front:
        eng.run_worker_loop()
        return
    warm = workload(True, 99)[:6] + [dict(kind="long", prompt=[5] * 960, max_tokens=4, arrival=0.0)]
    drive(eng, [dict(r, arrival=0.0) for r in warm], "warm")
    rec = drive(eng, workload(a.quick, a.seed, a.long_prompts, tuple(int(x) for x in a.long_len.split(","))), "run")
    m = eng.metrics()
    fin = [f for f in m["finished_requests"] if f["request_id"].startswith("run-")]
    extra = {}
    if "kv_transfer" in m:
        extra = {"kv_transfer_bytes": [f["kv_transfer_bytes"] for f in fin],
                 "kv_transfer_s": [f["kv_transfer_s"] for f in fin], "kv_exposed_s": [f["kv_exposed_s"] for f in fin],
                 "prompt_tokens": [f["prompt_tokens"] for f in fin]}
    print("RESULT " + json.dumps({"records": rec, **extra}), flush=True)
    eng.shutdown()


# -- the driver ---------------------------------------------------------------------------------------
def summarize(rec: list[dict], slo: dict) -> dict:
    ttft = [r["times"][0] - r["arrival"] for r in rec]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in rec if len(r["times"]) > 1]
    itl = [b - a for r in rec if r["kind"] == "decode" for a, b in zip(r["times"], r["times"][1:])]
    span = max(r["times"][-1] for r in rec) - min(r["arrival"] for r in rec)
    good = sum(1 for r in rec if r["times"][0] - r["arrival"] <= slo["ttft_s"] and
               (len(r["times"]) < 2 or (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) <= slo["tpot_s"]))
    tokens = sum(len(r["times"]) for r in rec)
    dec_tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in rec if r["kind"] == "decode"]
    return {"ttft_p50_s": round(pct(ttft, 50), 4), "ttft_p99_s": round(pct(ttft, 99), 4),
            "tpot_p50_s": round(pct(tpot, 50), 4), "tpot_p99_s": round(pct(tpot, 99), 4),
            "decode_tpot_p99_s": round(pct(dec_tpot, 99), 4),
            "itl_p50_s": round(pct(itl, 50), 4), "itl_p99_s": round(pct(itl, 99), 4), "itl_max_s": round(max(itl), 4),
            "tok_s": round(tokens / span, 1), "req_s": round(len(rec) / span, 3), "span_s": round(span, 2),
            "goodput_rps": round(good / span, 3), "slo_attainment": round(good / len(rec), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="52 requests, one run per mode (~3 min here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-prompts", type=int, help="long prompts among the decoding requests (12; 36 without --quick)")
    ap.add_argument("--long-len", default="896,1024", help="long prompt lengths: uniform in [MIN,MAX]")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (prefill chunk) of every pool")
    ap.add_argument("--max-num-seqs", type=int, default=48)
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV blocks of 16 tokens per rank")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT SLO (s)")
    ap.add_argument("--tpot-slo", type=float, default=0.2, help="TPOT SLO (s)")
    ap.add_argument("--timeout", type=float, default=900.0, help="hard limit per mode (s)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=("v3", "v4"), default="v3", help="the checkpoint's architecture")
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.checkpoint, a)
    from wideep.launch.cli.local import run_local_ranks
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    slo = {"ttft_s": a.ttft_slo, "tpot_s": a.tpot_slo}
    res, kv = {}, {}
    with tempfile.TemporaryDirectory() as d:
        if a.model == "v4":
            from wideep.launch.tiny.v4 import tiny_v4_model
            tiny_v4_model(0, **MODEL_V4).save_pretrained(d)
        else:
            make_tiny_checkpoint(d, arch="v3", seed=0, **MODEL)
        for mode in ("colocated", "disagg"):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--checkpoint", d, "--seed", str(a.seed), "--long-len", a.long_len,
                    "--chunk", str(a.chunk), "--max-num-seqs", str(a.max_num_seqs), "--kv-blocks", str(a.kv_blocks)]
            argv += (["--quick"] if a.quick else []) + (["--long-prompts", str(a.long_prompts)] if a.long_prompts else [])
            rc, out = run_local_ranks([], 4, timeout_s=a.timeout, cmd=argv,
                                      capture=True)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if rc or not line:
                raise SystemExit(f"{mode} run failed (exit {rc})")
            data = json.loads(line[-1][len("RESULT "):])
            res[mode] = summarize(data["records"], slo)
            res[mode]["goodput_grid"] = {f"ttft<={t}s,tpot<={p}s": summarize(data["records"], {
                "ttft_s": t, "tpot_s": p})["goodput_rps"] for t in (0.5, 1.0, 2.0) for p in (0.1, 0.2, 0.4)}
            if "kv_transfer_bytes" in data:
                kv = data
            log(f"{mode}: {res[mode]}")
    c, g = res["colocated"], res["disagg"]
    per_token = [b / p for b, p in zip(kv["kv_transfer_bytes"], kv["prompt_tokens"])]
    if a.model == "v4":   # every layer's K (= V, one shared head) of every token, fp32, as an uncompressed cache
        per_head_kv = MODEL_V4["num_hidden_layers"] * MODEL_V4["head_dim"] * 4
    else:
        L, C, R, N, dn, dv = (MODEL[k] for k in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim",
                                                 "num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
        per_head_kv = L * N * (dn + R + dv) * 4  # fp32 K and V of every head, per token
    ratio = g["tpot_p99_s"] / c["tpot_p99_s"]
    out = {
        "colocated_tpot_p99_s": c["tpot_p99_s"], "disagg_tpot_p99_s": g["tpot_p99_s"],
        "colocated_goodput_rps": c["goodput_rps"], "disagg_goodput_rps": g["goodput_rps"],
        "tpot_p99_ratio": round(ratio, 3), "target_tpot_p99_ratio": 0.5, "target_met": ratio <= 0.5,
        "colocated": c, "disagg": g, "slo": slo,
        "kv_transfer": {"bytes_per_prompt_token": round(sum(per_token) / len(per_token), 1),
                        "per_head_kv_bytes_per_token": per_head_kv,
                        "latent_vs_per_head": round(per_head_kv / (sum(per_token) / len(per_token)), 2),
                        "transfer_s_p50": round(pct(kv["kv_transfer_s"], 50), 4),
                        "transfer_s_p99": round(pct(kv["kv_transfer_s"], 99), 4),
                        "exposed_s_p50": round(pct(kv["kv_exposed_s"], 50), 4),
                        "exposed_s_p99": round(pct(kv["kv_exposed_s"], 99), 4)},
        "workload": {"quick": a.quick, "long_prompts": a.long_prompts or (12 if a.quick else 36),
                     "long_len": a.long_len, "chunk": a.chunk, "max_num_seqs": a.max_num_seqs, "ranks": 4,
                     "model": a.model,
                     **{k: (MODEL_V4 if a.model == "v4" else MODEL)[k]
                        for k in ("hidden_size", "num_hidden_layers", "n_routed_experts")}}}
    name = "disagg" + ("_v4" if a.model == "v4" else "")
    save(name + "_quick" if a.quick else name, out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
