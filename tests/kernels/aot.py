"""Compile Triton kernels for a GPU that is not here (sm_90 = H100/H200) and read their resource use.

Triton's wheel ships ptxas and cuobjdump, so TTIR -> TTGIR -> PTX -> cubin needs no GPU. Arguments
are specialised as the JIT does at launch: pointers 16-byte aligned, ints divisible by 16 marked so,
ints equal to 1 folded to constants. Without that the pipeliner would not run, so the resource figures
would not be those of a real launch.

    python -m tests.kernels.aot        # the production configs of every kernel, one JSON line each
(In a process where TRITON_INTERPRET=1 the kernels are interpreted objects: run it in a clean one.)
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile

SMEM_LIMIT_SM90 = 232448  # bytes of shared memory a block may use on H100/H200 (227 KiB)


def tools_dir() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return d if os.path.isfile(os.path.join(d, "cuobjdump")) else None


def compile_sm(fn, args: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """fn: a @triton.jit kernel; args: every non-constexpr parameter -> a pointer type string ("*bf16")
    or a representative value (int / float); constexprs: the rest. -> regs, spill_bytes, smem, wgmma,
    async_copies (pipelined loads in the TTGIR)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(inspect.signature(fn.fn).parameters)
    sig, attrs, consts = {}, {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n], consts[(i,)] = "constexpr", constexprs[n]
            continue
        v = args[n]
        if isinstance(v, str):
            sig[n], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        elif v == 1:
            sig[n], consts[(i,)] = "constexpr", 1
        else:
            sig[n] = "i32" if abs(v) < 2 ** 31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        usage = subprocess.run([os.path.join(tools_dir(), "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ttgir = k.asm["ttgir"]
    return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spill_bytes": sum(int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("STACK", "LOCAL")),
            "smem": int(k.metadata.shared), "wgmma": "warp_group_dot" in ttgir,
            "async_copies": ttgir.count("async_copy_global_to_local")}


def production_configs():
    """(name, kernel, args, constexprs, num_warps, num_stages) at DeepSeek-V3 shapes, for every tile
    configuration the launchers pick on a GPU."""
    from wideep.attention_mla import triton_decode as td
    from wideep.moe import triton_linear as tlin
    from wideep.moe import triton_moe as tm
    from wideep.moe import triton_quant as tq
    from wideep.moe.tiles import _TABLE
    H, I, P = 7168, 2048, 4096 * 8
    for bound, t in _TABLE:
        for fp8 in (False, True):
            w = "*fp8e4nv" if fp8 else "*bf16"
            c = dict(FP8=fp8, QN=128, QK=128, PREC=None, UPCAST=False, BM=t.block_m, BK=t.block_k, GROUP_M=t.group_m)
            tag = f"{'fp8' if fp8 else 'bf16'} tiles<={bound}"
            yield (f"gate_up {tag}", tm._gate_up_kernel,
                   dict(x_ptr="*bf16", w_ptr=w, s_ptr="*fp32", act_ptr="*bf16", sorted_ptr="*i32", bexp_ptr="*i32",
                        npad_ptr="*i32", num_pairs=P, top_k=8, Mmax=40000, I=I, K=H, up_scale_row=16, stride_xm=H,
                        stride_we=2 * I * H, stride_wn=H, stride_se=32 * 56, stride_sn=56, stride_am=I),
                   dict(c, BN=max(16, t.block_n // 2)), t.num_warps, t.num_stages)
            yield (f"down {tag}", tm._down_kernel,
                   dict(a_ptr="*bf16", w_ptr=w, s_ptr="*fp32", y_ptr="*bf16", tw_ptr="*fp32", sorted_ptr="*i32",
                        bexp_ptr="*i32", npad_ptr="*i32", num_pairs=P, Mmax=40000, N=H, K=I, stride_am=I,
                        stride_we=H * I, stride_wn=I, stride_se=56 * 16, stride_sn=16, stride_ym=H),
                   dict(c, BN=t.block_n), t.num_warps, t.num_stages)
        yield (f"fp8_linear tiles<={bound}", tlin._fp8_linear_kernel,
               dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", M=4096, N=1536, K=H, stride_xm=H,
                    stride_wn=H, stride_sn=56, stride_ym=1536),
               dict(QN=128, QK=128, PREC=None, UPCAST=False, BM=t.block_m, BN=t.block_n, BK=t.block_k,
                    GROUP_M=t.group_m), t.num_warps, t.num_stages)
    yield ("moe_sum", tm._sum_kernel, dict(y_ptr="*bf16", ids_ptr="*i32", out_ptr="*bf16", H=H),
           dict(TOP_K=8, BH=1024), 4, 1)
    yield ("group_quant", tq._group_quant_kernel,
           dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K=H, G=56, stride_xm=H, stride_qm=H, stride_sm=56,
                stride_sg=1), dict(GROUP=128, BLOCK=128, FMAX=448.0, PREROUND=False), 4, 1)
    t = td.DecodeTiles()
    # a bf16 cache [S, 576]; an fp8 one, packed rows of 656 bytes (fp8_cache.py); an fp4 one, 420 (fp4_cache.py)
    rows = {"": (576, 0, 0, 0, 0), " fp8": (656, 512, 528, 0, 128), " fp4": (420, 256, 292, 288, 16)}
    for kind, (width, scale_off, rope_off, tok_off, group) in rows.items():
        yield ("mla_decode_split" + kind, td._decode_split_kernel,
               dict(q_ptr="*bf16", kv_ptr="*u8" if kind else "*bf16", bt_ptr="*i32", lens_ptr="*i32", part_ptr="*fp32",
                    lse_ptr="*fp32", N=128, C=512, R=64, block_size=64, qk_scale=0.1, stride_qb=128 * 576,
                    stride_qh=576, stride_kv=width, stride_bt=64, stride_pb=128 * 4 * 512,
                    stride_ph=4 * 512, stride_ps=512, stride_lb=512, stride_lh=4, scale_off=scale_off,
                    rope_off=rope_off, tok_off=tok_off),
               dict(BH=t.block_h, BN=t.block_n, BC=512, BR=64, PREC=None, UPCAST=False, FP8=kind == " fp8",
                    GROUP=group, FP4=kind == " fp4"),
               t.num_warps, t.num_stages)
    yield ("mla_decode_reduce", td._decode_reduce_kernel,
           dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", C=512, num_splits=4, stride_pb=128 * 4 * 512,
                stride_ph=4 * 512, stride_ps=512, stride_lb=512, stride_lh=4, stride_ob=128 * 512, stride_oh=512),
           dict(BC=512), 4, 1)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for name, fn, args, const, warps, stages in production_configs():
        r = compile_sm(fn, args, const, warps, stages)
        print(json.dumps(dict(kernel=name, warps=warps, stages=stages, block_m=const.get("BM"), **r)), flush=True)


if __name__ == "__main__":
    main()
