"""The fixed texts and token strings of DeepSeek-V4's prompt format (launch/chat/dsv4_encoding.py uses them).

Facts from DeepSeek's `encoding/encoding_dsv4.py` and its published test prompts (the token strings, the tools
section's wording, the reasoning-effort paragraphs); written out here, not imported: V4 ships no Jinja template.

Reasoning-effort profiles. The April V4 release ("preview") has one paragraph, for "max"; "high" or none adds
nothing. DeepSeek-V4-Flash-0731 ("official") moved the tiers: "low" adds nothing, "high" is the former "max"
paragraph and "max" a new one. Which one a checkpoint speaks is read from the checkpoint
(launch/chat/chat_template.py: effort_profile).
"""
from __future__ import annotations

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_BEGIN, CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_END, PARAM_END = f"</{DSML}invoke>", f"</{DSML}parameter>"
RESULT_BEGIN, RESULT_END = "<tool_result>", "</tool_result>"

# Quick-instruction tasks: a user turn with `task` ends in its token instead of an assistant turn.
TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>", "domain": "<｜domain｜>",
         "title": "<｜title｜>", "read_url": "<｜read_url｜>"}

_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")

# OpenAI's reasoning_effort values -> the checkpoint's tier, per profile; "none" turns thinking off
# (vLLM's reading), and an absent value is the encoder's default (no paragraph in either profile).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
PROFILES = ("preview", "official")
_TIER = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
_PARAGRAPH = {"preview": {"low": "", "high": "", "max": _ABSOLUTE_MAXIMUM},
              "official": {"low": "", "high": _ABSOLUTE_MAXIMUM, "max": _BEYOND_MAXIMUM}}


def effort_paragraph(profile: str, effort: str | None) -> str:
    """The text right after BOS (thinking mode only) for a reasoning_effort of `effort` (one of EFFORTS but
    "none", or None)."""
    return "" if effort is None else _PARAGRAPH[profile][_TIER[effort]]


def tools_section(functions: list[str]) -> str:
    """The "## Tools" section: the call syntax, then one JSON line per tool's `function` object."""
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        f'"{CALLS_BEGIN}" block like the following:\n\n'
        f"{CALLS_BEGIN}\n"
        f'<{DSML}invoke name="$TOOL_NAME">\n'
        f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_END}\n'
        f"...\n{INVOKE_END}\n"
        f'<{DSML}invoke name="$TOOL_NAME2">\n'
        f"...\n{INVOKE_END}\n"
        f"{CALLS_END}\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
        f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        + "\n".join(functions) +
        "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")
