"""Wide-EP scaling on CPU/gloo: tokens/s and the dispatch/combine share of step time at ep 1, 2, 4.

Every EP size runs the same workload on a random DeepSeek-V3 checkpoint (made here), as local ranks
with DP attention + EP experts. comm_share = time inside dispatch/combine (slowest rank) / generate
wall time. On a 2-core machine 4 ranks share 2 cores, so these are baselines for DBO and EPLB,
not a scaling claim. Last line: {"ep": {"1": {"tok_s": ..., "comm_share": ...}, ...}}.
    python bench/ep_scaling.py [--quick]

--decode-ab: the CPU decode plan on and off (engine/model/fused_decode.py; off = the layers' operations, the
path every step with ep > 1 took before the plan served it) at ep 2, each rank pinned to its own core
with one thread, the two taking turns over --rounds rounds of the same requests in one run (prefix
caching off): mean TPOT (= the decode step) per mode, their ratio, and the paths the plan counted.
    python bench/ep_scaling.py --decode-ab [--rounds 6]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402


def worker(model_dir: str, batch: int, prompt: int, new: int) -> None:
    import torch

    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, parallel={"dispatch_backend": "torch"})
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, llm.config.vocab_size, (batch, prompt), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    if llm.model.dispatcher is not None:
        llm.model.dispatcher.stats.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    stats = llm.all_stats()
    if llm.ctx.rank == 0:
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        comm = max(s.get("dispatch", {}).get("comm_s", 0.0) for s in stats)
        remote = sum(s.get("dispatch", {}).get("dispatch_bytes_remote", 0) for s in stats)
        print("RESULT " + json.dumps({"tok_s": round(n / dt, 1), "comm_share": round(comm / dt, 3),
                                      "elapsed_s": round(dt, 2), "dispatch_bytes_remote": remote}), flush=True)
    llm.shutdown()


def decode_ab_worker(model_dir: str, batch: int, prompt: int, new: int, rounds: int) -> None:
    import statistics

    import torch
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.sched_setaffinity(0, {rank % os.cpu_count()})   # a core per rank, as on a real EP deployment
    torch.set_num_threads(1)
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, enable_prefix_caching=False, parallel={"dispatch_backend": "torch"})
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, llm.config.vocab_size, (batch, prompt), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    plan = llm.model.decode_plan
    if plan is None:
        raise SystemExit("the model has no CPU decode plan (the CPU kernels are not in use)")
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    tpot = {"on": [], "off": []}
    tokens = {}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):   # interleaved: drift hits both
            llm.model.decode_plan = plan if mode == "on" else None
            outs = llm.generate(prompts, sp)
            tpot[mode].append(statistics.mean(o.metrics["tpot_s"] for o in outs))
            tokens.setdefault(mode, [o.outputs[0].token_ids for o in outs])
    llm.model.decode_plan = plan
    if llm.ctx.rank == 0:
        on, off = statistics.median(tpot["on"]), statistics.median(tpot["off"])
        print("RESULT " + json.dumps({
            "decode_step_ms_plan_on": round(on * 1e3, 3), "decode_step_ms_plan_off": round(off * 1e3, 3),
            "on_over_off": round(on / off, 3), "rounds": rounds,
            "tpot_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in tpot.items()},
            "outputs_equal": tokens["on"] == tokens["off"],
            "plan_rank0": {"steps": plan.steps, "stack_declined": {k: v for k, v in plan.stack_declined.items() if v},
                           "declined": {k: v for k, v in plan.declined.items() if v}}}), flush=True)
    llm.shutdown()


def decode_ab(rounds: int) -> None:
    from wideep.launch.cli.local import run_local_ranks
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    batch, prompt, new = 16, 32, 32
    with tempfile.TemporaryDirectory() as d:
        _checkpoint(make_tiny_checkpoint, d)
        cmd = [sys.executable, os.path.abspath(__file__), "--ab-worker", d, str(batch), str(prompt), str(new),
               str(rounds)]
        rc, text = run_local_ranks([], 2, timeout_s=1800, cmd=cmd, capture=True)
        if rc:
            raise SystemExit(f"ep 2 failed with status {rc}:\n{text[-3000:]}")
    res = json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    res["workload"] = {"ep": 2, "batch_per_rank": batch // 2, "prompt": prompt, "new_tokens": new,
                       "threads_per_rank": 1, "cpus": os.cpu_count()}
    print(json.dumps(res))
    save("ep_decode_plan", res)


def _checkpoint(make_tiny_checkpoint, d: str) -> None:
    make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=2048, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
                         n_group=4, topk_group=2, initializer_range=0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=4, metavar=("DIR", "BATCH", "PROMPT", "NEW"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eps", default="1,2,4")
    ap.add_argument("--decode-ab", action="store_true", help="the decode plan on vs off at ep 2, a core per rank")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ab-worker", nargs=5, metavar=("DIR", "BATCH", "PROMPT", "NEW", "ROUNDS"))
    a = ap.parse_args()
    if a.ab_worker:
        d, b, p, n, r = a.ab_worker
        decode_ab_worker(d, int(b), int(p), int(n), int(r))
        return
    if a.decode_ab:
        decode_ab(a.rounds)
        return
    if a.worker:
        d, b, p, n = a.worker
        worker(d, int(b), int(p), int(n))
        return
    from wideep.launch.cli.local import run_local_ranks
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    batch, prompt, new = (8, 32, 8) if a.quick else (16, 64, 32)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        _checkpoint(make_tiny_checkpoint, d)
        for ep in [int(e) for e in a.eps.split(",")]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", d, str(batch), str(prompt), str(new)]
            if ep == 1:
                import subprocess
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
                rc, text = out.returncode, out.stdout
            else:
                rc, text = run_local_ranks([], ep, timeout_s=900, cmd=cmd, capture=True)
            if rc:
                raise SystemExit(f"ep {ep} failed with status {rc}")
            line = [x for x in text.splitlines() if x.startswith("RESULT ")][-1]
            res[str(ep)] = json.loads(line[len("RESULT "):])
            print(f"ep {ep}: {res[str(ep)]}", file=sys.stderr, flush=True)
    out = {"ep": res, "workload": {"batch": batch, "prompt": prompt, "new_tokens": new,
                                   "experts": 32, "topk": 6, "hidden": 256, "layers": 4},
           "cpus": os.cpu_count()}
    save("ep_scaling", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
