"""Two namespace hosts x 2 ranks over tbf-shaped links vs one host x 4 ranks: throughput, wire bytes, DBO.

Every run is `wideep run` launched as users launch it: on the cluster, `torchrun --nnodes 2
--nproc-per-node 2` inside each namespace host (launch/cluster/torchrun.py), gloo on each host's wire;
the baseline is 4 local ranks on this machine's loopback (launch/cli/local.py's spawner; no namespace,
no shaping: intra-host traffic as one real host would have it). Same tiny DeepSeek-V3
checkpoint (make_tiny_checkpoint, as tests/launch/test_cluster_torchrun.py), DP attention + EP, greedy.
Two workloads: prefill (long prompts, max_tokens 1: prompt tokens/s) and decode (short prompts, many
new tokens: generated tokens/s). `wideep run` times its generate after a warm-up and counts each
host's wire bytes around it (launch/cluster/window.py), so start-up is never in a figure.

Per rate (a fresh 2-host cluster each, torn down even on failure):
  prefill/decode tok/s of the two-level ("hierarchical") dispatch, vs the 1x4 baseline (x_vs_1x4);
  wire_over_computed: bytes on the inter-host wires (each byte once, as sent) during the generation /
    (dispatcher's inter-node payload + its reported inter-node metadata), both runs together:
    "tcp_payload" (frame headers taken off, as the harness counts) and "all_bytes" (ACKs and headers too).
At the slowest rate also: flat ("torch") vs two-level dispatch on the prefill workload (wire bytes,
computed bytes, elapsed), and DBO on vs off on the prefill workload (dbo_prefill_ratio = on / off).
Every run's outputs are compared with the 1x4 baseline's (outputs_equal).

    python bench/multinode.py [--quick] [--rates 1gbit,25gbit]
Each figure is the median (by elapsed time) of REPS launches. Full run (default): rates 1gbit,5gbit,25gbit;
prefill 32 prompts x ~512 tokens; decode 32 x ~16 tokens, 128 new; 5 launches per figure. --quick: rates
1gbit,25gbit; prefill 16 x ~256; decode 16 x ~16, 48 new; 3 launches per figure. Needs root (namespaces).
Last line: JSON; saved through bench/results.py as multinode[_quick].json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.results import save  # noqa: E402

CONFIG = """
[model]
path = "{path}"

[parallel]
dispatch_backend = "{backend}"
timeout_s = 60

[engine]
block_size = 16

[dbo]
enabled = {dbo}

[run]
prompt_ids = {prompts}
max_tokens = {max_tokens}
temperature = 0.0
"""
# workload -> (prompts, prompt tokens, max_tokens), full and --quick
WORKLOADS = {False: {"prefill": (32, 512, 1), "decode": (32, 16, 128)},
             True: {"prefill": (16, 256, 1), "decode": (16, 16, 48)}}
REPS = {False: 5, True: 3}   # launches per figure; the median by elapsed time is reported
RATES = {False: "1gbit,5gbit,25gbit", True: "1gbit,25gbit"}
RUN_TIMEOUT_S = 300
FAILED: list[dict] = []   # runs that failed and were run again (once): in the JSON, never hidden


def parse_rates(text: str) -> list[str]:
    """"1gbit,5gbit" -> rates sorted slowest first; ValueError naming a bad or repeated one."""
    from wideep.launch.cluster import rate_bits
    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    if not rates:
        raise ValueError(f"--rates needs at least one link rate (e.g. 1gbit,25gbit), got {text!r}")
    bits = [rate_bits(r) for r in rates]
    if len(set(bits)) != len(bits):
        raise ValueError(f"--rates names a rate twice: {text!r}")
    return [r for _, r in sorted(zip(bits, rates))]


def prompts_for(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 2 for j in range(length + 4 * i)] for i in range(n)]


def write_config(d: str, name: str, ckpt: str, workload: tuple, backend: str = "hierarchical",
                 dbo: bool = False) -> str:
    n, length, max_tokens = workload
    path = os.path.join(d, f"{name}.toml")
    with open(path, "w") as f:
        f.write(CONFIG.format(path=ckpt, backend=backend, dbo=str(dbo).lower(),
                              prompts=json.dumps(prompts_for(n, length)), max_tokens=max_tokens))
    return path


def _parse(text: str) -> tuple[dict, list[list[int]]]:
    """`wideep run`'s summary line and its outputs (prompt order)."""
    lines = text.splitlines()
    summary = json.loads([x for x in lines if x.startswith('{"ranks"')][-1])
    rows = sorted((json.loads(x) for x in lines if x.startswith('{"index"')), key=lambda r: r["index"])
    return summary, [r["token_ids"] for r in rows]


