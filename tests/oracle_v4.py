"""transformers 5.24's DeepseekV4ForCausalLM as the oracle: tiny random models (launch/tiny/v4.py: transformers'
degenerate initial values randomised) saved with save_pretrained."""
from __future__ import annotations

from wideep.launch.tiny.v4 import FLASH, PRO, tiny_v4_model

__all__ = ["FLASH", "PRO", "YARN", "make_v4_model"]

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def make_v4_model(out_dir: str, seed: int = 0, **overrides):
    """Build, randomise and save a tiny DeepSeek-V4; returns it (float32, eval)."""
    model = tiny_v4_model(seed, **overrides)
    model.save_pretrained(out_dir)
    return model
