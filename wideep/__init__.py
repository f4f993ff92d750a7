"""wideep's public API under one name of its own:

    from wideep import LLM, SamplingParams, Engine, AsyncEngine, StructuredOutputsParams

The implementation lives in the layout's top-level packages (engine, moe, parallel, ...); this module
only re-exports what users build on, so their imports do not depend on that layout.
"""
from importlib.metadata import PackageNotFoundError, version

from engine import AsyncEngine, CompletionOutput, ConfigError, Engine, ModelConfig, RequestOutput, SamplingParams
from structured import StructuredOutputsParams

from .llm import LLM

try:
    __version__ = version("wideep")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["LLM", "Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig",
           "ConfigError", "StructuredOutputsParams", "__version__"]
