"""wideep.LLM: engine.LLM, plus `disagg=` (prefill/decode pools, disagg/), which the engine package
itself cannot build (disagg/ is built on the engine; the engine never imports it)."""
from __future__ import annotations

from wideep.engine.front.llm import LLM as _LLM


class LLM(_LLM):
    """Options: engine.LLM's (see engine/engine_config.py); disagg (a disagg.DisaggConfig or the
    [disagg] dict) serves with separate prefill and decode pools, whose sizes and batch limits it holds."""

    def __init__(self, model: str, disagg=None, **options):
        engine = None
        if disagg is not None:
            from wideep.disagg import make_engine
            engine = make_engine(model, disagg=disagg, **options)
        super().__init__(model, engine=engine, **({} if engine is not None else options))
