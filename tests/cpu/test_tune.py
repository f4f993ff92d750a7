"""Kernels chosen by measurement (cpu/tune.py): the run-of-wins rule, the file one process measures and the others
read, the limits applied where the kernels are called (cpu/linear.py, cpu/layers.py mla_decode), the fused decode's
own measurement (engine/model/fused_decode.py), `wideep env`, the build's march (WIDEEP_CPU_MARCH) and the fallback
when the library cannot be built."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import build, tune

pytestmark = pytest.mark.skipif(build.unusable() is not None, reason=f"CPU kernels not built: {build.unusable()}")


@pytest.fixture
def limits(monkeypatch):
    """Set this process's choices (at torch's current thread count) to the given limits; restored after."""
    def set_(**lim):
        full = {**tune.builtin(), **lim}
        monkeypatch.setitem(tune._choices, torch.get_num_threads(), {"limits": full, "measured": True, "ratios": {}})
    monkeypatch.setattr(tune, "_choices", dict(tune._choices))
    return set_


def test_run_of_wins_stops_at_the_first_loss_and_at_the_cap():
    ratios = {1: 0.5, 2: 0.8, 4: 1.2, 8: 0.7}
    seen = []

    def at(s):
        seen.append(s)
        return ratios[s]
    assert tune.run_of_wins((1, 2, 4, 8), 64, at) == (2, {1: 0.5, 2: 0.8, 4: 1.2})
    assert seen == [1, 2, 4]                                             # 8 (a win again) never measured
    assert tune.run_of_wins((1, 2, 4, 8), 2, lambda s: 0.5) == (2, {1: 0.5, 2: 0.5})   # the built-in cap
    assert tune.run_of_wins((1, 2), 64, lambda s: 1.01)[0] == 0           # loses at once: never C


def test_a_ratio_near_one_is_the_median_of_three_measurements():
    got = {1: [0.5], 2: [1.05, 0.97, 0.98], 4: [0.95, 1.3, 1.02]}
    seen = []

    def at(s):
        seen.append(s)
        return got[s].pop(0)
    assert tune.run_of_wins((1, 2, 4), 64, at) == (2, {1: 0.5, 2: 0.98, 4: 1.02})
    assert seen == [1, 2, 2, 2, 4, 4, 4]


def test_a_bad_switch_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("WIDEEP_CPU_TUNE", "sometimes")
    with pytest.raises(ValueError, match="WIDEEP_CPU_TUNE='sometimes'"):
        tune.tuning()


def test_measured_once_kept_in_the_cache_and_read_back(monkeypatch, tmp_path):
    """One process measures and writes its file; the next reads it (measure is never called again), and the limits
    are within the built-in ones."""
    code = ("import json, logging, torch; logging.basicConfig(level=logging.INFO); torch.set_num_threads(1); "
            "from wideep.cpu import tune; c = tune.choices(); print(json.dumps(c))")
    env = dict(os.environ, WIDEEP_CPU_TUNE="measure", WIDEEP_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[-1])
    assert first["measured"] and set(first["limits"]) == set(tune.KERNELS) and first["threads"] == 1
    assert r.stderr.count("CPU kernels, measured against torch at 1 thread(s)") == 1, r.stderr   # one line
    kept = [p for p in os.listdir(tmp_path) if p.startswith("tune-") and p.endswith(".json")]
    assert len(kept) == 1
    builtin = json.loads(subprocess.run([sys.executable, "-c", "import json; from wideep.cpu import tune; "
                                         "print(json.dumps(tune.builtin()))"], env=env, capture_output=True,
                                        text=True, timeout=300).stdout)
    assert all(0 <= first["limits"][k] <= builtin[k] for k in tune.KERNELS if k != "bf16_widen")
    assert first["limits"]["bf16_widen"] in (0, 1)
    again = code.replace("c = tune.choices()", "tune.measure = None; c = tune.choices()")   # measuring would fail
    r = subprocess.run([sys.executable, "-c", again], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["limits"] == first["limits"]


def test_off_means_the_builtin_limits(monkeypatch):
    monkeypatch.setattr(tune, "_choices", {})
    monkeypatch.setenv("WIDEEP_CPU_TUNE", "off")
    c = tune.choices()
    assert not c["measured"] and c["limits"] == tune.builtin()


def test_linear_runs_torch_where_c_measured_slower(limits):
    from wideep.cpu import linear
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    limits(linear_f32=0)
    assert linear.max_rows(torch.float32) == 0
    assert torch.equal(linear.small_linear(x, w), F.linear(x, w))      # torch's own result, to the bit
    limits(linear_f32=2)
    assert linear.max_rows(torch.float32) == 2
    assert torch.equal(linear.small_linear(x, w), F.linear(x, w))      # 3 rows > 2: torch
    torch.testing.assert_close(linear.small_linear(x[:2], w), F.linear(x[:2], w), atol=1e-5, rtol=1e-5)


def test_bfloat16_rows_past_the_kernel_widen_where_measured_faster(limits):
    from wideep.cpu import linear
    x, w = torch.randn(300, 40).to(torch.bfloat16), torch.randn(24, 40).to(torch.bfloat16)
    limits(bf16_widen=1)
    assert torch.equal(linear.small_linear(x, w), F.linear(x.float(), w.float()).to(torch.bfloat16))
    limits(bf16_widen=0)
    assert torch.equal(linear.small_linear(x, w), F.linear(x, w))


def test_experts_limit_applies_to_float_weights_only(limits):
    from wideep.cpu import linear
    limits(experts_f32=0, experts_bf16=4)
    assert linear.experts_max_rows(torch.float32, torch.float32) == 0
    assert linear.experts_max_rows(torch.bfloat16, torch.bfloat16) == 4   # under the built-in 16 or "every batch"
    assert linear.experts_max_rows(torch.uint8, torch.float32) == linear.builtin_experts_max_rows(torch.uint8,
                                                                                                 torch.float32)


def test_mla_decode_on_torch_equals_the_kernel(limits):
    from wideep.cpu import layers
    g = torch.Generator().manual_seed(5)
    B, Nh, C, R, bs = 3, 4, 32, 8, 16
    pool = torch.randn(20 * bs, C + R, generator=g)
    table = torch.tensor([[3, 5, 7, 0], [1, 2, 0, 0], [9, 10, 11, 12]], dtype=torch.int64)
    lens = torch.tensor([40, 17, 64], dtype=torch.int32)
    q = torch.randn(B, Nh, C + R, generator=g)
    limits(mla_decode=1)
    c = layers.mla_decode(q, pool, table, lens, bs, C, 0.2, 64)
    limits(mla_decode=0)
    t = layers.mla_decode(q, pool, table, lens, bs, C, 0.2, 64)
    torch.testing.assert_close(t, c, atol=1e-5, rtol=1e-5)
    assert torch.equal(t, layers.mla_decode_torch(q, pool, table, lens, bs, C, 0.2, 64))
    pool16 = pool.to(torch.bfloat16)
    torch.testing.assert_close(layers.mla_decode(q, pool16, table, lens, bs, C, 0.2, 64),
                               layers.mla_decode_torch(q, pool16, table, lens, bs, C, 0.2, 64), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tune")), "v3", num_hidden_layers=3,
                                first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                                num_experts_per_tok=2, vocab_size=200, seed=3, initializer_range=0.2)


def _generate(tiny, **kw):
    from wideep.engine import LLM, SamplingParams
    llm = LLM(tiny, dtype="float32", device="cpu", progress=False, block_size=4, kv_cache_blocks=64, max_num_seqs=4,
              enable_prefix_caching=False, **kw)
    outs = llm.generate([[3, 4, 5, 6, 7], [9, 8, 7], [11, 12]], SamplingParams(max_tokens=16, ignore_eos=True,
                                                                              logprobs=1))
    return llm, [(o.outputs[0].token_ids, [next(iter(p.values())) for p in o.outputs[0].logprobs]) for o in outs]


def _same(got, want):
    """The same tokens; logprobs within float32 rounding (the fused calls and the operations sum in other orders)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_the_fused_decode_is_measured_against_the_operations(tiny, monkeypatch):
    """With the choices measured, each (path, rows) bucket takes turns between the fused calls and the operations
    (the same C kernels at the built-in limits), then keeps the faster; a bucket decided for the operations runs
    them, counted as measured_slower."""
    from wideep.engine.model import fused_decode
    monkeypatch.setenv("WIDEEP_CPU_TUNE", "off")
    _, want = _generate(tiny)
    monkeypatch.setattr(tune, "tuning", lambda: True)          # the plan measures; the kernels' limits stay built-in
    llm, got = _generate(tiny)
    _same(got, want)
    plan = llm.model.decode_plan
    steps = fused_decode.CALIBRATION_STEPS + 1
    assert ("stack", 4) in plan.calibration and set(plan.calibration_ms[("stack", 4)]) == {"fused", "ops"}
    assert plan.declined["calibrating"] == steps
    stats = plan.stats()
    assert stats["decode_fused_stack_4"] == int(plan.calibration[("stack", 4)] == "fused")
    # a bucket decided for the operations: they run, counted; the outputs do not change
    monkeypatch.setattr(fused_decode.DecodePlan, "_calibrating",
                        lambda self, bucket: self.calibration.setdefault(bucket, "ops") and None)
    llm, got = _generate(tiny)
    _same(got, want)
    assert llm.model.decode_plan.steps["stack"] == 0 and llm.model.decode_plan.declined["measured_slower"] > 0


