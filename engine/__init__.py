"""Model assembly, checkpoint loading, scheduling, sampling and the public API."""
from .config import ConfigError, ModelConfig
from .async_engine import AsyncEngine
from .engine import Engine
from .llm import LLM
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig", "ConfigError"]
