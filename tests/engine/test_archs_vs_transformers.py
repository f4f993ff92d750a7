"""DeepSeek-V3.2 (DSA), GLM-4.x-MoE-lite and Kimi-K2.5's text model against transformers, float32:
prompt logprobs within 1e-4 and 16 greedy tokens equal. V3.2 with index_topk well below the prompts
(8 against 40-200 tokens) and above every context; models built by transformers and our own tiny
checkpoints (launch/tiny/checkpoint.py) loaded into transformers' classes."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.oracle import hf_greedy, hf_prompt_logprobs, load_tiny_in_hf, make_hf_model

_rng = random.Random(17)
LONG = [[_rng.randrange(2, 200) for _ in range(n)] for n in (40, 97, 200)] + [[5, 6]]
SHORT = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [120, 33, 71, 2, 88, 14, 160]] + LONG[:2]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.707}

HF_BUILT = {
    # the indexer picks 8 of up to 215 tokens: most queries attend sparsely
    "v32_topk_8": dict(arch="v32", bias_std=0.2, prompts=LONG),
    # index_topk above every context: DSA is plain MLA (the indexer still runs its keys)
    "v32_topk_above_context": dict(arch="v32", seed=1, bias_std=0.2, index_topk=256, prompts=LONG),
    "v32_yarn_topk_5": dict(arch="v32", bias_std=0.1, index_topk=5, rope_parameters=YARN, prompts=SHORT),
    # one dense layer, then MoE; one expert group; dv (24) != dn (16); decoder norms at eps 1e-5
    "glm4_moe_lite": dict(arch="glm4_moe_lite", bias_std=0.2, prompts=SHORT),
}
TINY = {  # launch/tiny/checkpoint.py checkpoints as their makers publish them, read by transformers
    "v32": dict(prompts=LONG),            # index_topk 16, YaRN, rope_scaling spelling
    "glm4_moe_lite": dict(prompts=SHORT),
    "kimi_k25": dict(prompts=SHORT),      # text under language_model.*, plus a vision tower nobody serves here
}


def compare(hf, model_dir: str, prompts: list[list[int]], tol: float = 1e-4, **options) -> None:
    llm = LLM(model_dir, dtype="float32", progress=False, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        diff = (ours - hf_prompt_logprobs(hf, ids)).abs().max().item()
        assert diff < tol, f"prompt of {len(ids)} tokens: logprobs differ by {diff}"
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 16), f"prompt of {len(ids)} tokens"
    llm.shutdown()


@pytest.mark.parametrize("case", list(HF_BUILT))
def test_transformers_built_models(case, tmp_path):
    kw = dict(HF_BUILT[case])
    prompts = kw.pop("prompts")
    hf = make_hf_model(kw.pop("arch"), str(tmp_path), **kw)
    compare(hf, str(tmp_path), prompts)


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_checkpoints_in_transformers(arch, tmp_path):
    d = make_tiny_checkpoint(str(tmp_path), arch=arch, seed=3, initializer_range=0.15)
    compare(load_tiny_in_hf(arch, d), d, TINY[arch]["prompts"])
