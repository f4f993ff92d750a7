"""Prefill/decode disaggregation: a prefill pool and a decode pool of ranks, each with its own
DP/EP sizes, batch limits and process groups; latent KV moves from prefill to decode rank layer
by layer through a KVTransfer (torch.distributed by default). See engine.py for the entry point."""
from .config import DisaggConfig, PoolConfig
from .engine import make_engine

__all__ = ["DisaggConfig", "PoolConfig", "make_engine"]
