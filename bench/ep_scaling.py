"""Wide-EP scaling on CPU/gloo: tokens/s and the dispatch/combine share of step time at ep 1, 2, 4.

Every EP size runs the same workload on a random DeepSeek-V3 checkpoint (made here), as local ranks
with DP attention + EP experts. comm_share = time inside dispatch/combine (slowest rank) / generate
wall time. On a 2-core machine 4 ranks share 2 cores, so these are baselines for DBO and EPLB,
not a scaling claim. Last line: {"ep": {"1": {"tok_s": ..., "comm_share": ...}, ...}}.
    python bench/ep_scaling.py [--quick]
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

    from engine import LLM, SamplingParams
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=4, metavar=("DIR", "BATCH", "PROMPT", "NEW"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eps", default="1,2,4")
    a = ap.parse_args()
    if a.worker:
        d, b, p, n = a.worker
        worker(d, int(b), int(p), int(n))
        return
    from launch.local import run_local_ranks
    from launch.tiny import make_tiny_checkpoint
    batch, prompt, new = (8, 32, 8) if a.quick else (16, 64, 32)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=2048, hidden_size=256, intermediate_size=512,
                             moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
                             n_group=4, topk_group=2, initializer_range=0.05)
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
