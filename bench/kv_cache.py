"""KV-centric serving: multi-turn chat on 4 DP ranks, where most of each prompt was seen before, under
three configurations of the same engine, one after the other in one run:

  (a) least_loaded  routing by load only, prefix cache in device memory only (the engine before kvstore/)
  (b) kv_aware      KV-aware routing: a conversation returns to the rank holding its history
  (c) kv_tiers      KV-aware routing + a host tier and a disk tier below each rank's device cache

Workload: --conversations conversations x --turns turns, each opening with one of --system-prompts
shared system prompts; turn t's prompt is the system prompt, every earlier user message and answer,
then a new user message (greedy answers, ignore_eos, so every configuration sees the same prompts
as long as the answers agree). Turns go round-robin over the conversations with --concurrency
requests in flight, so between two turns of one conversation every other conversation speaks once:
their KV pushes its history out of the (small) device caches.

Per configuration: prefix hit rate (prompt tokens found in any tier / prompt tokens looked up),
prefill tokens computed (the ranks' count: everything not found, recomputation included), TTFT
p50/p99 (submit -> first token at the front), tokens/s, hits per tier, routing decisions.
Targets: (c) computes <= 0.5x the prefill tokens of (a), TTFT p50 (c) <= 0.6x (a); answers equal
across (a)/(b)/(c).
    python bench/kv_cache.py [--quick] [--model v4]
--model v4: the small random DeepSeek-V4 of bench/disagg.py (MODEL_V4: window 128, CSA 4:1, HCA 128:1) instead of the
V3-shaped model; its hits stop at multiples of 128 tokens (engine/sched/block_manager.py) and its tiers hold every
stream (kvstore/store.py); the host tier gets --host-blocks x 16 tokens of its bytes per token; results go to
kv_cache_v4[_quick].json (reported, no target).
Last line: JSON with prefill_tokens_ratio, ttft_p50_ratio ((c)/(a)), outputs_equal, per configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.disagg import BLOCK, MODEL as _DISAGG_MODEL, MODEL_V4, pct  # noqa: E402  (the same tiny models, block)
from bench.results import save  # noqa: E402

MODEL = dict(_DISAGG_MODEL, initializer_range=0.3)
CONFIGS = ("least_loaded", "kv_aware", "kv_tiers")


def bytes_per_token(model_dir: str) -> float:
    """KV bytes per token over all layers, float32, as the engine's pools count them: V3 the latent; V4 every stream
    (window, CSA entries + indexer keys, HCA entries, the boundary states; engine/model/v4_cache.py)."""
    from types import SimpleNamespace

    import torch

    from wideep.engine.model.model_config import ModelConfig
    from wideep.engine.model.v4_cache import V4StreamCache
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.v4 is None:
        return cfg.num_hidden_layers * cfg.mla.latent_dim * 4
    kv = V4StreamCache(SimpleNamespace(cfg=cfg, dtype=torch.float32, device="meta"), None, BLOCK, 1, 1, 1,
                       num_blocks=1, prefix_caching=True)
    return sum(kv.per_block[s] / kv.spec.tokens_per_block(s) for s in kv.spec.streams)


def conversations(a) -> list[dict]:
    rng = random.Random(a.seed)
    system = [[rng.randrange(2, 2048) for _ in range(a.system_len)] for _ in range(a.system_prompts)]
    return [dict(system=system[c % a.system_prompts],
                 users=[[rng.randrange(2, 2048) for _ in range(a.user_len)] for _ in range(a.turns)])
            for c in range(a.conversations)]


# -- on every rank ----------------------------------------------------------------------------------
def build(config: str, model_dir: str, disk_dir: str, a):
    from wideep.engine.front.engine import Engine
    kv = {"routing": "least_loaded" if config == "least_loaded" else "kv_aware"}
    if a.route_load_weight is not None:
        kv["route_load_weight"] = a.route_load_weight
    if config == "kv_tiers":
        kv.update(tiers=["host", "disk"], host_bytes=int(a.host_blocks * BLOCK * bytes_per_token(model_dir)),
                  disk_dir=disk_dir,
                  disk_bytes=1 << 30, persist_on_close=False)
    return Engine(model_dir, progress=False, block_size=BLOCK, kv_cache_blocks=a.kv_blocks, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.chunk, parallel={"timeout_s": 120.0}, kv_cache=kv)


def totals(eng) -> dict:
    """Sums over the ranks' latest stats (waits for a fresh report from every rank)."""
    eng.front.rank_stats.clear()
    deadline = time.monotonic() + 30
    while len(eng.front.rank_stats) < eng.ctx.world_size and time.monotonic() < deadline:
        eng.step(0.1)
    m = eng.metrics()
    keys = ("prefix_queried_tokens", "prefix_hit_tokens", "prefill_tokens", "kv_hit_blocks_device",
            "kv_hit_blocks_host", "kv_hit_blocks_disk")
    out = {k: sum(s.get(k, 0) for s in m["per_rank"]) for k in keys}
    out["routing"] = dict(m["routing_decisions"])
    return out


