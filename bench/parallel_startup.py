"""Where one rank's start-up goes in the parallel layer: CPU seconds and wall seconds per phase.

Starts W gloo ranks on this host (launch/cli/local.py's spawner) for each W, and each rank times:
interpreter start, `import torch`, `import wideep.parallel`, then bootstrap's phases: the rendezvous store,
init_process_group (gloo's full mesh), node groups, the watchdog (ring + verdict log), the config
agreement check; then the watchdog's steady state (store operations per rank per second over
--steady-s). Phases are timed by wrapping bootstrap's callees here; nothing in parallel/ is changed.

    python bench/parallel_startup.py [--worlds 4,8,16] [--ranks-per-node 0] [--steady-s 5]

Prints a table per world size (mean and max over ranks) and, last line, JSON
{"<W>": {"<phase>": {"cpu_mean": .., "cpu_max": .., "wall_mean": .., "wall_max": ..}, ...,
"store_ops_per_rank_per_s": ..}, ...}.
"""
from __future__ import annotations

import time

_CPU0, _WALL0 = time.process_time(), time.perf_counter()  # CPU since the process began

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PHASES = ("python", "import torch", "import wideep.parallel", "store", "init_process_group", "node groups", "watchdog",
          "check_agreement", "bootstrap total")


def rank_main(out_dir: str, ranks_per_node: int, steady_s: float) -> None:
    times: dict[str, tuple[float, float]] = {"python": (_CPU0, time.perf_counter() - _WALL0)}

    def timed(name, fn):
        def wrapper(*a, **kw):
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times[name] = (time.process_time() - c, time.perf_counter() - w)
        return wrapper

    c, w = time.process_time(), time.perf_counter()
    import torch
    import torch.distributed as dist
    times["import torch"] = (time.process_time() - c, time.perf_counter() - w)
    c, w = time.process_time(), time.perf_counter()
    sys.path.insert(0, str(REPO))
    import wideep.parallel as parallel
    boot = sys.modules["wideep.parallel.bootstrap"]  # the package re-exports a function of that name
    times["import wideep.parallel"] = (time.process_time() - c, time.perf_counter() - w)

    boot._open_store = timed("store", boot._open_store)
    boot.dist.init_process_group = timed("init_process_group", dist.init_process_group)
    boot.new_node_group = timed("node groups", boot.new_node_group)
    boot.Watchdog.start = timed("watchdog", boot.Watchdog.start)
    boot.check_agreement = timed("check_agreement", boot.check_agreement)
    world = int(os.environ["WORLD_SIZE"])
    cfg = parallel.ParallelConfig(dp_size=world, ep_size=world, timeout_s=120, ranks_per_node=ranks_per_node)
    ctx = timed("bootstrap total", parallel.bootstrap)(cfg)

    s0 = ctx.watchdog.stats()
    time.sleep(steady_s)
    s1 = ctx.watchdog.stats()
    t = torch.ones(1)
    dist.all_reduce(t)  # everyone is still here after the steady window
    steady = (s1["store_ops"] - s0["store_ops"]) / (s1["uptime_s"] - s0["uptime_s"])
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(dict(times=times, startup_store_ops=s0["store_ops"], startup_store_keys=s0["store_keys"],
                       steady_ops_per_s=steady), f)
    parallel.shutdown(ctx)


def summarize(out_dir: str, world: int) -> dict:
    ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    out = {}
    for p in PHASES:
        cpu = [r["times"][p][0] for r in ranks]
        wall = [r["times"][p][1] for r in ranks]
        out[p] = dict(cpu_mean=sum(cpu) / world, cpu_max=max(cpu), wall_mean=sum(wall) / world, wall_max=max(wall))
    out["startup_store_ops_per_rank_max"] = max(r["startup_store_ops"] for r in ranks)
    out["startup_store_keys_per_rank_max"] = max(r["startup_store_keys"] for r in ranks)
    out["store_ops_per_rank_per_s"] = max(r["steady_ops_per_s"] for r in ranks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="4,8,16")
    ap.add_argument("--ranks-per-node", type=int, default=0)
    ap.add_argument("--steady-s", type=float, default=5.0)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_out:
        return rank_main(a.rank_out, a.ranks_per_node, a.steady_s)
    sys.path.insert(0, str(REPO))
    from wideep.launch.cli.local import run_local_ranks
    results = {}
    for world in [int(w) for w in a.worlds.split(",")]:
        with tempfile.TemporaryDirectory(prefix="wideep-startup-") as d:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-out", d,
                   "--ranks-per-node", str(a.ranks_per_node), "--steady-s", str(a.steady_s)]
            rc = run_local_ranks([], world, timeout_s=600, cmd=cmd)
            if rc:
                raise SystemExit(f"{world} ranks failed (exit status {rc})")
            results[str(world)] = summarize(d, world)
        print(f"\n{world} ranks (CPU s mean/max, wall s mean/max):")
        for p in PHASES:
            r = results[str(world)][p]
            print(f"  {p:20s} cpu {r['cpu_mean']:7.3f} / {r['cpu_max']:7.3f}   wall {r['wall_mean']:7.3f} / {r['wall_max']:7.3f}")
        print(f"  watchdog store ops per rank: {results[str(world)]['startup_store_ops_per_rank_max']} at start-up, "
              f"{results[str(world)]['store_ops_per_rank_per_s']:.3f}/s steady", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
