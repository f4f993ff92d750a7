"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Legend: T tokens, N heads, H hidden, C kv_lora_rank, R rope dim, dn qk_nope_head_dim, dv v_head_dim,
L context length. Two mathematically equal forms, kept side by side:
- naive (prefill): expand the cached latent through kv_b_proj into per-head K/V, then attention;
  cheap when queries are many, since the expansion is shared by all of them.
- absorbed (decode): fold kv_b_proj's K half into the query and its V half into the output, and
  attend directly over the latent [L, C+R]; the per-head K/V of the context are never built.
`backend` "triton" runs the absorbed form of one-token (decode) sequences in the paged Triton kernel
(attention_mla/triton_decode.py), which reads the cache through the block table instead of gathering it;
"cpu" does the same in the backend's kernels (layers/kernels.py mla_decode), with the query absorption
and the output projection as streamed per-head GEMMs over weights laid out once (attend_paged_cpu).
kv_cache_dtype "fp8": the cache holds packed e4m3 rows (attention_mla/fp8_cache.py); write_cache quantises,
cache_rows dequantises for the torch forms, and both paged kernels read the packed rows themselves; "fp4" the
same with packed e2m1 rows (attention_mla/fp4_cache.py; kv_fp8 then holds that layout, of the same fields).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wideep.layers import NATIVE, Kernels, RMSNorm

from .config import MLAConfig
from .fp8_cache import latent_layout
from .meta import AttnMeta
from .rope import RotaryEmbedding

FORMS = ("auto", "naive", "absorbed")   # which form attends: auto = absorbed for one-query sequences
BACKENDS = ("torch", "cpu", "triton")
# Backend "cpu", form "auto": a step of at most this many tokens attends every query on the paged kernel, one kernel
# row a token (prefill chunks, mixed steps, speculative verification): one C call per layer instead of a K/V
# expansion and a few torch calls per sequence, and the same calls the fused CPU step (engine/model/fused_decode.py)
# makes for such a step. Its arithmetic is close to the naive form's at these sizes (DeepSeek-V3's dims, a fresh
# 64-token prompt: ~10 % more; less than naive once a cached context precedes the chunk). = cpu/linear.py MAX_ROWS.
PAGED_STEP_TOKENS = 64


