"""The CPU backend's kernel table as the model's builder makes it (engine build: layers.Kernels.from_table), and the
random paged caches the decode kernels' tests read."""
import torch

from wideep.cpu.kernels import table
from wideep.layers import Kernels

CPU = Kernels.from_table("cpu", table())


def paged_bf16(lens: list[int], block_size: int, heads: int, D: int):
    """A random bfloat16 pool holding len(lens) sequences in shuffled blocks (two spare), its block table and a
    float32 query per sequence and head -> (pool [S, D], table [B, M] int64, q [B, heads, D])."""
    B, M = len(lens), max(-(-n // block_size) for n in lens)
    nblocks = B * M + 2
    pool = torch.randn(nblocks * block_size, D).to(torch.bfloat16)
    return pool, torch.randperm(nblocks)[:B * M].view(B, M), torch.randn(B, heads, D)
