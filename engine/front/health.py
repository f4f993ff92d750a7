"""Whether the deployment can serve, as the front (rank 0) sees it: what `/health` answers and what
`/metrics` shows as wideep_serving and wideep_lost_rank.

    h = HealthView().read(engine)   # on the engine thread (AsyncEngine), between steps
    h["serving"], h["status"], h["lost_ranks"]

A rank cut off by a partition is silent rather than dead: it is declared lost only after the
watchdog's timeout_s, and until then every step waits on it. Rank 0 hears its two ring neighbours
(parallel/ring.py) directly, so a neighbour silent for longer than SUSPECT_BEATS heartbeats (and a
quarter of the timeout) is reported "unreachable" before the verdict; a silent rank elsewhere in
the ring shows only with the verdict.

Ranks are named by their origin rank (their rank at start-up), whatever a re-forming renumbered.
A lost rank is known to rank 0 in two ways: its watchdog's verdict (at once for a dead process,
after timeout_s for a silent one), and later the survivors' report that they re-formed without it
(Front.lost). Between the two the deployment cannot serve: the survivors' collectives fail or
wait, and with on_rank_loss = "continue" they are re-forming their groups; otherwise every rank is
about to exit.

    status      serving  when
    ok          yes      no rank lost
    degraded    yes      ranks lost, the survivors re-formed and serve (on_rank_loss = "continue")
    reforming   no       ranks lost, the survivors' re-forming not reported yet ("continue")
    lost        no       ranks lost and the policy ends the job (on_rank_loss = "exit")
    unreachable no       a ring neighbour of rank 0 silent, not declared lost yet
"""
from __future__ import annotations

from wideep.parallel.reform import origin_of

SUSPECT_BEATS = 3


class HealthView:
    """Rank 0's record of the losses it has seen. The watchdog of a re-formed context forgets the
    old context's verdicts, so the ranks seen lost are kept here until the front has them too."""

    def __init__(self):
        self.seen: set[int] = set()

    def read(self, engine) -> dict:
        job, front = engine.job_ctx, engine.front
        self.seen |= {origin_of(job, r) for r in job.lost_ranks()}
        reformed = set(front.lost)
        pending = self.seen - reformed
        # rank 0's loop re-formed (its context's epoch moved on) but its report has not reached the
        # front yet: the requests of the lost ranks are not re-admitted yet
        epochs = max((r["epoch"] for r in front.recoveries), default=0)
        behind = job.epoch > epochs
        policy = job.on_rank_loss
        wd = job.watchdog
        silent = {} if wd is None else wd.silent_ranks(max(SUSPECT_BEATS * wd.heartbeat_s, wd.timeout_s / 4))
        if pending or behind:
            status = "reforming" if policy == "continue" else "lost"
        elif silent:
            status = "unreachable"
        else:
            status = "degraded" if reformed else "ok"
        lost = sorted(self.seen | reformed)
        members = list(job.members) if job.members is not None else list(range(job.world_size))
        h = {"status": status, "serving": status in ("ok", "degraded"), "lost_ranks": lost,
             "serving_ranks": [m for m in members if m not in lost], "on_rank_loss": policy, "epoch": job.epoch}
        if silent:
            h["unreachable"] = [{"rank": origin_of(job, r), "silent_s": round(s, 2), "lost_after_s": wd.timeout_s}
                                for r, s in sorted(silent.items())]
        return h


def message(h: dict) -> str:
    """One line for a 503's error message: what is lost and what happens next."""
    who = ", ".join(str(r) for r in h["lost_ranks"])
    ranks = f"rank{'s' if len(h['lost_ranks']) > 1 else ''} {who}"
    if h["status"] == "unreachable":
        return "; ".join(f"rank {u['rank']} silent for {u['silent_s']:g} s (declared lost after {u['lost_after_s']:g} s)"
                         for u in h["unreachable"])
    if h["status"] == "reforming":
        return f"{ranks} lost; the survivors ({', '.join(map(str, h['serving_ranks']))}) are re-forming"
    return f"{ranks} lost; on_rank_loss = {h['on_rank_loss']!r}: the job is ending"
