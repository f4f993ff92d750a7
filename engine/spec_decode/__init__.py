"""Speculative decoding: drafts proposed off the device (n-gram lookup) or by the checkpoint's MTP layer,
verified by the target model in one forward (every draft a decode row of its own), accepted exactly
(greedy match, or rejection sampling so the output distribution equals plain sampling)."""
from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