class MLA(nn.Module):
    def __init__(self, cfg: MLAConfig, rope: RotaryEmbedding, device=None, dtype=None, linear=nn.Linear,
                 backend: str = "torch", mode: str = "auto", kv_cache_dtype: str = "auto", kernels: Kernels = NATIVE):
        """linear: the projections' class (nn.Linear's signature; an fp8 one keeps fp8 checkpoints as
        stored). kv_b_proj is always nn.Linear: both forms read its weight directly. backend: "torch" |
        "cpu" | "triton" (decode sequences; resolved by attention_mla/paged_decode.py). mode: one of FORMS
        ("naive" / "absorbed" force one form, for checking them against each other). kv_cache_dtype:
        "auto" (pools of the model dtype [S, C+R]) | "fp8" | "fp4" (packed uint8 pools [S, kv_fp8.row_bytes]).
        kernels: the backend's table (layers/kernels.py): the norms' kernel, and for backend "cpu" its
        paged decode and per-head GEMMs."""
        if backend not in BACKENDS or mode not in FORMS:
            raise ValueError(f"MLA backend must be one of {BACKENDS} and mode one of {FORMS}, got {backend!r}, {mode!r}")
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.mode, self.kernels = mode, kernels
        self.backend = backend
        N, H, C, R = cfg.num_heads, cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        kw = dict(device=device, dtype=dtype)
        self.kv_fp8 = latent_layout(kv_cache_dtype, C, R, dtype or torch.get_default_dtype())
        if cfg.q_lora_rank is None:
            self.q_proj = linear(H, N * cfg.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = linear(H, cfg.q_lora_rank, bias=cfg.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, kernels=kernels, **kw)
            self.q_b_proj = linear(cfg.q_lora_rank, N * cfg.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = linear(H, C + R, bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps, kernels=kernels, **kw)
        self.kv_b_proj = nn.Linear(C, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **kw)
        self.o_proj = linear(N * cfg.v_head_dim, H, bias=cfg.attention_bias, **kw)
        self._w_uk_t, self._w_uk_t_of = None, None   # attend_paged_cpu's W_UK^T and the weight it came from

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        """Binds the paged decode of one-query sequences (at construction; tests switch a built module to
        compare backends). The torch backend never pages."""
        if name == "cpu" and (self.kernels.mla_decode is None or self.kernels.bmm_nt is None):
            raise ValueError(f"MLA backend 'cpu' needs a kernel table with mla_decode and bmm_nt, got "
                             f"{self.kernels.name!r} (layers/kernels.py)")
        self._attend_paged = {"cpu": self.attend_paged_cpu, "triton": self._attend_paged_seqs, "torch": None}[name]
        self._backend = name

    def paged_chunk(self, T: int) -> int:
        """The longest query a sequence may have and still attend on the paged kernel in a step of T tokens
        (AttnMeta.attention_split's chunk): T on the cpu backend when T <= PAGED_STEP_TOKENS (every query of
        the step), else 1 (decodes only)."""
        return T if self._backend == "cpu" and self.mode == "auto" and T <= PAGED_STEP_TOKENS else 1

    # -- projections -------------------------------------------------------------------------
    def q_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the normed q-LoRA latent [T, Q] (DSA's indexer reads it too)."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_lat: torch.Tensor | None = None):
        """x [T, H] -> q_nope [T, N, dn], q_pe [T, N, R] (rotated), latent [T, C+R] (normed c, rotated k_pe).
        q_lat: q_latent(x) when the caller has it already."""
        cfg = self.cfg
        T = x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_latent(x) if q_lat is None else q_lat)
        q = q.view(T, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope.apply(q_pe, cos, sin), self.rope.apply(k_pe, cos, sin)
        return q_nope, q_pe, torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the rows' latents [T, C+R] (normed c, rotated k_pe): what project() caches, without the
        queries (a row whose attention output nobody reads still leaves its latent for the rows after it)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return torch.cat((self.kv_a_layernorm(c), self.rope.apply(k_pe, cos, sin)), dim=-1)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> W_UK [N, dn, C], W_UV [N, dv, C] (views of kv_b_proj.weight)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    # -- the cache -----------------------------------------------------------------------------
    def check_pool(self, kv_pool: torch.Tensor) -> None:
        """kv_pool must be what LatentKVPool makes for this layer's kv_cache_dtype (never misread silently)."""
        fp8 = self.kv_fp8
        width = fp8.row_bytes if fp8 is not None else self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        if kv_pool.dim() != 2 or kv_pool.shape[1] != width or (kv_pool.dtype == torch.uint8) != (fp8 is not None):
            raise ValueError(f"MLA with kv_cache_dtype {fp8.name.split('_')[0] if fp8 else 'auto'} needs a "
                             f"{'uint8' if fp8 else 'floating'} [S, {width}] pool (a LatentKVPool with the same "
                             f"kv_cache_dtype), got {kv_pool.dtype} {tuple(kv_pool.shape)}")

    def write_cache(self, kv_pool: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [T, C+R] into rows slots [T] of kv_pool (quantised when the cache is fp8 / fp4)."""
        if self.kv_fp8 is None:
            kv_pool.index_copy_(0, slots, latent.to(kv_pool.dtype))
        else:
            self.kv_fp8.write(kv_pool, slots, latent)

    def write_entries(self, kv_pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
        """x [T, H] (the attention's input) -> every cache entry of its rows at slots [T], no queries or attention
        (rows whose output nobody reads: an MTP layer's, whose entries the rows after them attend to)."""
        self.write_cache(kv_pool, slots, self.latent(x, cos, sin))

    def cache_rows(self, kv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The latents at slots [...] -> [..., C+R] in the model dtype (dequantised when the cache is fp8 / fp4)."""
        rows = kv_pool[slots]
        return rows if self.kv_fp8 is None else self.kv_fp8.dequantize(rows, self.kv_b_proj.weight.dtype)

    # -- the two attention forms -------------------------------------------------------------
    def attend_naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence. q_nope [Tq, N, dn], q_pe [Tq, N, R]: its last Tq positions; ctx [L, C+R]
        -> [Tq, N, dv]. Causal: query t sees keys 0 .. L-Tq+t, or where mask [Tq, L] (bool) is True."""
        cfg = self.cfg
        Tq, L = q_nope.shape[0], ctx.shape[0]
        c, k_pe = ctx.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = (self.kernels.matmul or F.linear)(c, self.kv_b_proj.weight).view(L, cfg.num_heads, -1)   # per sequence:
        # the backend's GEMM (the CPU's C kernel takes these row counts without a per-shape compile)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(L, cfg.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if mask is None and (Tq > 1 or L > Tq):
            mask = torch.ones(Tq, L, dtype=torch.bool, device=q.device).tril(L - Tq)
        dv = v.shape[-1]
        if q.device.type == "cpu" and dv < q.shape[-1]:   # torch's CPU flash kernel wants v as wide as q and k:
            v = F.pad(v, (0, q.shape[-1] - dv))          # zeros, sliced off (4-5x its math path at 128-512 tokens)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))   # [1, N, *, D]: 4-D, as the flash kernel takes
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.softmax_scale)
        return out[0].transpose(0, 1)[..., :dv]

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor,
                        key_limit: torch.Tensor) -> torch.Tensor:
        """Any tokens. q_nope [T, N, dn], q_pe [T, N, R], ctx [T, L, C+R] (each token's sequence
        context, padded), key_limit [T]: token t sees keys j < key_limit[t] -> [T, N, dv]."""
        w_uk, w_uv = self._kv_b()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)   # [T, N, C]
        q = torch.cat((q_lat, q_pe), dim=-1)                               # [T, N, C+R]
        scores = torch.bmm(q, ctx.transpose(1, 2)).float() * self.cfg.softmax_scale  # [T, N, L]
        keys = torch.arange(ctx.shape[1], device=ctx.device)
        scores.masked_fill_((keys[None, :] >= key_limit[:, None])[:, None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(ctx.dtype)
        out_lat = torch.bmm(p, ctx[..., :self.cfg.kv_lora_rank])          # [T, N, C]
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, N, dv]

    def attend_paged(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: torch.Tensor, meta: AttnMeta,
                     seqs: list[int]) -> torch.Tensor:
        """The query tokens of sequences `seqs` (in query_rows order; one each on the triton backend, any
        number within paged_chunk on the cpu one): q_nope [B, N, dn], q_pe [B, N, R] -> [B, N, dv], each
        attending over its sequence's paged cache up to its own position, in the backend's kernel (bound at
        construction)."""
        return self._attend_paged(q_nope, q_pe, kv_pool, meta, seqs)

    def _attend_paged_seqs(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: torch.Tensor, meta: AttnMeta,
                           seqs: list[int]) -> torch.Tensor:
        table, lens, max_len = meta.seq_tables(seqs)
        return self.attend_paged_triton(q_nope, q_pe, kv_pool, table, lens, meta.block_size, max_len)

    def attend_paged_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: torch.Tensor,
                            table: torch.Tensor, lens: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
        """The absorbed form in the Triton kernel: q_nope [B, N, dn], q_pe [B, N, R], table [B, M] blocks of
        block_size slots, lens [B] int32 (<= max_len, a host int) -> [B, N, dv]. SparseMLA passes its
        selected slots as one-slot blocks."""
        from .triton_decode import mla_decode
        w_uk, w_uv = self._kv_b()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)   # [B, N, C]
        q = torch.cat((q_lat, q_pe), dim=-1).to(self.cache_dtype(kv_pool))   # [B, N, C+R]
        out_lat = mla_decode(q, kv_pool, table, lens, block_size, self.cfg.kv_lora_rank,
                             self.cfg.softmax_scale, max_len, fp8=self.kv_fp8).to(q_nope.dtype)  # [B, N, C]
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def cache_dtype(self, kv_pool: torch.Tensor) -> torch.dtype:
        """The dtype a paged kernel's query takes: the pool's, or the RoPE part's for a packed fp8 / fp4 pool."""
        return kv_pool.dtype if self.kv_fp8 is None else self.kv_fp8.rope_dtype

    # -- CPU decode (backend "cpu") -----------------------------------------------------------
    def w_uk_t(self) -> torch.Tensor:
        """W_UK^T [N, C, dn], contiguous: the layout the streamed GEMM wants for absorbing q_nope. Made
        once from kv_b_proj.weight (again only if that weight is replaced or written to)."""
        w = self.kv_b_proj.weight
        of = (w.data_ptr(), w._version)
        if self._w_uk_t_of != of:
            self._w_uk_t = self._kv_b()[0].transpose(1, 2).contiguous()
            self._w_uk_t_of = of
        return self._w_uk_t

    def attend_paged_cpu(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: torch.Tensor, meta: AttnMeta,
                         seqs: list[int]) -> torch.Tensor:
        """attend_paged in the C kernels, one kernel row a query token (meta.token_tables): q_nope [B, N, dn],
        q_pe [B, N, R] -> [B, N, dv]. The absorbed
        query is written in place ([B, N, C+R], no concatenation), and every weight is read as stored."""
        bmm_nt, mla_decode = self.kernels.bmm_nt, self.kernels.mla_decode
        cfg = self.cfg
        B, N, C = q_nope.shape[0], cfg.num_heads, cfg.kv_lora_rank
        q = q_nope.new_empty(B, N, C + cfg.qk_rope_head_dim)
        bmm_nt(q_nope.transpose(0, 1), self.w_uk_t(), out=q[:, :, :C].transpose(0, 1))       # [N, B, C]
        q[:, :, C:] = q_pe
        table, lens, max_len = meta.token_tables(seqs)
        out_lat = mla_decode(q, kv_pool, table, lens, meta.block_size, C, cfg.softmax_scale, max_len, self.kv_fp8)
        out = q_nope.new_empty(B, N, cfg.v_head_dim)
        bmm_nt(out_lat.transpose(0, 1), self._kv_b()[1], out=out.transpose(0, 1))           # [N, B, dv]
        return out

    # -- step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttnMeta, kv_pool: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H], kv_pool [S, C+R] (this layer), cos/sin [T, R/2] -> [T, H]."""
        cfg = self.cfg
        T = x.shape[0]
        if T == 0:
            return self.o_proj(x.new_zeros(0, cfg.num_heads * cfg.v_head_dim))
        self.check_pool(kv_pool)
        q_nope, q_pe, latent = self.project(x, cos, sin)
        self.write_cache(kv_pool, meta.slot_mapping, latent)
        out = x.new_empty(T, cfg.num_heads, cfg.v_head_dim)
        paged, absorbed, naive = meta.attention_split(self.mode, self.backend != "torch", self.paged_chunk(T))
        if not absorbed and not naive:   # every token on the paged kernel: no gather, no scatter
            out = self.attend_paged(q_nope, q_pe, kv_pool, meta, paged)
        elif paged:
            rows = meta.query_rows(paged, x.device)
            out[rows] = self.attend_paged(q_nope[rows], q_pe[rows], kv_pool, meta, paged)
        if absorbed:
            rows, slots = meta.query_context_slots(absorbed, x.device)           # [T'], [T', L]
            ctx = self.cache_rows(kv_pool, slots)                                 # [T', L, C+R]
            out[rows] = self.attend_absorbed(q_nope[rows], q_pe[rows], ctx, meta.positions[rows] + 1)
        for b in naive:
            s, q = meta.query_starts[b], meta.query_lens[b]
            slots, _ = meta.context_slots([b])
            ctx = self.cache_rows(kv_pool, slots[0])
            out[s:s + q] = self.attend_naive(q_nope[s:s + q], q_pe[s:s + q], ctx)
        return self.o_proj(out.reshape(T, -1))
