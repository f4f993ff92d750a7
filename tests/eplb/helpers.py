"""Shared pieces of the EPLB runtime tests: a tiny checkpoint with skewed routing, an LLM whose model
has EPLB's placement, and checks against the checkpoint's tensors."""
from __future__ import annotations

import os

import torch

PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7, 31, 77, 120, 4], [5, 6, 9],
           [120, 33, 71, 2, 88, 14, 160, 45, 9, 200], list(range(20, 60))]
MAX_TOKENS = 4


def hot_experts(layer: int, num_experts: int = 16) -> list[int]:
    """The experts layer `layer`'s bias favours: 3 of one group and 1 of the next, moving per layer."""
    base = (3 * layer) % num_experts
    return [(base + j) % num_experts for j in (0, 1, 2, 5)]


def make_skewed_checkpoint(out_dir: str, seed: int = 5, boost: float = 0.3) -> str:
    """A tiny DeepSeek-V3 whose e_score_correction_bias (selection only, noaux_tc) sends most tokens
    to 4 experts per MoE layer: without EPLB one or two EP ranks do most expert work."""
    from safetensors.torch import load_file, save_file

    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    make_tiny_checkpoint(out_dir, arch="v3", seed=seed)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            layer = int(name.split(".")[2])
            t[hot_experts(layer, t.numel())] += boost
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def build_llm(model_dir: str, eplb_cfg, **options):
    """-> (LLM, EplbController) for this rank, the controller driven by the test: the engine gets
    the config with enabled=False (placement and redundant slots, no controller of its own)."""
    import dataclasses

    from wideep.engine import LLM
    from wideep.eplb import EplbController
    options.setdefault("enable_prefix_caching", False)
    # ParallelConfig checks (experts + redundant) % ep before connecting
    options["parallel"] = dict(options.get("parallel") or {}, num_redundant_experts=eplb_cfg.num_redundant_experts)
    llm = LLM(model_dir, progress=False, eplb=dataclasses.replace(eplb_cfg, enabled=False), **options)
    return llm, EplbController(llm.model, llm.ctx, eplb_cfg)


def prompt_logprobs(outs) -> list[list[float]]:
    return [[o.prompt_logprobs[j][o.prompt_token_ids[j]] for j in range(1, len(o.prompt_token_ids))]
            for o in outs]


def generate(llm):
    from wideep.engine import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    return prompt_logprobs(outs), [o.outputs[0].token_ids for o in outs]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


def experts_match_checkpoint(model, model_dir: str) -> list[str]:
    """Every local slot's weights == the checkpoint tensors of the logical expert it holds
    (bit-exact); -> the mismatches, [] when all match."""
    from safetensors import safe_open
    bad = []
    I = model.cfg.moe.moe_intermediate_size
    layer_ids = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for i, moe in zip(layer_ids, model.moe_layers()):
            for slot, e in enumerate(moe.local_phy2log):
                pre = f"model.layers.{i}.mlp.experts.{e}."
                w13 = torch.cat([f.get_tensor(pre + "gate_proj.weight"), f.get_tensor(pre + "up_proj.weight")])
                if not (torch.equal(moe.experts.w13[slot], w13)
                        and torch.equal(moe.experts.w2[slot], f.get_tensor(pre + "down_proj.weight"))):
                    bad.append(f"layer {i} slot {slot} (expert {e})")
    return bad


def rank_balancedness(rank_load: torch.Tensor) -> torch.Tensor:
    """[L, ep] pairs per rank -> [L] mean / max."""
    load = rank_load.double()
    return load.mean(-1) / load.max(-1).values
