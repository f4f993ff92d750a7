"""wideep vs transformers `generate` on the same random DeepSeek-V3 checkpoint, greedy, float32, CPU.

Default shape (issue #2): hidden 512, 8 layers, 64 experts top-6, batch 16, prompt 128, 64 new tokens.
Both engines run in this process, interleaved (wideep, hf, hf-eager, wideep, ...) so machine noise hits
all; the best trial of each counts. `hf` is transformers with its default experts implementation
(grouped_mm in transformers 5), `hf_eager` with the per-expert loop older releases used.
Last line: JSON with wideep_tok_s, hf_tok_s, ratio (= hf time / wideep time), hf_eager_tok_s, ratio_eager.
    python bench/decode_vs_hf.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402
from launch.tiny import make_tiny_checkpoint  # noqa: E402


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
    ap.add_argument("--quick", action="store_true", help="smaller shape for a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.batch, a.prompt, a.new, a.trials = 256, 4, 8, 64, 16, 1
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=4096, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                             moe_intermediate_size=a.hidden // 2, num_hidden_layers=a.layers, first_k_dense_replace=1,
                             num_attention_heads=8, num_key_value_heads=8, q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 4,
                             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=a.experts,
                             num_experts_per_tok=a.topk, n_group=8, topk_group=4, max_position_embeddings=1024,
                             initializer_range=0.05)
        llm = LLM(d, dtype="float32", progress=False)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        hf_eager = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager").eval()
        prompts = torch.randint(2, 4096, (a.batch, a.prompt))
        sp = SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True)

        def run_wideep() -> tuple[float, list[list[int]]]:
            t0 = time.perf_counter()
            outs = llm.generate(prompts.tolist(), sp)
            return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

        @torch.inference_mode()
        def run_hf(model=hf) -> tuple[float, list[list[int]]]:
            t0 = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new,
                              min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0, out[:, a.prompt:].tolist()

        llm.generate(prompts[:2, :8].tolist(), SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        run_hf_small = hf.generate(prompts[:2, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        del run_hf_small
        tw, th, te = [], [], []
        for _ in range(a.trials):
            t, ours = run_wideep()
            tw.append(t)
            t, theirs = run_hf()
            th.append(t)
            t, _ = run_hf(hf_eager)
            te.append(t)
        agree = sum(x == y for x, y in zip(ours, theirs)) / len(ours)
    n = a.batch * a.new
    res = {"shape": {"hidden": a.hidden, "layers": a.layers, "experts": a.experts, "topk": a.topk,
                     "batch": a.batch, "prompt": a.prompt, "new_tokens": a.new},
           "wideep_s": round(min(tw), 3), "hf_s": round(min(th), 3),
           "wideep_tok_s": round(n / min(tw), 1), "hf_tok_s": round(n / min(th), 1),
           "ratio": round(min(th) / min(tw), 2), "hf_eager_tok_s": round(n / min(te), 1),
           "ratio_eager": round(min(te) / min(tw), 2), "greedy_sequences_equal": agree,
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
