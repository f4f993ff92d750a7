"""wideep's public API under one name of its own:

    from wideep import LLM, SamplingParams, Engine, AsyncEngine, StructuredOutputsParams

The implementation is wideep's subpackages (wideep.engine, wideep.moe, wideep.parallel, ...: the repository's
top-level folders, mapped under this name by setup.py); this module re-exports what users build on, so
their imports do not depend on that layout.
"""
from importlib.metadata import PackageNotFoundError, version

from wideep.engine import AsyncEngine, CompletionOutput, ConfigError, Engine, ModelConfig, RequestOutput, SamplingParams
from wideep.structured import StructuredOutputsParams

from .llm import LLM

try:
    __version__ = version("wideep")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["LLM", "Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig",
           "ConfigError", "StructuredOutputsParams", "__version__"]
