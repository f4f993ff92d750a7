"""`python -m wideep.launch serve MODEL --dp-size 2` with no launcher starts its own 2 ranks
(launch/cli/serve_local.py): it serves the tokens of one process, SIGTERM to it stops every rank (their
pids gone), a killed rank ends the server naming it (on_rank_loss = "exit") or leaves rank 0 serving
("continue"), and a SIGKILLed supervisor leaves no rank behind. Bad layouts fail before anything starts."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from wideep.launch.cli.local import LAUNCHER_VARS
from wideep.launch.cli.main import main
from wideep.launch.cli.serve_local import RANKS_PER_CORE, LocalRanks, local_ranks
from tests.launch.runs import Started, children
from tests.launch.test_server import MAX_TOKENS, PROMPTS, complete, metrics, request
from tests.launch.test_server import reference, tiny  # noqa: F401  (test_server's fixtures: its checkpoint and tokens)

LINUX = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' pids in /proc (Linux)")
FLAGS = ["--port", "0", "--served-model-name", "tiny", "--dispatch-backend", "torch", "--max-model-len", "128",
         "--kv-cache-blocks", "64"]


class Spawned(Started):
    """`python -m wideep.launch serve <args>` run plainly (no launcher variables); waits for the line naming
    its ranks' pids and for rank 0's address."""

    def __init__(self, args: list[str], start_timeout_s: float = 120.0):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS + ("WIDEEP_API_KEY",)}
        super().__init__([sys.executable, "-m", "wideep.launch", "serve", *args], env, self._ready, start_timeout_s)
        assert sorted(children(self.proc.pid)) == sorted(self.ranks), (self.ranks, self.output)

    def _ready(self, line: str) -> bool:
        if "local ranks (pids " in line:
            self.ranks = [int(p) for p in line.split("(pids ")[1].split(";")[0].split(", ")]
        if "http://127.0.0.1:" in line:
            self.base = f"127.0.0.1:{int(line.split('http://127.0.0.1:')[1].split()[0])}"
            return True
        return False

    def saw(self, text: str, timeout_s: float) -> bool:
        """Whether a line with text came within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.output) and time.monotonic() < deadline:
            time.sleep(0.05)
        return any(text in line for line in self.output)

    def ranks_left(self, grace_s: float = 15.0) -> list[int]:
        return super().ranks_left(grace_s)


def config(tmp_path, tiny: str, parallel: str) -> str:
    path = tmp_path / "serve.toml"
    path.write_text(f'[model]\npath = "{tiny}"\n[parallel]\ndp_size = 2\ntimeout_s = 20\n{parallel}\n')
    return str(path)


@LINUX
@pytest.mark.multirank
def test_dp2_serves_as_one_process_and_sigterm_stops_every_rank(tiny, reference):
    s = Spawned([tiny, "--dp-size", "2", *FLAGS])
    try:
        assert len(s.ranks) == 2 and f"rank 0 is pid {s.ranks[0]}" in "".join(s.output)
        assert request(s.base, "GET", "/health") == (200, b'{"status": "ok"}')
        jobs = [(i, st) for i in range(len(PROMPTS)) for st in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: complete(s.base, PROMPTS[j[0]], MAX_TOKENS[j[0]], j[1]), jobs))
        assert [g["token_ids"] for g in got] == [reference[i] for i, _ in jobs]
        m = metrics(s.base)
        for r in (0, 1):   # both ranks took part: each sent MoE rows to the other
            assert m[f'wideep_rank_moe_remote_bytes_total{{dp_rank="{r}"}}'] > 0
        s.proc.send_signal(signal.SIGTERM)
        rc = s.wait(60)
    finally:
        s.kill()
    assert rc == 0, "".join(s.output)
    assert s.ranks_left() == []
    assert "wideep serve: stopped\n" in s.output and "Traceback" not in "".join(s.output)


@LINUX
@pytest.mark.multirank
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_the_server_naming_it(tiny, tmp_path, victim):
    """on_rank_loss = "exit": a killed worker ends rank 0 (status 1), a killed rank 0 ends the worker; the
    supervisor exits with rank 0's status (SIGKILL: 137) and every rank is gone."""
    s = Spawned(["--config", config(tmp_path, tiny, ""), tiny, *FLAGS])
    try:
        os.kill(s.ranks[victim], signal.SIGKILL)
        rc = s.wait(60)
    finally:
        s.kill()
    out = "".join(s.output)
    assert rc == (1 if victim else 128 + signal.SIGKILL), out
    assert f"rank {victim} lost" in out
    if victim:
        assert f"rank 1 (pid {s.ranks[1]}) exited (killed by signal 9)" in out
    assert s.ranks_left() == []


