"""Random-weight checkpoints of PUBLISHED shapes (launch/tiny/published.py), truncated to N layers, written as the
model repos are: `model-0000k-of-0000n.safetensors` shards + `model.safetensors.index.json`, config.json,
generation_config.json and make-tiny's byte tokenizer.

Tensor names and dtypes as published: DeepSeek-V3 FP8 e4m3 linears (launch/tiny/checkpoint.py `_is_quantised`) with
float32 128x128 `weight_scale_inv`, bf16 elsewhere (its e_score_correction_bias float32); DeepSeek-V2-Lite bf16;
DeepSeek-V4-Flash in DeepSeek's own names (`layers.3.attn.wq_a.weight`, block scales `X.scale`): FP8 e4m3 attention
and shared-expert linears with e8m0 128x128 scales, FP4 routed experts (int8 pairs [rows, cols/2], e8m0 scale per
1x32), the hyper-connections, sinks, compressor position biases and gate biases float32, the rest bf16.

Memory: each shard's header is computed from the plan, then every tensor is generated in chunks of CHUNK bytes and
written straight to the file, so nothing bigger than a chunk is held. Values come from raw random bits masked into a
valid range (much faster than sampling floats): bf16 weights |w| in [2^-9, 2^-5), fp8 codes |q| <= 1.875 (no NaN),
any FP4 byte. Each tensor's generator is seeded by (seed, name): the same seed gives the same bytes for a tensor at
any --layers.
Legend: V vocab, H hidden, N heads, D V4 head_dim, Q q_lora_rank, G/R o_groups/o_lora_rank, n hc_mult,
NI/DI indexer heads/head dim, m compress ratio, E experts, Im moe_intermediate.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .checkpoint import _is_quantised, _write_json, _write_tokenizer, checkpoint_shapes
from .published import truncated_config

CHUNK = 32 << 20
DEFAULT_SHARD_BYTES = 5_000_000_000   # transformers' default max_shard_size "5GB", as the repos were saved
ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
            torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.int64: "I64"}


@dataclass(frozen=True)
class Spec:
    """One stored tensor: fill is how its values are drawn (see _chunks)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str   # weight | norm | gate | fp8 | fp8_scale | e8m0_fp8 | fp4 | e8m0_fp4 | small | tid2eid
    experts: int = 0   # tid2eid: ids drawn from [0, experts)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _blocks(rows: int, cols: int, b: int = 128) -> tuple[int, int]:
    return -(-rows // b), -(-cols // b)


def mla_specs(c: dict[str, Any]) -> list[Spec]:
    """V2 / V3: HF names (launch/tiny/checkpoint.py checkpoint_shapes), FP8 where the config has quantization_config."""
    fp8 = "quantization_config" in c
    out = []
    for name, shape in checkpoint_shapes({"num_nextn_predict_layers": 0, **c}).items():
        if fp8 and _is_quantised(name):
            out += [Spec(name, shape, torch.float8_e4m3fn, "fp8"),
                    Spec(name + "_scale_inv", _blocks(*shape), torch.float32, "fp8_scale")]
        elif name.endswith("e_score_correction_bias"):
            out.append(Spec(name, shape, torch.float32, "small"))
        else:
            fill = "norm" if name.endswith("norm.weight") else "gate" if name.endswith("mlp.gate.weight") else "weight"
            out.append(Spec(name, shape, torch.bfloat16, fill))
    return out


def v4_specs(c: dict[str, Any]) -> list[Spec]:
    """DeepSeek-V4 in DeepSeek's names, its routed experts FP4 and attention / shared-expert linears FP8."""
    V, H, N, D = c["vocab_size"], c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    Q, G, R, n = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"], c["hc_mult"]
    NI, DI, E, Im = c["index_n_heads"], c["index_head_dim"], c["n_routed_experts"], c["moe_intermediate_size"]
    out: list[Spec] = []

    def bf16(name, *shape, fill="weight"):
        out.append(Spec(name, shape, torch.bfloat16, fill))

    def f32(name, *shape):
        out.append(Spec(name, shape, torch.float32, "small"))

    def fp8(name, rows, cols):   # name without ".weight"
        out.extend([Spec(name + ".weight", (rows, cols), torch.float8_e4m3fn, "fp8"),
                    Spec(name + ".scale", _blocks(rows, cols), torch.float8_e8m0fnu, "e8m0_fp8")])

    def fp4(name, rows, cols):
        out.extend([Spec(name + ".weight", (rows, cols // 2), torch.int8, "fp4"),
                    Spec(name + ".scale", (rows, cols // 32), torch.float8_e8m0fnu, "e8m0_fp4")])

    def compressor(p, m, d):     # CSA (m = 4) overlaps two windows: 2d wide
        w = 2 * d if m == 4 else d
        f32(p + "ape", m, w)
        bf16(p + "norm.weight", d, fill="norm")
        bf16(p + "wgate.weight", w, H)
        bf16(p + "wkv.weight", w, H)

    bf16("embed.weight", V, H)
    for i, m in enumerate(c["compress_ratios"][:c["num_hidden_layers"]]):
        p = f"layers.{i}."
        bf16(p + "attn_norm.weight", H, fill="norm")
        f32(p + "attn.attn_sink", N)
        fp8(p + "attn.wq_a", Q, H)
        bf16(p + "attn.q_norm.weight", Q, fill="norm")
        fp8(p + "attn.wq_b", N * D, Q)
        fp8(p + "attn.wkv", D, H)
        bf16(p + "attn.kv_norm.weight", D, fill="norm")
        fp8(p + "attn.wo_a", G * R, N * D // G)
        fp8(p + "attn.wo_b", H, G * R)
        if m:
            compressor(p + "attn.compressor.", m, D)
        if m == 4:   # CSA's lightning indexer
            bf16(p + "attn.indexer.wq_b.weight", NI * DI, Q)
            bf16(p + "attn.indexer.weights_proj.weight", NI, H)
            compressor(p + "attn.indexer.compressor.", m, DI)
        bf16(p + "ffn_norm.weight", H, fill="norm")
        bf16(p + "ffn.gate.weight", E, H, fill="gate")
        if i < c["num_hash_layers"]:
            out.append(Spec(p + "ffn.gate.tid2eid", (V, c["num_experts_per_tok"]), torch.int64, "tid2eid", E))
        else:
            f32(p + "ffn.gate.bias", E)
        for e in range(E):
            fp4(p + f"ffn.experts.{e}.w1", Im, H)
            fp4(p + f"ffn.experts.{e}.w2", H, Im)
            fp4(p + f"ffn.experts.{e}.w3", Im, H)
        fp8(p + "ffn.shared_experts.w1", Im, H)
        fp8(p + "ffn.shared_experts.w2", H, Im)
        fp8(p + "ffn.shared_experts.w3", Im, H)
        for hc in ("hc_attn_", "hc_ffn_"):
            f32(p + hc + "fn", (2 + n) * n, n * H)
            f32(p + hc + "base", (2 + n) * n)
            f32(p + hc + "scale", 3)
    bf16("norm.weight", H, fill="norm")
    f32("hc_head_fn", n, n * H)
    f32("hc_head_base", n)
    f32("hc_head_scale", 1)
    bf16("head.weight", V, H)
    return out


def tensor_specs(c: dict[str, Any]) -> list[Spec]:
    return v4_specs(c) if c["model_type"] == "deepseek_v4" else mla_specs(c)


def shard_plan(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """Tensors in order into shards of at most shard_bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _generator(seed: int, name: str) -> torch.Generator:
    # torch's CPU generator keeps 32 bits of a seed: fold seed and name into those
    return torch.Generator().manual_seed(zlib.crc32(name.encode(), zlib.crc32(str(seed).encode())))


def _bits(count: int, g: torch.Generator) -> torch.Tensor:
    """count random bytes (uint8), drawn 8 at a time."""
    return torch.empty(-(-count // 8), dtype=torch.int64).random_(-2 ** 63, 2 ** 63 - 1, generator=g).view(torch.uint8)[:count]


def _chunks(s: Spec, seed: int) -> Iterator[torch.Tensor]:
    """The tensor's bytes, CHUNK at a time (uint8)."""
    g = _generator(seed, s.name)
    if s.fill in ("small", "fp8_scale", "tid2eid"):   # small tensors: drawn whole, as floats
        if s.fill == "tid2eid":   # k distinct experts per token id
            t = torch.rand(s.shape[0], s.experts, generator=g).topk(s.shape[1], -1).indices
        elif s.fill == "fp8_scale":
            t = 0.01 + 0.02 * torch.rand(s.shape, generator=g)
        elif s.name.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
            t = 1.0 + 0.3 * torch.randn(s.shape, generator=g)
        elif s.name.endswith(("attn_sink", "_base", ".ape")):
            t = 0.5 * torch.randn(s.shape, generator=g)
        else:   # gate biases, hyper-connection projections
            t = 0.05 * torch.randn(s.shape, generator=g)
        yield t.to(s.dtype).contiguous().view(torch.uint8).flatten()
        return
    left = s.nbytes
    while left:
        b = _bits(min(CHUNK, left), g)
        if s.fill in ("weight", "gate", "norm"):   # bf16 from its bits: sign, 2 exponent bits, mantissa random
            h = b.view(torch.int16)
            if s.fill == "norm":
                h = (h & 0x003F) + 0x3F80                 # [1, 1.5)
            else:
                h = (h & -0x7E01) + (0x3C80 if s.fill == "gate" else 0x3B00)  # |w| in [2^-6, 2^-2) / [2^-9, 2^-5)
            b = h.view(torch.uint8)
        elif s.fill == "fp8":
            b = b & 0xBF                                  # exponent <= 7: |q| <= 1.875, never NaN
        elif s.fill in ("e8m0_fp8", "e8m0_fp4"):
            b = (b & 1) + (120 if s.fill == "e8m0_fp8" else 118)   # 2^-7..2^-6 / 2^-9..2^-8
        yield b
        left -= len(b)


def write_shard(path: str, specs: list[Spec], seed: int) -> int:
    """Write one safetensors file tensor by tensor; returns its bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        header[s.name] = {"dtype": ST_DTYPE[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for s in specs:
            for chunk in _chunks(s, seed):
                f.write(chunk.numpy().data)
    return off


@dataclass(frozen=True)
class ShapedPlan:
    config: dict[str, Any]
    shards: list[list[Spec]]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for shard in self.shards for s in shard)

    def weight_map(self) -> dict[str, str]:
        n = len(self.shards)
        return {s.name: shard_name(k, n) for k, shard in enumerate(self.shards) for s in shard}


def plan_shaped(like: str, layers: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> ShapedPlan:
    if shard_bytes < 1:
        raise ValueError(f"shard size must be >= 1 byte, got {shard_bytes}")
    c = truncated_config(like, layers)
    return ShapedPlan(c, shard_plan(tensor_specs(c), shard_bytes))


def make_shaped_checkpoint(out_dir: str, like: str, layers: int, seed: int = 0,
                           shard_bytes: int = DEFAULT_SHARD_BYTES, dry_run: bool = False) -> ShapedPlan:
    """Write the checkpoint (unless dry_run) into out_dir, which must be absent or empty; returns the plan."""
    plan = plan_shaped(like, layers, shard_bytes)
    if dry_run:
        return plan
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"--out {out_dir!r} exists and is not an empty directory")
    os.makedirs(out_dir, exist_ok=True)
    n = len(plan.shards)
    for k, shard in enumerate(plan.shards):
        write_shard(os.path.join(out_dir, shard_name(k, n)), shard, seed)
    c = plan.config
    _write_json(out_dir, "model.safetensors.index.json",
                {"metadata": {"total_size": plan.total_bytes}, "weight_map": plan.weight_map()})
    _write_json(out_dir, "config.json", c)
    _write_json(out_dir, "generation_config.json", {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]})
    _write_tokenizer(out_dir, c["vocab_size"], c["bos_token_id"], c["eos_token_id"], "v3")
    return plan
