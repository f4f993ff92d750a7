"""Every engine capability with every model family (tests/engine/capability_matrix.py declares each cell): DeepSeek-V3
(MLA), DeepSeek-V3.2 (DSA) and DeepSeek-V4 with Flash- and Pro-shaped layer orders, each a cycle checkpoint with its
MTP layer (launch/tiny_cycle.py: drafts are mostly right, prompts repeat, so both speculation methods verify drafts).

Each cell runs the same requests (two waves, the second sharing the first's prefixes; greedy, max_tokens 10) and
either equals the one-process run of the same requests (tokens exactly, cumulative logprobs within the dtype's
tolerance) or is refused at construction on every rank with an error naming the model and the feature. Cells run in
one set of ranks per family and setting, an engine each, one after the other: 2 EP ranks (most capabilities, so
each is also checked composed with expert parallelism), 4 EP ranks (plain, then one rank killed), and 1 prefill +
1 decode rank.
"""
from __future__ import annotations

import os

import pytest

from tests.engine.capability_matrix import CAPABILITIES, FAMILIES, expected, markdown, START, END
from tests.parallel.spawn import run

pytest.importorskip("transformers")

BS = 8
MAX_TOKENS = 10
TIMEOUT_S = 30.0
PLAIN = dict(progress=False, block_size=BS, enable_prefix_caching=False, max_num_batched_tokens=256,
             kv_cache_blocks=128, max_num_seqs=16)
# what each capability changes in the plain options (cells of the 2-rank setting; the others are below)
OPTIONS = {
    "ep2": {},
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(kv_cache_blocks=3),
    "dbo": dict(dbo={"enabled": True, "prefill_token_threshold": 2, "decode_token_threshold": 2}),
    "eplb": dict(eplb={"enabled": True, "num_redundant_experts": 2, "window_size": 4, "step_interval": 3}),
    "kv_tiers": dict(enable_prefix_caching=True, kv_cache_blocks=12,
                     kv_cache={"tiers": ["host", "disk"], "host_bytes": 1 << 20, "disk_bytes": 1 << 24,
                               "routing": "kv_aware"}),   # + disk_dir, the cell's own (_cell)
    "fp8_kv": dict(kv_cache_dtype="fp8"),
    "fp8_weights": dict(quantization="fp8"),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 1}),
    "mtp": dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
    "structured": {},
    "bf16": dict(dtype="bfloat16"),
}
# the requests of a cell (waves' kind), and its one-process reference: the plain run, or one that computes the same
# numbers
KIND = {"structured": "structured", "preemption": "pressure"}
REFERENCE = {"fp8_kv": dict(kv_cache_dtype="fp8"), "fp8_weights": dict(quantization="fp8"),
             "bf16": dict(dtype="bfloat16")}
RANK_LOSS = {"on_rank_loss": "continue", "num_redundant_experts": 4, "timeout_s": TIMEOUT_S, "heartbeat_s": 0.5}


# -- the checkpoints and the requests ------------------------------------------------------------------------
def make_checkpoint(family: str, out_dir: str) -> tuple[str, list[int]]:
    from wideep.launch.tiny.checkpoint import _write_tokenizer
    from wideep.launch.tiny.cycle import make_cycle_checkpoint, make_v4_cycle_checkpoint
    from wideep.launch.tiny.v4 import FLASH, PRO
    if family in ("v3", "v32"):
        return make_cycle_checkpoint(out_dir, arch=family, mtp=True, seed=1)
    d, nxt = make_v4_cycle_checkpoint(out_dir, mtp=True, seed=1, vocab_size=256,
                                      layer_types=FLASH if family == "v4_flash" else PRO)
    _write_tokenizer(d, 256, 0, 1, None)   # structured outputs compile grammars over the vocabulary
    return d, nxt


