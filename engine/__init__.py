"""Model assembly, checkpoint loading, scheduling, sampling and the public API."""
from .config import ConfigError, ModelConfig
from .llm import LLM
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig", "ConfigError"]
