"""`wideep …` (= `python -m launch …`): make-tiny, generate, demo."""
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


def cmd_demo(a) -> None:
    import torch

    from engine import LLM, SamplingParams

    from .tiny import make_tiny_checkpoint
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0)
        llm = LLM(d, dtype="float32", progress=False)
        prompts = [torch.randint(2, llm.config.vocab_size, (int(n),)).tolist()
                   for n in torch.randint(8, 64, (a.batch,))]
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"tiny DeepSeek-V3 ({llm.config.num_hidden_layers} layers, {llm.config.moe.n_routed_experts} experts, "
              f"top-{llm.config.moe.top_k}), batch {a.batch}: {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s")
        print(f"first output: {outs[0].outputs[0].token_ids[:16]}")
        if llm.tokenizer is not None:
            (o,) = llm.generate(["Hello, wide EP!"], SamplingParams(temperature=0.0, max_tokens=8))
            print(f"text prompt {o.prompt!r} -> {o.outputs[0].text!r} (random weights: gibberish expected)")


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
    d = sub.add_parser("demo", help="generate on a tiny checkpoint made in a temp dir; prints tok/s")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=32)
    d.set_defaults(fn=cmd_demo)
    a = p.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"wideep: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
