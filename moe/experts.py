"""Routed experts held by one rank, as stacked weights, with two interchangeable forwards.

Legend: R rows (tokens received by this rank), H hidden, I moe_intermediate_size,
El local experts, k top-k. Expert ids here are *local* (0 .. El-1); -1 marks a (row, k) slot
whose expert lives on another rank (the dispatcher's convention, as DeepEP's).
w13 [El, 2I, H]: gate_proj rows then up_proj rows; w2 [El, H, I].
Every forward returns sum over the row's local slots of weight * expert(x): [R, H].
Forwards (`backend`, bound at construction): "reference" (for-loop), "grouped" (torch, sorted
segments), "cpu" (the backend table's experts kernel, layers/kernels.py, up to a few hundred rows per
expert, grouped beyond), "triton" (moe/triton_moe.py), "deepgemm" (moe/deepgemm.py, fp8 weights only).
With `fp8_block` the weights stay float8_e4m3fn as the checkpoint stores them, with fp32 block
scales w13_scale_inv [El, 2*ceil(I/br), ceil(H/bc)] (gate's rows, then up's) and
w2_scale_inv [El, ceil(H/br), ceil(I/bc)]; the torch forwards dequantise per call (slow, for
checking), the kernels apply the scales per tile.
With `fp4` (DeepSeek-V4's routed experts as stored, moe/fp4.py) the weights are uint8 e2m1 pairs, w13 [El, 2I,
H/2], w2 [El, H, I/2], with e8m0 scale bytes w13_scale_inv [El, 2I, H/32], w2_scale_inv [El, H, I/32] (H and I
multiples of 32); the "cpu" kernel reads them in place, the torch forwards dequantise per call (slow, for
checking and big batches).
`limit` (DeepSeek-V4's clamped SwiGLU: gate <= limit, |up| <= limit) runs on the torch forwards and "cpu".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wideep.layers import NATIVE, Kernels

from .fp4 import FP4_BLOCK, dequantize_fp4
from .fp8 import FP8_DTYPE, dequantize_experts_fp8

BACKENDS = ("reference", "grouped", "cpu", "triton", "deepgemm")


class Experts(nn.Module):
    PAD_LIMIT = 16  # max tokens per expert for the padded batched-GEMM path
    CPU_MAX_ROWS = 256  # "cpu" with a kernel table that does not say (experts_max_rows): mean rows per local expert
                        # up to which the kernel runs (then BLAS)

    def __init__(self, num_local: int, hidden: int, intermediate: int, device=None, dtype=None,
                 fp8_block: tuple[int, int] | None = None, backend: str = "grouped", deepgemm=None,
                 kernels: Kernels = NATIVE, limit: float | None = None, fp4: bool = False):
        """backend: one of BACKENDS (moe/backend.py resolves the user's choice); deepgemm: the probed
        moe.deepgemm.DeepGemmApi when backend is "deepgemm"; kernels: the backend's table (its experts
        kernel for "cpu"); fp4: the weights as FP4 pairs + e8m0 scales (module doc)."""
        if backend not in BACKENDS:
            raise ValueError(f"experts backend {backend!r} is not one of {BACKENDS}")
        if fp4 and fp8_block is not None:
            raise ValueError("experts: fp4 and fp8_block are two storage formats; give one")
        if fp4 and (hidden % FP4_BLOCK or intermediate % FP4_BLOCK):
            raise ValueError(f"fp4 experts need hidden ({hidden}) and intermediate ({intermediate}) to be multiples "
                             f"of {FP4_BLOCK} (one e8m0 scale per {FP4_BLOCK} values along K)")
        super().__init__()
        self.num_local, self.hidden, self.intermediate = num_local, hidden, intermediate
        self.fp8_block = tuple(fp8_block) if fp8_block is not None else None
        self.fp4 = fp4
        wdt = FP8_DTYPE if fp8_block is not None else torch.uint8 if fp4 else dtype
        kw = dict(requires_grad=fp8_block is None and not fp4)  # fp8 / integer tensors cannot require grad
        pk = 2 if fp4 else 1   # values per stored element along K
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden // pk, device=device, dtype=wdt),
                                **kw)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, intermediate // pk, device=device, dtype=wdt), **kw)
        if fp4:   # e8m0 bytes; Parameters so that EPLB's moves and copy_local_replicas carry them with the weights
            u8 = dict(device=device, dtype=torch.uint8)
            self.w13_scale_inv = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden // FP4_BLOCK, **u8),
                                              requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(num_local, hidden, intermediate // FP4_BLOCK, **u8),
                                             requires_grad=False)
        if fp8_block is not None:
            br, bc = fp8_block
            f32 = dict(device=device, dtype=torch.float32)
            self.w13_scale_inv = nn.Parameter(torch.empty(num_local, 2 * -(-intermediate // br), -(-hidden // bc),
                                                          **f32), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(num_local, -(-hidden // br), -(-intermediate // bc), **f32),
                                             requires_grad=False)
        self.deepgemm, self.kernels, self.limit = deepgemm, kernels, limit
        self.backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        """Binds the forward (at construction; tests switch a built module to compare forwards)."""
        if self.limit is not None and name not in ("reference", "grouped", "cpu"):
            raise ValueError(f"experts backend {name!r} has no clamped SwiGLU (swiglu_limit {self.limit}): "
                             f"use 'reference', 'grouped' (torch) or 'cpu'")
        if self.fp4 and name not in ("reference", "grouped", "cpu"):
            raise ValueError(f"experts backend {name!r} does not read fp4 weights: use 'cpu' (or the torch forwards)")
        if name == "cpu" and self.kernels.experts is None:
            raise ValueError("experts backend 'cpu' needs a kernel table with an experts kernel (layers/kernels.py)")
        self._forward = {"reference": self.forward_reference, "grouped": self.forward_grouped, "cpu": self.forward_cpu,
                         "triton": self.forward_triton, "deepgemm": self.forward_deepgemm}[name]
        self._backend = name

    def empty_like(self, num_local: int) -> "Experts":
        """Experts of this storage format, forward and clamp with num_local slots, their weights uninitialised (a
        re-layout fills them)."""
        fp8 = self.fp8_block is not None
        return Experts(num_local, self.hidden, self.intermediate, device=self.w13.device,
                       dtype=None if fp8 or self.fp4 else self.w13.dtype, fp8_block=self.fp8_block,
                       backend=self.backend, deepgemm=self.deepgemm, kernels=self.kernels, limit=self.limit,
                       fp4=self.fp4).requires_grad_(False)

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in `dtype`: the parameters themselves, or a dequantised copy of fp8 / fp4 ones."""
        if self.fp4:
            El, H, I = self.num_local, self.hidden, self.intermediate
            return (dequantize_fp4(self.w13.reshape(El * 2 * I, H // 2), self.w13_scale_inv.reshape(El * 2 * I, -1),
                                   dtype).view(El, 2 * I, H),
                    dequantize_fp4(self.w2.reshape(El * H, I // 2), self.w2_scale_inv.reshape(El * H, -1),
                                   dtype).view(El, H, I))
        if self.fp8_block is None:   # (a copy when the weights are another dtype: a bfloat16 MTP drafter's)
            return self.w13.to(dtype), self.w2.to(dtype)
        return dequantize_experts_fp8(self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv,
                                      self.fp8_block, dtype)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return F.silu(gate) * up

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """For-loop over experts and their (row, slot) hits; the readable baseline."""
        w13, w2 = self.dense_weights(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            rows, slots = torch.where(topk_ids == e)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
            y = F.linear(self._act(gate, up), w2[e]) * topk_weights[rows, slots, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sort (row, slot) pairs by expert once, run each expert on its contiguous segment,
        scatter-add back: one gather, one pass over the experts, one scatter.

        Few pairs per expert (decode): the segments are padded into [El, max_count, H] and run as
        two batched GEMMs, since then reading the expert weights is the cost and one bmm streams
        them at memory speed where a per-expert loop pays a dispatch per expert. Many pairs
        (prefill): a per-expert GEMM on each segment, no padding waste."""
        w13, w2 = self.dense_weights(x.dtype)
        flat_ids = topk_ids.reshape(-1)                                        # [R*k]
        valid = (flat_ids >= 0).nonzero().squeeze(1)
        order = valid[flat_ids[valid].argsort(stable=True)]                    # pair index, by expert
        sorted_ids = flat_ids[order]
        counts = torch.bincount(sorted_ids, minlength=self.num_local)
        rows = order // topk_ids.shape[1]
        xs = x[rows]                                                           # [M, H]
        counts_host = counts.tolist()  # SYNC: segment bounds drive the GEMM shapes
        max_count = max(counts_host) if counts_host else 0
        if 0 < max_count <= self.PAD_LIMIT:
            starts = torch.cumsum(counts, 0) - counts
            within = torch.arange(len(order), device=x.device) - starts[sorted_ids]
            padded = x.new_zeros(self.num_local, max_count, self.hidden)
            padded[sorted_ids, within] = xs
            gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
            ys = torch.bmm(self._act(gate, up), w2.transpose(1, 2))[sorted_ids, within]   # [M, H]
        else:
            # the table's matmul where it has one (the CPU's: its GEMM at the rows it wins, bfloat16 on float32
            # copies where this CPU measured torch's bfloat16 GEMM slower, cpu/tune.py), else torch's
            ys = torch.empty_like(xs)
            mm = self.kernels.matmul if x.device.type == "cpu" and self.kernels.matmul is not None else None
            start = 0
            for e, n in enumerate(counts_host):
                if n:
                    if mm is None:
                        gate, up = F.linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
                        torch.mm(self._act(gate, up), w2[e].t(), out=ys[start:start + n])
                    else:
                        gate, up = mm(xs[start:start + n], w13[e]).chunk(2, dim=-1)
                        ys[start:start + n] = mm(self._act(gate, up), w2[e])
                    start += n
        ys *= topk_weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        return self._forward(x, topk_ids, topk_weights)

    def forward_cpu(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The backend's kernel (the CPU one: cpu/gemm.py): only the experts that have tokens are read, each weight row once, with gate-up,
        SiLU·mul, down and the weighted sum fused (no padded copies, no transposed views); fp8 weights read as
        stored (one byte each) with their block scales. Faster than
        forward_grouped's BLAS GEMMs up to the rows per expert the table's experts_max_rows gives for these dtypes
        (cpu/linear.py: a few hundred in float32, prefill chunks included; 16 in bfloat16 where the CPU has bf16
        dot products, every batch on AMX tiles); beyond, forward_grouped."""
        ask = self.kernels.experts_max_rows
        limit = ask(self.w13.dtype, x.dtype) if ask is not None else self.CPU_MAX_ROWS
        if limit is not None and x.shape[0] * topk_ids.shape[1] > limit * self.num_local:
            return self.forward_grouped(x, topk_ids, topk_weights)
        if self.fp8_block is not None:   # read as stored, the block scales applied per tile
            return self.kernels.experts(x, self.w13, self.w2, topk_ids, topk_weights, w13_scale=self.w13_scale_inv,
                                        w2_scale=self.w2_scale_inv, block=self.fp8_block, limit=self.limit)
        if self.fp4:   # read as stored: half a byte a weight, its e8m0 scale per 32
            return self.kernels.experts(x, self.w13, self.w2, topk_ids, topk_weights, w13_scale=self.w13_scale_inv,
                                        w2_scale=self.w2_scale_inv, limit=self.limit)
        return self.kernels.experts(x, self.w13, self.w2, topk_ids, topk_weights, limit=self.limit)

    def forward_triton(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Fused Triton kernels (moe/triton_moe.py); fp8 weights are dequantised per tile in-kernel."""
        from .triton_moe import fused_moe
        fp8 = self.fp8_block is not None
        return fused_moe(x.contiguous(), self.w13, self.w2, topk_ids, topk_weights,
                         w13_scale=self.w13_scale_inv if fp8 else None, w2_scale=self.w2_scale_inv if fp8 else None,
                         quant_block=self.fp8_block or (128, 128))

    def forward_deepgemm(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """DeepGEMM grouped FP8 GEMMs (moe/deepgemm.py): masked layout for decode, contiguous for prefill."""
        from .deepgemm import experts_forward
        if self.fp8_block is None or self.deepgemm is None:
            raise RuntimeError("the deepgemm experts backend needs fp8 weights and a probed deep_gemm API")
        return experts_forward(self.deepgemm, x, (self.w13, self.w13_scale_inv), (self.w2, self.w2_scale_inv),
                               topk_ids, topk_weights)