def _wait(procs: list[subprocess.Popen], logs: list, what: str) -> list[str]:
    """Every agent's output; an agent past the deadline is killed with its ranks (its process group)."""
    from tests.launch.clusters import wait_agents
    rcs = wait_agents(procs, timeout_s=RUN_TIMEOUT_S)
    text = []
    for f in logs:
        f.seek(0)
        text.append(f.read())
        f.close()
    if rcs != [0] * len(procs):
        tails = "\n".join(f"--- node {i} ---\n{t[-3000:]}" for i, t in enumerate(text))
        raise RuntimeError(f"{what}: agents exited {rcs} (None = killed at {RUN_TIMEOUT_S}s)\n{tails}")
    return text


def run_local(cfg: str) -> tuple[dict, list]:
    """1 host x 4 ranks: the project's local spawner (launch/cli/local.py), gloo on the loopback."""
    from wideep.launch.cli.local import run_local_ranks
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # no wire device: `wideep run` counts no wire bytes
    rc, text = run_local_ranks(["run", "--config", cfg], 4, timeout_s=RUN_TIMEOUT_S, capture=True)
    if rc:
        raise RuntimeError(f"1x4 {os.path.basename(cfg)}: a rank exited {rc} (124 = killed at {RUN_TIMEOUT_S}s)"
                           f"\n{text[-3000:]}")
    return _parse(text)


def run_cluster(cluster, cfg: str, d: str) -> tuple[dict, list]:
    """2 hosts x 2 ranks: one torchrun agent per namespace host; rank 0 (host 0) prints the summary."""
    from wideep.launch.cluster.torchrun import start_torchrun
    logs = [tempfile.TemporaryFile("w+", dir=d) for _ in cluster.hosts]
    procs = start_torchrun(cluster, ["-m", "wideep.launch", "run", "--config", cfg], nproc_per_node=2,
                           rdzv_id=f"bench{os.getpid()}", extra_env={"PYTHONPATH": ROOT}, cwd=ROOT,
                           stdout=lambda n: logs[n], stderr=subprocess.STDOUT, text=True)
    return _parse(_wait(procs, logs, f"2x2 at {cluster.rate} {os.path.basename(cfg)}")[0])


