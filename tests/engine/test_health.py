"""engine/front/health.py: the state /health reports, from rank 0's watchdog and the front's record
of re-formings (fakes of both: the namespace-cluster tests run the real ones end to end), and
/metrics' rendering of it."""
from __future__ import annotations

from dataclasses import dataclass, field

from wideep.engine.front.health import HealthView, message
from wideep.launch.server.prometheus import parse, render


@dataclass
class FakeWatchdog:
    lost: list[int] = field(default_factory=list)
    silent: dict[int, float] = field(default_factory=dict)
    heartbeat_s: float = 0.5
    timeout_s: float = 4.0

    def silent_ranks(self, after_s: float) -> dict[int, float]:
        return {r: s for r, s in self.silent.items() if s > after_s}


@dataclass
class FakeCtx:
    watchdog: FakeWatchdog
    world_size: int = 4
    members: tuple | None = None
    epoch: int = 0
    on_rank_loss: str = "continue"

    def lost_ranks(self) -> list[int]:
        return self.watchdog.lost


@dataclass
class FakeFront:
    lost: set = field(default_factory=set)
    recoveries: list = field(default_factory=list)


@dataclass
class FakeEngine:
    job_ctx: FakeCtx
    front: FakeFront = field(default_factory=FakeFront)


def test_a_loss_survived_goes_ok_reforming_degraded():
    eng, view = FakeEngine(FakeCtx(FakeWatchdog())), HealthView()
    h = view.read(eng)
    assert (h["status"], h["serving"], h["lost_ranks"]) == ("ok", True, [])
    eng.job_ctx.watchdog.lost = [3]
    h = view.read(eng)
    assert (h["status"], h["serving"], h["lost_ranks"], h["serving_ranks"]) == ("reforming", False, [3], [0, 1, 2])
    assert message(h) == "rank 3 lost; the survivors (0, 1, 2) are re-forming"
    # rank 0's loop re-formed (new context, its watchdog knows no loss) before the front heard: still re-forming
    eng.job_ctx = FakeCtx(FakeWatchdog(), world_size=3, members=(0, 1, 2), epoch=1)
    assert view.read(eng)["status"] == "reforming"
    eng.front.lost, eng.front.recoveries = {3}, [{"epoch": 1, "lost": [3]}]
    h = view.read(eng)
    assert (h["status"], h["serving"], h["lost_ranks"], h["serving_ranks"]) == ("degraded", True, [3], [0, 1, 2])
    # a second loss, numbered in the re-formed context (its rank 1 is origin rank 1, its rank 2 origin 2)
    eng.job_ctx.watchdog.lost = [2]
    h = view.read(eng)
    assert (h["status"], h["lost_ranks"], h["serving_ranks"]) == ("reforming", [2, 3], [0, 1])


def test_a_loss_under_the_exit_policy_is_lost_and_named():
    eng = FakeEngine(FakeCtx(FakeWatchdog(lost=[1, 2]), on_rank_loss="exit"))
    h = HealthView().read(eng)
    assert (h["status"], h["serving"], h["lost_ranks"]) == ("lost", False, [1, 2])
    assert message(h) == "ranks 1, 2 lost; on_rank_loss = 'exit': the job is ending"


def test_a_silent_neighbour_is_unreachable_only_past_three_beats_and_a_quarter_of_the_timeout():
    wd = FakeWatchdog(silent={3: 0.9})
    eng, view = FakeEngine(FakeCtx(wd)), HealthView()
    assert view.read(eng)["status"] == "ok"                # 0.9 s < max(3 x 0.5, 4 / 4) = 1.5 s
    wd.silent = {3: 2.04}
    h = view.read(eng)
    assert (h["status"], h["serving"], h["unreachable"]) == ("unreachable", False,
                                                             [{"rank": 3, "silent_s": 2.04, "lost_after_s": 4.0}])
    assert message(h) == "rank 3 silent for 2.04 s (declared lost after 4 s)"
    wd.lost = [3]                                          # the verdict: a loss from here on
    assert view.read(eng)["status"] == "reforming"


def test_metrics_render_serving_and_the_lost_and_silent_ranks():
    m = parse(render({"serving": 0, "lost_ranks": [2, 3], "unreachable": [{"rank": 1, "silent_s": 2.5}]}))
    assert m["wideep_serving"] == 0 and m['wideep_lost_rank{rank="2"}'] == 1 == m['wideep_lost_rank{rank="3"}']
    assert m['wideep_unreachable_rank_silent_seconds{rank="1"}'] == 2.5
    m = parse(render({"serving": 1, "lost_ranks": [], "unreachable": []}))
    assert m["wideep_serving"] == 1 and not any(k.startswith(("wideep_lost_rank", "wideep_unreachable")) for k in m)