def drive(eng, convs: list[dict], a, tag: str) -> list[dict]:
    """Turns round-robin over conversations, --concurrency in flight. -> one record per request."""
    from wideep.engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=a.answer_len, ignore_eos=True, output_kind="delta")
    order = [(c, t) for t in range(a.turns) for c in range(len(convs))]
    history = [list(c["system"]) for c in convs]
    answered = [-1] * len(convs)
    rec, live, nxt = {}, {}, 0
    clock = time.perf_counter
    t0 = clock()
    while nxt < len(order) or live:
        while nxt < len(order) and len(live) < a.concurrency and answered[order[nxt][0]] == order[nxt][1] - 1:
            c, t = order[nxt]
            prompt = history[c] + convs[c]["users"][t]
            rid = f"{tag}-{c}-{t}"
            eng.add_request(rid, prompt, params)
            live[rid] = (c, t, prompt)
            rec[rid] = dict(conv=c, turn=t, prompt=len(prompt), submit=clock() - t0, first=None, tokens=[])
            nxt += 1
        for o in eng.step():
            r = rec[o.request_id]
            if o.outputs[0].token_ids and r["first"] is None:
                r["first"] = clock() - t0
            r["tokens"] += o.outputs[0].token_ids
            if o.finished:
                c, t, prompt = live.pop(o.request_id)
                history[c] = prompt + r["tokens"]
                answered[c] = t
                r["finish"] = clock() - t0
    return list(rec.values())


def worker(config: str, model_dir: str, disk_dir: str, a) -> None:
    eng = build(config, model_dir, disk_dir, a)
    if not eng.is_front:
        eng.run_worker_loop()
        return
    warm = dict(a.__dict__, conversations=8, turns=1, seed=a.seed + 1000)
    drive(eng, conversations(argparse.Namespace(**warm)), argparse.Namespace(**warm), "warm")
    before = totals(eng)
    rec = drive(eng, conversations(a), a, "run")
    after = totals(eng)
    counts = {k: after[k] - before[k] for k in after if k != "routing"}
    counts["routing"] = {r: n - before["routing"].get(r, 0) for r, n in after["routing"].items()}
    print("RESULT " + json.dumps({"records": rec, "counts": counts}), flush=True)
    eng.shutdown()