def test_wideep_env_prints_the_cpu_and_the_choices(tmp_path):
    env = dict(os.environ, WIDEEP_CPU_TUNE="off", WIDEEP_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "wideep.launch", "env", "--json"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["kernels"] == json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from wideep.cpu import tune; print(json.dumps(tune.builtin()))"],
        env=env, capture_output=True, text=True, timeout=300).stdout)
    assert got["why_not_measured"] == "WIDEEP_CPU_TUNE=off" and "native_kernels" in got and "isa" in got
    r = subprocess.run([sys.executable, "-m", "wideep.launch", "env"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "choices:" in r.stdout and "linear f32" in r.stdout, r.stderr


def test_a_march_this_cpu_cannot_run_is_refused_not_run(monkeypatch, tmp_path):
    monkeypatch.setenv("WIDEEP_CPU_MARCH", "skylake-avx512")
    monkeypatch.setattr(build, "missing_isa", lambda arch: ["avx512f"])   # as on an AVX2-only CPU
    with pytest.raises(build.BuildError, match="WIDEEP_CPU_MARCH=skylake-avx512 .*avx512f.*SIGILL"):
        build.build("wideep_cpu_refused", build.sources())
    monkeypatch.setenv("WIDEEP_CPU_MARCH", "x86-64-v3; rm -rf /")
    with pytest.raises(build.BuildError, match="is not a compiler -march value"):
        build.march()


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 ISA names")
def test_the_isa_of_a_build_comes_from_the_compiler():
    v3 = build.isa_of("x86-64-v3")
    assert {"avx2", "fma"} <= v3 and "avx512f" not in v3
    assert "avx512f" in build.isa_of("skylake-avx512")
    assert build.missing_isa("native") == []
    assert set(build.missing_isa("skylake-avx512")) == build.isa_of("skylake-avx512") - build.host_isa()


def test_a_build_that_fails_falls_back_to_torch_with_one_line(tmp_path):
    """No compiler: importing the kernels raises nothing, the reason is logged once, auto picks torch's paths."""
    code = ("import logging; logging.basicConfig(); from wideep.cpu import build, tune; "
            "from wideep.moe.backend import resolve_experts_backend; "
            "from wideep.attention_mla.paged_decode import resolve_attention_backend; import torch; "
            "print(build.unusable() is not None, resolve_experts_backend('auto', 'cpu', torch.float32, None, 64, 32)"
            ".backend, resolve_attention_backend('auto', 'cpu'), tune.choices()['limits']['linear_f32'])")
    env = dict(os.environ, CC="/nonexistent/cc", WIDEEP_CACHE_DIR=str(tmp_path), WIDEEP_CPU_TUNE="measure")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "grouped", "torch", "0"]
    assert r.stderr.count("the CPU kernels are not built, torch's operations run instead") == 1, r.stderr
