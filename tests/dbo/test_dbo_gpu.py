"""GPU tiers of DBO (skipped without CUDA): the communication stream on a CUDA device keeps the
compute stream's order and keeps host syncs off the launching thread; DBO on and off agree over
NCCL and over DeepEP (2 GPUs)."""
from __future__ import annotations

import time

import pytest
import torch

from tests.parallel.spawn import spawn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_comm_stream_orders_after_compute_and_syncs_off_thread():
    from wideep.parallel.comm_stream import CommStream
    dev = torch.device("cuda")
    s = CommStream(device=dev)
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    seen = {}

    def fn():
        seen["stream"] = torch.cuda.current_stream()
        total = b.sum()
        seen["host"] = total.item()   # a host sync, on the communication thread
        return b * 2

    b = a @ a                         # queued on the compute stream; fn must see its result
    for _ in range(20):
        b = b @ a / 64
    t0 = time.perf_counter()
    work = s.submit(fn, keep=(b,))
    submit_s = time.perf_counter() - t0
    out = work.wait()
    ref = b * 2
    torch.cuda.synchronize()
    assert seen["stream"] == s.cuda_stream != torch.cuda.current_stream()
    assert torch.equal(out, ref)
    assert seen["host"] == pytest.approx(b.sum().item(), rel=1e-5)
    assert submit_s < 0.05           # the launching thread did not wait for the matmuls
    s.close()


def _dbo_rank(model_dir: str, backend: str) -> list:
    from wideep.engine import LLM, SamplingParams
    # DeepEP carries bf16 only: there the split's different GEMM shapes may move logprobs a little
    kw = dict(progress=False, block_size=8, max_num_batched_tokens=64,
              dtype="bfloat16" if backend == "deepep" else "float32",
              parallel={"backend": "nccl", "dispatch_backend": backend})
    off = LLM(model_dir, **kw)
    on = LLM(model_dir, ctx=off.ctx, dbo={"enabled": True}, **kw)
    prompts = [[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([37, 5, 61, 1, 23, 9])]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    res = [[(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
            for o in llm.generate(prompts, sp)] for llm in (off, on)]
    moved = sum(d.stats.dispatch_calls for d in set(on.engine.core.runner.overlap.dispatchers))
    off.shutdown()
    return res, moved


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["torch", "deepep"])
def test_dbo_on_equals_off_on_gpus(tmp_path, backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if backend == "deepep":
        pytest.importorskip("deep_ep")
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=6, hidden_size=256, initializer_range=0.2)
    tol = 5e-2 if backend == "deepep" else 1e-4
    for (off, on), moved in spawn(_dbo_rank, 2, args=(d, backend), timeout_s=600):
        assert moved > 0
        for (tok_off, lp_off), (tok_on, lp_on) in zip(off, on):
            assert max(abs(a - b) for a, b in zip(lp_off, lp_on)) < tol
            assert tok_off[0] == tok_on[0]
            if backend == "torch":
                assert tok_off == tok_on
