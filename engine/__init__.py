"""Model assembly, checkpoint loading, scheduling, sampling and the public API."""
from .config import ConfigError, ModelConfig
from .engine import Engine
from .llm import LLM
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig", "ConfigError"]
