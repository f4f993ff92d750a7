"""The capability x model-family matrix: what every cell must do, one place (tests/engine/test_capability_matrix.py
runs the cells against it; docs/models.md's support table is generated from it).

A cell is "equal" (its run's tokens equal the one-process run of the same requests, cumulative logprobs within the
dtype's tolerance) or "refused: <text>" (the engine refuses it at construction, on every rank, with an error naming
the model and the feature that contains <text>). No cell may fail at run time.

    python -m tests.engine.capability_matrix            prints docs/models.md's table
    python -m tests.engine.capability_matrix --write    writes it between the table's markers in docs/models.md
"""
from __future__ import annotations

import sys
from pathlib import Path

FAMILIES = {"v3": "DeepSeek-V3 (MLA)", "v32": "DeepSeek-V3.2 (DSA)", "v4_flash": "DeepSeek-V4, Flash layers",
            "v4_pro": "DeepSeek-V4, Pro layers"}

# capability -> (its name in the table, how the cell runs it)
CAPABILITIES = {
    "prefix_caching": ("prefix caching", "2 EP ranks, the second wave of prompts shares the first's prefixes"),
    "chunked_prefill": ("chunked prefill", "2 EP ranks, max_num_batched_tokens 16"),
    "preemption": ("preemption under KV pressure", "2 EP ranks, a KV cache too small for every sequence"),
    "dbo": ("dual-batch overlap", "2 EP ranks, every step with 2+ tokens split"),
    "eplb": ("online EPLB rebalancing", "2 EP ranks, 2 redundant slots, a rebalance every 3 steps"),
    "rank_loss": ("a rank killed (on_rank_loss continue)", "4 EP ranks, rank 2 SIGKILLed mid-generation"),
    "resize": ("resize on request (Engine.start_resize)", "4 EP ranks shrunk to 3, then to 1, while requests "
                                                          "arrive (tests/engine/test_resize.py's load)"),
    "disagg": ("prefill/decode disaggregation", "1 prefill + 1 decode rank"),
    "kv_tiers": ("host/disk KV tiers + KV-aware routing", "2 EP ranks, host and disk tiers, kv_aware routing"),
    "fp8_kv": ("FP8 KV cache", "2 EP ranks, kv_cache_dtype fp8 (against one process with fp8)"),
    "fp8_weights": ("online FP8 weights", "2 EP ranks, quantization fp8 on the float32 checkpoint (against one "
                                          "process with fp8)"),
    "ngram": ("n-gram speculation", "2 EP ranks, k = 2"),
    "mtp": ("MTP speculation", "2 EP ranks, k = 2"),
    "structured": ("structured outputs", "2 EP ranks, regex and choice requests"),
    "bf16": ("bfloat16 weights", "2 EP ranks, dtype bfloat16 (against one process in bfloat16)"),
    "ep2": ("2 EP ranks", "2 EP ranks"),
    "ep4": ("4 EP ranks", "4 EP ranks"),
}

# every cell is "equal" unless listed here
REFUSED: dict[tuple[str, str], str] = {}


def expected(family: str, capability: str) -> str:
    return REFUSED.get((family, capability), "equal")


START, END = "<!-- capability-matrix:start -->", "<!-- capability-matrix:end -->"


def markdown() -> str:
    """The support table: a row per capability, a column per family; "yes" (equal to one process) or "refused"."""
    head = "| capability | how the test runs it | " + " | ".join(FAMILIES.values()) + " |"
    rows = [head, "|" + "---|" * (2 + len(FAMILIES))]
    for cap, (name, how) in CAPABILITIES.items():
        cells = ["yes" if expected(f, cap) == "equal" else "refused" for f in FAMILIES]
        rows.append(f"| {name} | {how} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write(path: Path) -> None:
    text = path.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    path.write_text(text[:a] + "\n" + markdown() + "\n" + text[b:])


if __name__ == "__main__":
    if "--write" in sys.argv:
        write(Path(__file__).resolve().parents[2] / "docs" / "models.md")
    else:
        print(markdown())
