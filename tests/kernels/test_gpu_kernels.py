"""GPU tier of the kernels (skipped without CUDA): real shapes and the production tile table,
against the torch references; DeepGEMM when it imports; the whole model with `auto` backends."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _experts(E, H, I, fp8):
    from wideep.moe.experts import Experts
    from wideep.moe.fp8 import quantize_experts_fp8
    w13 = torch.randn(E, 2 * I, H, device="cuda") * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda") * I ** -0.5
    ex = Experts(E, H, I, device="cuda", dtype=torch.bfloat16, fp8_block=(128, 128) if fp8 else None)
    with torch.no_grad():
        if fp8:
            q13, s13, q2, s2 = quantize_experts_fp8(w13, w2)
            ex.w13.copy_(q13), ex.w13_scale_inv.copy_(s13), ex.w2.copy_(q2), ex.w2_scale_inv.copy_(s2)
        else:
            ex.w13.copy_(w13), ex.w2.copy_(w2)
    return ex


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T", [1, 64, 1024, 4096])  # pairs per expert 0.1 .. 512: every row of the tile table
def test_fused_moe_bf16_real_tiles(T, fp8):
    from wideep.moe.triton_moe import fused_moe
    E, H, I, k = 64, 1024, 512, 8
    ex = _experts(E, H, I, fp8)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randn(T, E, device="cuda").topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda")
    if fp8:
        w13, w2 = ex.dense_weights(torch.float32)
        from wideep.moe.experts import Experts
        dense = Experts(E, H, I, device="cuda", dtype=torch.float32)
        dense.w13.data, dense.w2.data = w13, w2
        ref = dense.forward_reference(x.float(), ids, w)
    else:
        ref = ex.forward_reference(x, ids, w)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = fused_moe(x, ex.w13, ex.w2, ids, w, w13_scale=getattr(ex, "w13_scale_inv", None),
                    w2_scale=getattr(ex, "w2_scale_inv", None), out=out)
    assert torch.isfinite(got).all() and _rel(got, ref) < 2e-2


@pytest.mark.parametrize("tiles", [None, (16, 32, 4, 2), (32, 32, 8, 2), (64, 16, 8, 2), (16, 64, 4, 3)])
def test_mla_decode_deepseek_shapes(tiles):  # None: DecodeTiles' production default
    from wideep.attention_mla.paged_decode import paged_decode_reference
    from wideep.attention_mla.triton_decode import DecodeTiles, mla_decode
    N, C, R, bs = 128, 512, 64, 64
    lens = [1, 64, 3000, 777, 4096, 129]
    nblk = [-(-L // bs) for L in lens]
    perm = torch.randperm(sum(nblk)).tolist()
    table, k = [], 0
    for nb in nblk:
        table.append(perm[k:k + nb] + [0] * (max(nblk) - nb))
        k += nb
    pool = torch.randn(sum(nblk) * bs, C + R, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor(table, device="cuda", dtype=torch.int32)
    q = torch.randn(len(lens), N, C + R, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
    t = DecodeTiles() if tiles is None else DecodeTiles(block_h=tiles[0], block_n=tiles[1], num_warps=tiles[2],
                                                        num_stages=tiles[3])
    out = torch.full((len(lens), N, C), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = mla_decode(q, pool, table, seq, bs, C, 192 ** -0.5, max(lens), tiles=t, out=out)
    ref = paged_decode_reference(q.float(), pool.float(), table, lens, bs, C, 192 ** -0.5)
    assert _rel(got, ref) < 1e-2


def test_group_quant_on_gpu_equals_reference():
    from wideep.moe.fp8 import quantize_per_token_group
    from wideep.moe.triton_quant import per_token_group_quant_fp8
    x = torch.randn(333, 7168, device="cuda", dtype=torch.bfloat16) * 3
    q, s = per_token_group_quant_fp8(x)
    rq, rs = quantize_per_token_group(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert (q.float() != rq.float()).float().mean().item() < 1e-4  # rounding ties only


def test_deepgemm_experts_when_installed():
    from wideep.moe import deepgemm
    api = deepgemm.load()
    if api is None:
        pytest.skip("deep_gemm does not import")
    E, H, I = 8, 1024, 512
    ex = _experts(E, H, I, fp8=True)
    ex.backend, ex.deepgemm = "deepgemm", api
    for T in (7, 600):  # masked (decode) and contiguous (prefill) layouts
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.randn(T, E, device="cuda").topk(2, dim=-1).indices
        w = torch.rand(T, 2, device="cuda")
        assert _rel(ex(x, ids, w), ex.forward_grouped(x, ids, w)) < 5e-2


def test_model_on_cuda_auto_backends_equal_torch(tmp_path):
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), "v3")
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [[3, 17, 42, 99, 5], [7, 8]]
    auto = LLM(d, dtype="float32", progress=False)                       # device: CUDA when present
    assert auto.model.device.type == "cuda" and auto.model.backends["experts"] == "triton"
    assert auto.model.backends["attention"] == "triton"
    torch_ = LLM(d, dtype="float32", progress=False, experts_backend="torch", attention_backend="torch")
    for a, b in zip(auto.generate(prompts, sp), torch_.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert max(abs(x[t] - y[t]) for t in x) < 1e-3
