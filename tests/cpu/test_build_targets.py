"""The kernels build for CPUs this host is not: every x86 intrinsic sits in code guarded by the instruction set it
needs, so a build for the x86-64 baseline (SSE2 only: the vector extensions lowered by the compiler) builds and
gives the float64 reference's numbers here, and the sources compile and link for 64-bit Arm (Graviton, Grace: the
portable C) with a cross compiler (zig's, from the ziglang wheel; skipped where it is not installed). Only the x86-64
baseline's library is run: the host executes everything that one holds."""
from __future__ import annotations

import ctypes
import os
import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import build, gemm

pytestmark = pytest.mark.skipif(build.unusable() is not None, reason=f"CPU kernels not built: {build.unusable()}")


def _sources(tmp_path) -> str:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in build.sources().items():
        (src / name).write_text(text)
    return str(src)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="not an x86-64 host")
def test_a_build_for_the_x86_64_baseline_runs_and_computes(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "FLAGS", build.flags("x86-64"))
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    assert build.isa_of("x86-64") == set()   # no SSE4.2, no AVX of any width in this build
    lib = build.build("wideep_cpu_x86_64", build.sources())
    for name, cls in (("wd_bmm_nt", gemm.BmmNtArgs), ("wd_bf16_dot", gemm.Bf16DotArgs), ("wd_amx", gemm.AmxArgs)):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.POINTER(cls)], ctypes.c_int64
    # bfloat16 weights widened by the portable code (the AVX512-BF16 / AMX kernels, built whatever -march says and
    # taken where the CPU has them, round x to bfloat16)
    assert lib.wd_bf16_dot(gemm.Bf16DotArgs(want=0)) == 0 and lib.wd_amx(gemm.AmxArgs(want=0)) == 0
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for M, N, K in ((1, 7, 19), (3, 33, 100), (9, 64, 256)):
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).to(dtype)
            y = torch.empty(M, N)
            assert lib.wd_bmm_nt(gemm.BmmNtArgs(x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), B=1, ldx=K, ldw=K,
                                                ldy=N, M=M, N=N, K=K, wdt=gemm.WDT[dtype], xdt=0)) == 0
            torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), atol=2e-5 * K ** 0.5, rtol=1e-5)


def _zig() -> list[str] | None:
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ziglang", "cc"]


@pytest.mark.skipif(_zig() is None, reason="no cross compiler here (pip install ziglang)")
@pytest.mark.parametrize("cpu", ["generic", "neoverse_v2"])   # any Armv8-A; Grace (SVE2, bf16)
def test_the_sources_build_for_64_bit_arm(tmp_path, cpu):
    out = str(tmp_path / "wideep_cpu_aarch64.so")
    opts = ("-O3", f"-mcpu={cpu}", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")
    build.compile_library([*_zig(), "-target", "aarch64-linux-gnu"], opts, _sources(tmp_path), out)
    with open(out, "rb") as f:
        lib = f.read()
    assert lib[:4] == b"\x7fELF" and int.from_bytes(lib[18:20], "little") == 183   # e_machine: EM_AARCH64
    for entry in (b"wd_bmm_nt", b"wd_experts", b"wd_mla_decode", b"wd_decode_stack"):
        assert entry + b"\0" in lib                                                 # in the dynamic symbol names


def test_a_compiler_error_names_the_compiler_and_says_what_failed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad.c").write_text("int f(void) { return missing; }\n")
    with pytest.raises(build.BuildError, match=r"could not build the bad kernels:(.|\n)*missing"):
        build.compile_library([os.environ.get("CC", "cc")], build.flags("x86-64") if platform.machine() == "x86_64"
                              else ("-O1", "-shared", "-fPIC"), str(src), str(tmp_path / "bad.so"), "bad")