# -- the driver ---------------------------------------------------------------------------------------
def summarize(rec: list[dict], counts: dict) -> dict:
    ttft = [r["first"] - r["submit"] for r in rec]
    span = max(r["finish"] for r in rec) - min(r["submit"] for r in rec)
    q = counts["prefix_queried_tokens"]
    return {"prefix_hit_rate": round(counts["prefix_hit_tokens"] / q, 4) if q else 0.0,
            "prefill_tokens": counts["prefill_tokens"], "prompt_tokens": sum(r["prompt"] for r in rec),
            "ttft_p50_s": round(pct(ttft, 50), 4), "ttft_p99_s": round(pct(ttft, 99), 4),
            "tok_s": round(sum(len(r["tokens"]) for r in rec) / span, 1), "span_s": round(span, 2),
            "hit_blocks": {t: counts[f"kv_hit_blocks_{t}"] for t in ("device", "host", "disk")},
            "routing": counts["routing"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="24 conversations (~2 min here)")
    ap.add_argument("--conversations", type=int, help="default 48 (24 with --quick); the issue's 200 fit a GPU")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    ap.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens per rank (prefill chunk)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=96, help="device KV blocks of 16 tokens per rank")
    ap.add_argument("--host-blocks", type=int, default=48,
                    help="host tier capacity per rank, in blocks (less than a rank's conversations need: the rest "
                         "goes down to disk)")
    ap.add_argument("--route-load-weight", type=float, help="[kv_cache] route_load_weight (default: the engine's)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations to run (all three for the ratios)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="hard limit per configuration (s)")
    ap.add_argument("--model", dest="arch", choices=("v3", "v4"), default="v3",
                    help="v4: the small DeepSeek-V4 of bench/disagg.py (MODEL_V4)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--disk-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.conversations = a.conversations or (24 if a.quick else 48)
    if a.worker:
        return worker(a.worker, a.checkpoint, a.disk_dir, a)
    from wideep.launch.cli.local import run_local_ranks
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    res, answers = {}, {}
    passthrough = ["--conversations", str(a.conversations), "--turns", str(a.turns), "--system-prompts",
                   str(a.system_prompts), "--system-len", str(a.system_len), "--user-len", str(a.user_len),
                   "--answer-len", str(a.answer_len), "--concurrency", str(a.concurrency), "--chunk", str(a.chunk),
                   "--max-num-seqs", str(a.max_num_seqs), "--kv-blocks", str(a.kv_blocks),
                   "--host-blocks", str(a.host_blocks), "--seed", str(a.seed), "--model", a.arch]
    if a.route_load_weight is not None:
        passthrough += ["--route-load-weight", str(a.route_load_weight)]
    with tempfile.TemporaryDirectory() as d:
        model_dir = os.path.join(d, "model")
        if a.arch == "v4":
            from wideep.launch.tiny.v4 import tiny_v4_model
            tiny_v4_model(0, **MODEL_V4).save_pretrained(model_dir)
        else:
            make_tiny_checkpoint(model_dir, arch="v3", seed=0, **MODEL)
        per_token = bytes_per_token(model_dir)
        for config in a.configs.split(","):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", config, "--checkpoint", model_dir,
                    "--disk-dir", os.path.join(d, "kv"), *passthrough]
            rc, out = run_local_ranks([], 4, timeout_s=a.timeout, cmd=argv, capture=True)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if rc or not line:
                raise SystemExit(f"{config} run failed (exit {rc})")
            data = json.loads(line[-1][len("RESULT "):])
            res[config] = summarize(data["records"], data["counts"])
            answers[config] = {(r["conv"], r["turn"]): r["tokens"] for r in data["records"]}
            log(f"{config}: {res[config]}")
    if set(res) != set(CONFIGS):
        print(json.dumps(res), flush=True)
        return
    base, tiers = res["least_loaded"], res["kv_tiers"]
    prefill_ratio = tiers["prefill_tokens"] / base["prefill_tokens"]
    ttft_ratio = tiers["ttft_p50_s"] / base["ttft_p50_s"]
    equal = answers["least_loaded"] == answers["kv_aware"] == answers["kv_tiers"]
    targets = {"prefill_tokens_ratio": 0.5, "ttft_p50_ratio": 0.6} if a.arch == "v3" else {}
    out = {
        "model": a.arch, "prefill_tokens_ratio": round(prefill_ratio, 3), "ttft_p50_ratio": round(ttft_ratio, 3),
        "prefill_tokens_saved": base["prefill_tokens"] - tiers["prefill_tokens"], "outputs_equal": equal,
        "targets": targets, "targets_met": (prefill_ratio <= 0.5 and ttft_ratio <= 0.6 and equal) if targets else None,
        "kv_aware_prefill_tokens_ratio": round(res["kv_aware"]["prefill_tokens"] / base["prefill_tokens"], 3),
        **res,
        "workload": {"conversations": a.conversations, "turns": a.turns, "system_prompts": a.system_prompts,
                     "system_len": a.system_len, "user_len": a.user_len, "answer_len": a.answer_len,
                     "concurrency": a.concurrency, "chunk": a.chunk, "kv_blocks": a.kv_blocks,
                     "host_blocks": a.host_blocks, "ranks": 4, "block_size": BLOCK,
                     "kv_bytes_per_token": per_token,
                     **{k: (MODEL_V4 if a.arch == "v4" else MODEL)[k]
                        for k in ("hidden_size", "num_hidden_layers", "n_routed_experts")}}}
    save("kv_cache" if a.arch == "v3" else "kv_cache_v4" + ("_quick" if a.quick else ""), out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