@LINUX
@pytest.mark.multirank
def test_continue_serves_on_after_a_rank_loss_and_a_killed_supervisor_leaves_no_rank(tiny, reference, tmp_path):
    s = Spawned(["--config", config(tmp_path, tiny, 'on_rank_loss = "continue"\nheartbeat_s = 0.5'), tiny, *FLAGS])
    try:
        os.kill(s.ranks[1], signal.SIGKILL)
        with ThreadPoolExecutor(2) as ex:   # rank 0, alone after re-forming, serves both
            got = list(ex.map(lambda i: complete(s.base, PROMPTS[i], MAX_TOKENS[i], True), (0, 1)))
        assert [g["token_ids"] for g in got] == reference[:2]
        assert metrics(s.base)["wideep_rank_losses_total"] == 1
        assert s.proc.poll() is None and request(s.base, "GET", "/health")[0] == 200
        assert s.saw(f"rank 1 (pid {s.ranks[1]}) exited (killed by signal 9)", 10), s.output   # reported
        os.kill(s.proc.pid, signal.SIGKILL)   # no handler runs: rank 0 learns it from its parent-death signal
        s.wait(10)
        assert s.ranks_left(30) == [], "".join(s.output)
        s.drained.wait(10)
    finally:
        s.kill()
    assert "wideep serve: stopped\n" in s.output, s.output   # rank 0 stopped gracefully on its parent's death


@pytest.mark.parametrize("flags, match", [
    (["--dp-size", "0"], r"dp_size must be an integer >= 1, got 0"),
    (["--dp-size", str(10_000)], r"dp_size \(10000\) is more ranks than this host can start: at most \d+"),
    (["--dp-size", "2", "--ep-size", "4"], r"ep_size \(4\) != dp_size \(2\)"),
    (["--ep-size", "2"], r"ep_size \(2\) without dp_size.*--dp-size 2"),
])
def test_bad_layouts_fail_before_any_rank_starts(tiny, flags, match, capsys, monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    before = set(children(os.getpid())) if os.path.isdir("/proc") else set()
    with pytest.raises(SystemExit) as e:
        main(["serve", tiny, *flags, "--port", "0"])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    if os.path.isdir("/proc"):
        assert set(children(os.getpid())) <= before


def test_local_ranks_only_without_a_launcher():
    cfg = {"parallel": {"dp_size": 2, "timeout_s": 7.0}}
    assert local_ranks(cfg, env={}) == LocalRanks(2, 7.0)
    for launcher in ({"RANK": "0", "WORLD_SIZE": "1"}, {"OMPI_COMM_WORLD_RANK": "0"}, {"PMI_RANK": "0"},
                     {"PMIX_RANK": "0"}):
        assert local_ranks(cfg, env=launcher) is None
    assert local_ranks({"parallel": {"dp_size": 1}}, env={}) is None
    assert local_ranks({"parallel": {}}, env={}) is None
    pools = {"prefill": {"dp_size": 2}, "decode": {"dp_size": 1}}
    assert local_ranks({"disagg": pools}, env={}) == LocalRanks(3, 60.0)
    with pytest.raises(ValueError, match=r"dp_size is set per pool when disaggregated"):
        local_ranks({"disagg": pools, "parallel": {"dp_size": 3}}, env={})
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) does not divide world_size \(2\)"):
        local_ranks({"parallel": {"dp_size": 2, "ranks_per_node": 3}}, env={})
    most = RANKS_PER_CORE * len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if most is not None:
        assert local_ranks({"parallel": {"dp_size": most, "backend": "gloo"}}, env={}).count == most
        with pytest.raises(ValueError, match=rf"dp_size \({most + 1}\) is more ranks .* at most {most}"):
            local_ranks({"parallel": {"dp_size": most + 1, "backend": "gloo"}}, env={})
        big = {"parallel": {"backend": "gloo"}, "disagg": {"prefill": {"dp_size": most}, "decode": {"dp_size": 1}}}
        with pytest.raises(ValueError, match=rf"the pools' dp_size \({most + 1}\) is more ranks"):
            local_ranks(big, env={})


@LINUX
@pytest.mark.multirank
def test_disaggregated_pools_are_started_too(tiny, reference, tmp_path):
    """A [disagg] config (1 decode + 1 prefill rank) served plainly: both pools' ranks started here."""
    path = tmp_path / "disagg.toml"
    path.write_text(f'[model]\npath = "{tiny}"\nmax_model_len = 128\n[parallel]\ndispatch_backend = "torch"\n'
                    f'[disagg.prefill]\nkv_cache_blocks = 64\n[disagg.decode]\nkv_cache_blocks = 64\n'
                    f'[server]\nport = 0\nmodel_name = "tiny"\n')
    s = Spawned(["--config", str(path)])
    try:
        assert len(s.ranks) == 2
        assert [complete(s.base, PROMPTS[i], MAX_TOKENS[i], i % 2 == 1)["token_ids"] for i in (0, 1)] == reference[:2]
        assert metrics(s.base)["wideep_kv_transfers_total"] == 2   # the prompts went through the prefill rank
        s.proc.send_signal(signal.SIGINT)
        rc = s.wait(60)
    finally:
        s.kill()
    assert rc == 0, "".join(s.output)
    assert s.ranks_left() == []


def test_mismatch_under_a_launcher_says_how_to_fix_it():
    from wideep.parallel.config import ParallelConfig
    with pytest.raises(ValueError, match=r"dp_size \(2\) != world_size \(1\).*torchrun --nproc-per-node 2.*"
                                         r"leave dp_size out"):
        ParallelConfig(dp_size=2, ep_size=2).validate(1)
