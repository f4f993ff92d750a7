"""`wideep …` (= `python -m launch …`): make-tiny, generate, demo, run, serve."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_make_tiny(a) -> None:
    from .tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(a.out, arch=a.arch, fp8=a.fp8, seed=a.seed)
    print(f"wrote a tiny DeepSeek-{a.arch.upper()}{' FP8' if a.fp8 else ''} checkpoint to {path}")


def cmd_generate(a) -> None:
    from engine import LLM, SamplingParams
    if (a.prompt is None) == (a.prompt_ids is None):
        raise SystemExit("give exactly one of --prompt or --prompt-ids")
    llm = LLM(a.model, dtype=a.dtype, progress=not a.quiet)
    prompt = a.prompt if a.prompt is not None else _ids(a.prompt_ids)
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                        seed=a.seed)
    (out,) = llm.generate([prompt], sp)
    c = out.outputs[0]
    print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids, "text": c.text,
                      "finish_reason": c.finish_reason}))


DEMO_CONFIG = """
[model]
path = "{path}"
dtype = "float32"

[parallel]
dispatch_backend = "torch"

[run]
prompt_ids = {prompts}
max_tokens = {max_tokens}
temperature = 0.0
"""


def cmd_demo(a) -> None:
    """A tiny DeepSeek-V3 made in a temp dir, served by `a.ranks` local ranks (spawned here)."""
    import random

    from .local import run_local_ranks
    from .tiny import make_tiny_checkpoint
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0)
        prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(8, 64))] for _ in range(a.batch)]
        path = f"{d}/demo.toml"
        with open(path, "w") as f:
            f.write(DEMO_CONFIG.format(path=d, prompts=json.dumps(prompts), max_tokens=a.max_tokens))
        argv = ["run", "--config", path, "--summary-only"]
        if a.ranks == 1:
            main(argv)
            return
        print(f"wideep demo: {a.ranks} local ranks (gloo), DP attention + EP experts, tiny DeepSeek-V3", flush=True)
        rc = run_local_ranks(argv, a.ranks, timeout_s=a.timeout)
        if rc:
            raise SystemExit(rc)


def _feature_flags(a) -> dict:
    """--enable-dbo [auto] / --enable-eplb (vLLM's flag names) as run-config overrides."""
    return {"dbo__enabled": {None: None, "true": True, "auto": "auto"}[a.enable_dbo],
            "eplb__enabled": True if a.enable_eplb else None}


def _add_feature_flags(p) -> None:
    p.add_argument("--enable-dbo", nargs="?", const="true", choices=["true", "auto"],
                   help="dual-batch overlap ([dbo] enabled); 'auto': split only where it measured faster")
    p.add_argument("--enable-eplb", action="store_true", help="online expert load balancing ([eplb] enabled)")


def cmd_run(a) -> None:
    """Generate the [run] prompts of a run config; SPMD under torchrun/mpirun (every rank runs this)."""
    from engine import LLM, SamplingParams

    from . import run_config
    cfg = run_config.override(run_config.load(a.config), model__path=a.model, model__dtype=a.dtype,
                              parallel__dp_size=a.dp_size, parallel__ep_size=a.ep_size,
                              parallel__dispatch_backend=a.dispatch_backend, run__max_tokens=a.max_tokens,
                              **_feature_flags(a))
    r = cfg.get("run", {})
    prompts = list(r.get("prompt_ids", [])) + list(r.get("prompts", []))
    if not prompts:
        raise ValueError(f"{a.config}: [run] has no prompt_ids or prompts")
    llm = LLM(**run_config.llm_kwargs(cfg))
    sp = SamplingParams(temperature=r.get("temperature", 0.0), top_p=r.get("top_p", 1.0), top_k=r.get("top_k", -1),
                        max_tokens=r.get("max_tokens", 16), seed=r.get("seed"))
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up, every rank
    if llm.model.dispatcher is not None:
        llm.model.dispatcher.stats.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    stats = llm.all_stats()
    if llm.ctx.rank == 0:
        if not a.summary_only:
            for i, o in enumerate(outs):
                c = o.outputs[0]
                print(json.dumps({"index": i, "prompt_token_ids": o.prompt_token_ids, "token_ids": c.token_ids,
                                  "text": c.text, "finish_reason": c.finish_reason}))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        per_rank = [0] * llm.ctx.dp_size
        for i, o in enumerate(outs):
            per_rank[llm.last_assignment[i]] += len(o.outputs[0].token_ids)
        summary = {"ranks": llm.ctx.world_size, "dp_size": llm.ctx.dp_size, "ep_size": llm.ctx.ep_size,
                   "requests": len(outs), "generated_tokens": n, "elapsed_s": round(dt, 3),
                   "tok_s": round(n / dt, 1), "per_rank_tokens": per_rank,
                   "expert_bytes_per_rank": [s["param_bytes"]["experts"] for s in stats],
                   "dispatch_bytes_per_rank": [s.get("dispatch", {}).get("dispatch_bytes", 0) for s in stats],
                   "dispatch_bytes_remote_per_rank": [s.get("dispatch", {}).get("dispatch_bytes_remote", 0)
                                                      for s in stats]}
        print(f"{n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s on {llm.ctx.world_size} rank(s); "
              f"tokens per DP rank {per_rank}", flush=True)
        print(json.dumps(summary), flush=True)
    llm.shutdown()


def cmd_serve(a) -> None:
    """OpenAI-compatible HTTP server on rank 0 (launch/server.py); SPMD under torchrun/mpirun."""
    from . import run_config
    try:
        from . import server
    except ImportError as e:
        raise SystemExit(f"wideep serve needs aiohttp: pip install -e '.[serve]' ({e})") from None
    cfg = run_config.override(run_config.load(a.config), model__path=a.model, model__dtype=a.dtype,
                              parallel__dp_size=a.dp_size, parallel__ep_size=a.ep_size,
                              server__host=a.host, server__port=a.port, server__model_name=a.model_name,
                              **_feature_flags(a))
    rc = server.serve(cfg)
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="wideep", description="wide expert-parallel DeepSeek serving runtime")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("make-tiny", help="write a random-weight HF-format DeepSeek checkpoint")
    t.add_argument("--out", required=True)
    t.add_argument("--arch", choices=["v2", "v3"], default="v3")
    t.add_argument("--fp8", action="store_true")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_make_tiny)
    g = sub.add_parser("generate", help="generate from one prompt")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt-ids")
    g.add_argument("--prompt")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="a tiny checkpoint made in a temp dir, served by 4 local ranks; prints tok/s")
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--timeout", type=float, default=600.0, help="hard limit for the ranks (s)")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("run", help="generate the [run] prompts of a TOML run config (SPMD under torchrun/mpirun)")
    r.add_argument("--config", required=True)
    r.add_argument("--model")
    r.add_argument("--dtype")
    r.add_argument("--dp-size", type=int)
    r.add_argument("--ep-size", type=int)
    r.add_argument("--dispatch-backend", choices=["auto", "torch", "allgather", "deepep"])
    r.add_argument("--max-tokens", type=int)
    r.add_argument("--summary-only", action="store_true", help="print only the throughput summary")
    _add_feature_flags(r)
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /health, /metrics) on rank 0")
    s.add_argument("--config", required=True)
    s.add_argument("--host", help="bind address (default 127.0.0.1: this host only)")
    s.add_argument("--port", type=int, help="default 8000; 0 picks a free port (printed)")
    s.add_argument("--model-name", help="the `model` clients pass (default: the checkpoint dir's name)")
    s.add_argument("--model")
    s.add_argument("--dtype")
    s.add_argument("--dp-size", type=int)
    s.add_argument("--ep-size", type=int)
    _add_feature_flags(s)
    s.set_defaults(fn=cmd_serve)
    from .eplb_cli import add_parsers
    add_parsers(sub)
    a = p.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"wideep: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