def median_of(reps: int, fn, *args) -> tuple[dict, list, list[float]]:
    """reps runs of retried(fn, *args) -> the median run's (summary, outputs) (by elapsed time) and every
    run's elapsed time; every run's outputs must equal the first's."""
    runs = [retried(fn, *args) for _ in range(reps)]
    if any(o != runs[0][1] for _, o in runs):
        cfg = [x for x in args if isinstance(x, str) and x.endswith(".toml")]
        raise RuntimeError(f"{fn.__name__} {cfg}: outputs differ between launches of the same config")
    runs.sort(key=lambda r: r[0]["elapsed_s"])
    mid = dict(runs[len(runs) // 2][0], elapsed_runs_s=[r[0]["elapsed_s"] for r in runs])
    return mid, runs[0][1], mid["elapsed_runs_s"]


def retried(fn, *args) -> tuple[dict, list]:
    """fn(*args), run again once if it fails (a rank aborting at exit was seen, rarely: the first
    failure's reason goes to the JSON's failed_runs)."""
    try:
        return fn(*args)
    except RuntimeError as e:
        lines = str(e).splitlines()
        why = [x for x in lines if "terminate called" in x or "Error" in x or "exitcode" in x][:3]
        FAILED.append({"run": lines[0], "why": why})
        print(f"multinode: {lines[0]}; running it again", file=sys.stderr, flush=True)
        return fn(*args)


def bytes_of(summary: dict) -> dict:
    """Wire bytes (each counted once, as sent) and the dispatcher's computed inter-node bytes."""
    per_rank = summary["dispatch_per_rank"]
    payload = sum(s.get("dispatch_bytes_inter", 0) + s.get("combine_bytes_inter", 0) for s in per_rank)
    meta = sum(s.get("meta_bytes_inter", 0) for s in per_rank)
    w = summary.get("wire") or {}
    return {"wire_bytes": sum(w.get("sent_per_node", [0])),
            "wire_tcp_payload": sum(w.get("sent_payload_per_node", [0])),
            "computed_payload": payload, "computed_meta": meta}


def figures(summary: dict, phase: str, workload: tuple) -> dict:
    n, length, _ = workload
    tokens = (sum(length + 4 * i for i in range(n)) if phase == "prefill" else summary["generated_tokens"])
    return {"elapsed_s": summary["elapsed_s"], "elapsed_runs_s": summary.get("elapsed_runs_s"),
            "tok_s": round(tokens / summary["elapsed_s"], 1), **bytes_of(summary)}


def ratio(parts: list[dict], key: str) -> float:
    computed = sum(p["computed_payload"] + p["computed_meta"] for p in parts)
    return round(sum(p[key] for p in parts) / computed, 4) if computed else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rates", default=None, help="link rates, tc spelling, comma-separated (default: by --quick)")
    a = ap.parse_args(argv)
    try:
        rates = parse_rates(a.rates if a.rates is not None else RATES[a.quick])
    except ValueError as e:
        ap.error(str(e))
    from wideep.launch.cluster import Cluster, ClusterSpec
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    work, reps = WORKLOADS[a.quick], REPS[a.quick]
    t_start = time.perf_counter()
    out: dict = {"quick": a.quick, "rates": rates, "reps": reps,
                 "baseline": "1 host x 4 ranks: local ranks (launch/cli/local.py) on loopback",
                 "workloads": {k: dict(zip(("prompts", "prompt_tokens", "max_tokens"), v)) for k, v in work.items()}}
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "m")
        make_tiny_checkpoint(ckpt, arch="v3", seed=4)
        cfgs = {ph: write_config(d, ph, ckpt, work[ph]) for ph in work}
        ref, base = {}, {}
        for ph in work:
            s, ref[ph], _ = median_of(reps, run_local, cfgs[ph])
            base[ph] = figures(s, ph, work[ph])
        out["1x4"] = {ph: {k: f[k] for k in ("elapsed_s", "elapsed_runs_s", "tok_s")} for ph, f in base.items()}
        equal = True
        out["per_rate"], out["wire_over_computed"] = {}, {}
        for i, rate in enumerate(rates):
            with Cluster.up(ClusterSpec(nodes=2, rate=rate), owner_pid=os.getpid()) as c:
                row = {}
                for ph in work:
                    s, got, _ = median_of(reps, run_cluster, c, cfgs[ph], d)
                    equal &= got == ref[ph]
                    row[ph] = figures(s, ph, work[ph])
                    row[ph]["x_vs_1x4"] = round(row[ph]["tok_s"] / base[ph]["tok_s"], 3)
                out["per_rate"][rate] = row
                out["wire_over_computed"][rate] = {"tcp_payload": ratio(list(row.values()), "wire_tcp_payload"),
                                                   "all_bytes": ratio(list(row.values()), "wire_bytes")}
                if i == 0:   # the slowest rate: flat vs two-level, DBO on vs off (prefill workload)
                    flat_cfg = write_config(d, "prefill_flat", ckpt, work["prefill"], backend="torch")
                    s, got, _ = median_of(reps, run_cluster, c, flat_cfg, d)
                    equal &= got == ref["prefill"]
                    flat = figures(s, "prefill", work["prefill"])
                    two = row["prefill"]
                    out["flat_vs_two_level"] = {
                        "rate": rate, "flat": flat, "two_level": two,
                        "wire_bytes_flat_over_two_level": round(flat["wire_bytes"] / two["wire_bytes"], 3),
                        "time_flat_over_two_level": round(flat["elapsed_s"] / two["elapsed_s"], 3)}
                    dbo_cfg = write_config(d, "prefill_dbo", ckpt, work["prefill"], dbo=True)
                    s, got, _ = median_of(reps, run_cluster, c, dbo_cfg, d)
                    equal &= got == ref["prefill"]
                    on = figures(s, "prefill", work["prefill"])
                    out["dbo"] = {"rate": rate, "prefill_off_s": two["elapsed_s"], "prefill_on_s": on["elapsed_s"],
                                  "prefill_on_runs_s": on["elapsed_runs_s"]}
                    out["dbo_prefill_ratio"] = round(on["elapsed_s"] / two["elapsed_s"], 3)
            if c.leftovers():
                raise RuntimeError(f"cluster {c.prefix} left {c.leftovers()} behind")
        out["outputs_equal"] = equal
    out["failed_runs"] = FAILED
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    save("multinode_quick" if a.quick else "multinode", out)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