def waves(nxt: list[int], kind: str = "plain") -> list[list[tuple[str, list[int], dict]]]:
    """Two waves of (request id, prompt, SamplingParams kwargs): the second's prompts start with the first's (prefix
    hits once the first wave's blocks are named). kind "structured": half the requests constrained (a regex, a
    choice); "pressure": one wave of 4 prompts of 8 tokens, which a cache of 3 blocks per rank (DeepSeek-V4: of
    every stream) admits two by two and then cannot grow (preemption)."""
    from wideep.launch.tiny.cycle import cycle_prompts
    if kind == "pressure":
        kw = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        return [[(f"p{i}", p, kw) for i, p in enumerate(cycle_prompts(nxt, 4, 8, seed=6))]]
    structured = kind == "structured"
    base = cycle_prompts(nxt, 3, 28, seed=4)
    tails = cycle_prompts(nxt, 3, 9, seed=5)
    first = [base[0][:5], base[1][:20], base[2]]
    second = [base[0] + tails[0], base[1][:17] + tails[1], base[2][:24] + tails[2][:3]]

    def kw(i: int) -> dict:
        out = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        if structured and i % 2 == 0:
            out["structured_outputs"] = ({"regex": "[a-f]{3}-[0-9]{2,4}"} if i % 4 == 0
                                         else {"choice": ["alpha", "beta", "gamma"]})
        return out
    return [[(f"a{i}", p, kw(i)) for i, p in enumerate(first)],
            [(f"b{i}", p, kw(i + 3)) for i, p in enumerate(second)]]


def _outputs(got: dict) -> dict:
    return {rid: (list(o.token_ids), float(o.cumulative_logprob)) for rid, o in got.items()}


def one_process(model_dir: str, nxt: list[int], kind: str = "plain", **options) -> dict:
    """The reference: the waves, one after the other, through one engine in this process."""
    from tests.request_runs import run_on_front
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, **dict(PLAIN, **options))
    got = {}
    for wave in waves(nxt, kind):
        got |= _outputs(run_on_front(eng, wave))
    eng.shutdown()
    return got


# -- a cell on ranks ------------------------------------------------------------------------------------------
def _cell(model_dir: str, nxt: list[int], cap: str, options: dict, parallel: dict, victim: tuple | None = None,
          disagg: dict | None = None) -> dict:
    """One engine on this rank: the waves on the front, the worker loop elsewhere. -> {"refused": message} when the
    engine refuses to build, else the front's outputs and what the cell exercised (counters that show it ran)."""
    from tests.request_runs import run_on_front
    from wideep.engine.front.engine import Engine
    opts = dict(PLAIN, **options, parallel=dict({"timeout_s": TIMEOUT_S}, **parallel))
    if "kv_cache" in opts:
        opts["kv_cache"] = dict(opts["kv_cache"], disk_dir=os.path.join(model_dir, f"kv_disk_{cap}"))
    try:
        if disagg is not None:
            from wideep.disagg import make_engine
            opts.pop("kv_cache_blocks"), opts.pop("max_num_seqs"), opts.pop("max_num_batched_tokens")
            eng = make_engine(model_dir, disagg, **opts)
        else:
            eng = Engine(model_dir, **opts)
    except ValueError as e:
        return {"refused": str(e)}
    if victim is not None and int(os.environ["RANK"]) == victim[0]:
        from tests.faults import sigkill_at_step
        sigkill_at_step(victim[1])
    if not eng.is_front:
        return {"loop": eng.run_worker_loop()}
    got = {}
    for wave in waves(nxt, KIND.get(cap, "plain")):
        got |= _outputs(run_on_front(eng, wave))
    core, m = eng.core, eng.metrics()
    per_rank = m.get("per_rank", [])
    ran = {"split_steps": core.split_steps, "rebalances": core.eplb.metrics["rebalances"] if core.eplb else 0,
           "accepted": m.get("spec_decode_num_accepted_tokens", 0),
           "prefix_hits": sum(r.get("prefix_hit_tokens", 0) for r in per_rank),
           "preemptions": m.get("preemptions", 0), "recoveries": m.get("recoveries", [])}
    eng.shutdown()
    return {"got": got, "ran": ran}


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free on 127.0.0.1 now, each engine of a set of ranks rendezvousing on its own (a closed
    engine's store may hold its port a while). They come from below the kernel's ephemeral range: the cells run for
    minutes after this, and a port from bind(("", 0)) could meanwhile be handed to one of gloo's own connections."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pool = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(pool)
    ports = []
    for port in pool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"fewer than {n} free TCP ports below {low} on 127.0.0.1")


