"""tool_choice "required" / a named tool in a DeepSeek model's own call format: the DSML block of V3.2
(`function_calls`) or V4 (`tool_calls`), "\\n\\n" before it as the encodings write it, one invoke per call (one
only for a named tool or with parallel_tool_calls false) whose parameters match the tool's schema (strings raw
with string="true", anything else JSON with string="false"). The structural tag is xgrammar's own for these
models (get_model_structural_tag, as vLLM's deepseek_v4 parser asks for it), with the reasoning left out: the
grammar starts after the reasoning (StructuredOutputsParams.after_token), and at most one whitespace
character between the parts, so a model that wanders into whitespace cannot spend its tokens there.
"""
from __future__ import annotations

from .params import StructuredOutputsParams

MODELS = {"function_calls": "deepseek_v3_2", "tool_calls": "deepseek_v4"}   # DSML block -> xgrammar's format
NO_ARGUMENTS = {"type": "object", "properties": {}}


def tool_call_tag(block: str, tools: list[dict], forced: str, parallel: bool = True) -> StructuredOutputsParams:
    """block: the DSML block name (MODELS); tools: OpenAI's function tools; forced: "required" or a tool's
    name. A tool without parameters takes none (OpenAI's reading), not any."""
    import xgrammar as xgr
    tools = [dict(t, function=dict(t["function"], parameters=t["function"].get("parameters") or NO_ARGUMENTS))
             for t in tools]
    choice = "required" if forced == "required" else {"type": "function", "function": {"name": forced}}
    tag = xgr.get_model_structural_tag(MODELS[block], tools=tools, tool_choice=choice, reasoning="disabled",
                                       parallel_tool_calls=parallel, max_whitespace_cnt=1)
    return StructuredOutputsParams(structural_tag=tag.model_dump_json())
