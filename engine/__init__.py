"""The engine, by role along a step's path: front/ (the front and the public API), worker/ (one rank's
step loop), sched/ (scheduling, off the device), model/ (the model and its loading); engine_config.py
and sampling_params.py are what all of them speak."""
from .front.async_engine import AsyncEngine
from .front.engine import Engine
from .front.llm import LLM
from .model.model_config import ConfigError, ModelConfig
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig", "ConfigError"]