def _two_ranks(model_dir: str, nxt: list[int], caps: list[str], ports: list[int]) -> dict:
    """Every 2-rank cell of a family, one engine after another on the same 2 ranks."""
    out = {}
    for cap, port in zip(caps, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        out[cap] = _cell(model_dir, nxt, cap, OPTIONS[cap], {})
    return out


def _four_ranks(model_dir: str, nxt: list[int], ports: list[int]) -> dict:
    """4 EP ranks plain, then with on_rank_loss continue and rank 2 killed at its 6th step."""
    os.environ["MASTER_PORT"] = str(ports[0])
    out = {"ep4": _cell(model_dir, nxt, "ep4", {}, {})}
    os.environ["MASTER_PORT"] = str(ports[1])
    out["rank_loss"] = _cell(model_dir, nxt, "rank_loss", {}, RANK_LOSS, victim=(2, 6))
    return out


def _disagg(model_dir: str, nxt: list[int]) -> dict:
    pools = {"prefill": {"dp_size": 1, "ep_size": 1, "max_num_batched_tokens": 24, "kv_cache_blocks": 64},
             "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 64}}
    return {"disagg": _cell(model_dir, nxt, "disagg", {}, {}, disagg=pools)}


# -- checking a cell --------------------------------------------------------------------------------------------
def check_cell(family: str, cap: str, per_rank: list, alone: dict, lost: int | None = None) -> None:
    """per_rank: each rank's {capability: outcome} (None for a rank killed before it returned); lost: that rank,
    which reports no outcome of any cell."""
    want = expected(family, cap)
    where = f"{FAMILIES[family]} x {CAPABILITIES[cap][0]}"
    outs = [r[cap] if r is not None else None for r in per_rank]
    if want != "equal":
        text = want.removeprefix("refused: ")
        for rank, o in enumerate(outs):
            assert o is not None and "refused" in o, f"{where}: rank {rank} did not refuse: {o}"
            assert text in o["refused"] and FAMILIES[family].split(",")[0].split(" (")[0] in o["refused"], \
                f"{where}: rank {rank} refused with {o['refused']!r}"
        return
    for rank, o in enumerate(outs):
        if rank == lost:
            continue
        assert o is not None and "refused" not in o, f"{where}: rank {rank} refused: {o}"
    got, ran = outs[0]["got"], outs[0]["ran"]
    assert set(got) == set(alone), f"{where}: requests {sorted(set(alone) - set(got))} did not finish"
    tol = 5e-2 if cap == "bf16" else 1e-3
    for rid, (tokens, lp) in alone.items():
        assert got[rid][0] == tokens, f"{where}: request {rid} gave {got[rid][0]}, one process {tokens}"
        assert abs(got[rid][1] - lp) <= tol * max(1.0, abs(lp)), f"{where}: {rid} logprob {got[rid][1]} vs {lp}"
    exercised = {"dbo": ran["split_steps"] > 0, "eplb": ran["rebalances"] > 0, "mtp": ran["accepted"] > 0,
                 "ngram": ran["accepted"] > 0, "prefix_caching": ran["prefix_hits"] > 0,
                 "rank_loss": len(ran["recoveries"]) == 1, "preemption": ran["preemptions"] > 0}
    assert exercised.get(cap, True), f"{where}: the capability did not run ({ran})"


TWO_RANK_CAPS = [c for c in CAPABILITIES if c not in ("rank_loss", "disagg", "ep4", "resize")]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint, nxt, the one-process references by options)."""
    fam = request.param
    d, nxt = make_checkpoint(fam, str(tmp_path_factory.mktemp(f"matrix_{fam}")))
    refs = {"plain": one_process(d, nxt), "structured": one_process(d, nxt, "structured"),
            "pressure": one_process(d, nxt, "pressure")}
    for cap, options in REFERENCE.items():
        if expected(fam, cap) == "equal":   # (a refused cell has no reference)
            refs[cap] = one_process(d, nxt, **options)
    return fam, d, nxt, refs


def _reference(refs: dict, cap: str) -> dict:
    return refs.get(cap) or refs.get(KIND.get(cap)) or refs["plain"]


@pytest.mark.multirank
@pytest.mark.slow
def test_two_ep_ranks(family):
    fam, d, nxt, refs = family
    outs = run(_two_ranks, 2, args=(d, nxt, TWO_RANK_CAPS, free_ports(len(TWO_RANK_CAPS))), timeout_s=900)
    for o in outs:
        assert o.ok, f"{FAMILIES[fam]}: rank {o.rank} failed:\n{o.stderr[-4000:]}"
    for cap in TWO_RANK_CAPS:
        check_cell(fam, cap, [o.value for o in outs], _reference(refs, cap))


@pytest.mark.multirank
@pytest.mark.slow
def test_four_ep_ranks_and_a_lost_rank(family):
    fam, d, nxt, refs = family
    outs = run(_four_ranks, 4, args=(d, nxt, free_ports(2)), timeout_s=600)
    assert outs[2].returncode == -9, f"{FAMILIES[fam]}: the victim was not killed:\n{outs[2].stderr[-3000:]}"
    for o in (outs[0], outs[1], outs[3]):
        assert o.ok, f"{FAMILIES[fam]}: rank {o.rank} failed:\n{o.stderr[-4000:]}"
    values = [o.value if o.ok else None for o in outs]
    check_cell(fam, "ep4", values, refs["plain"], lost=2)   # (the victim dies before it returns the first's)
    check_cell(fam, "rank_loss", values, refs["plain"], lost=2)


@pytest.mark.multirank
@pytest.mark.slow
def test_prefill_decode_disaggregation(family):
    fam, d, nxt, refs = family
    outs = run(_disagg, 2, args=(d, nxt), timeout_s=400)
    for o in outs:
        assert o.ok, f"{FAMILIES[fam]}: rank {o.rank} failed:\n{o.stderr[-4000:]}"
    check_cell(fam, "disagg", [o.value for o in outs], refs["plain"])


@pytest.mark.multirank
@pytest.mark.slow
def test_resize_while_serving(family):
    """The resize cell: tests/engine/test_resize.py's serving loop (its own requests, arriving while 4 ranks shrink
    to 3 and then to 1) on this family's checkpoint, token for token equal to one process."""
    from tests.engine.test_resize import _serve
    fam, d, _, _ = family
    assert expected(fam, "resize") == "equal"
    alone = _serve(d, (), ())["got"]
    outs = run(_serve, 4, args=(d, (3, 1), (6, 14)), timeout_s=300)
    for o in outs:
        assert o.ok, f"{FAMILIES[fam]}: rank {o.rank} failed:\n{o.stderr[-4000:]}"
    front = outs[0].value
    assert front["got"] == alone, f"{FAMILIES[fam]} x resize: tokens differ from one process"
    assert [r["new_data_parallel_size"] for r in front["results"]] == [3, 1]
    assert [o.value["how"] for o in outs[1:]] == ["left", "left", "left"]


def test_the_docs_table_is_the_matrix():
    """docs/models.md's support table is generated from the matrix (python -m tests.engine.capability_matrix
    --write)."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    assert START in text and END in text, "docs/models.md has no capability-matrix markers"
    table = text[text.index(START) + len(START):text.index(END)].strip()
    assert table == markdown(), "docs/models.md's table is stale: python -m tests.engine.capability_matrix --write"
