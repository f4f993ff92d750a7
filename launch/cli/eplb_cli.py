"""`wideep eplb-plan` (offline placement from recorded loads) and `wideep eplb-report` (a PNG).

Both read a stats file as EplbController.dump_stats() writes it:
    {"load": [[...E] per MoE layer], "phy2log": [[...P] per layer] (the placement it ran with, optional),
     "ep_size": N, "num_groups": G, "num_nodes": n}            (the last three optional; flags override)
eplb-plan writes a placement file ({"phy2log": ...} + summary), which `eplb.initial_placement`
accepts; eplb-report draws the expert-load heatmap per layer and the per-rank load before/after.
"""
from __future__ import annotations

import json
import time

import torch

from wideep.parallel.expert_layout import ExpertLayout


def _read_stats(path: str) -> dict:
    from wideep.eplb.placement import read_json
    stats = read_json(path, "load stats")
    if not isinstance(stats, dict) or "load" not in stats:
        raise ValueError(f"load stats {path!r} need a \"load\" key: [moe_layers][experts]")
    load = torch.tensor(stats["load"], dtype=torch.float64)
    if load.dim() != 2 or (load < 0).any():
        raise ValueError(f"\"load\" in {path!r} must be a non-negative [moe_layers][experts] table, "
                         f"got shape {list(load.shape)}")
    stats["load"] = load
    return stats


def plan(stats: dict, ep_size: int | None = None, num_redundant_experts: int | None = None,
         num_groups: int | None = None, num_nodes: int | None = None, policy: str = "auto",
         from_scratch: bool = False) -> dict:
    """-> {"current": Placement | None, "new": Placement, "summary": dict} for a stats dict."""
    from wideep.eplb import Placement, balancedness, moved_slots
    from wideep.eplb.rebalancer import plan_placement
    load = stats["load"]
    L, E = load.shape
    current = Placement.from_phy2log(stats["phy2log"], E) if stats.get("phy2log") is not None else None
    if current is not None and current.num_layers != L:
        raise ValueError(f"\"phy2log\" has {current.num_layers} layers, \"load\" {L}")
    ep = ep_size or stats.get("ep_size") or 1
    if num_redundant_experts is not None:
        P = E + num_redundant_experts
    else:
        P = current.num_physical if current is not None else E
    ExpertLayout.check(P, ep, what="experts + redundant slots", count=f"{E} + {P - E} = {P}")
    groups = num_groups or stats.get("num_groups") or 1
    nodes = num_nodes or stats.get("num_nodes") or 1
    if current is None or current.num_physical != P:   # no usable placement to migrate from
        current, known = Placement.initial(L, E, P), False
    else:
        known = True
    t0 = time.perf_counter()
    new = plan_placement(load, current, ep, groups, nodes, policy, migration_aware=known and not from_scratch)
    summary = {"layers": L, "experts": E, "physical": P, "ep_size": ep, "policy": policy,
               "plan_s": round(time.perf_counter() - t0, 4),
               "balancedness_before": balancedness(load, current.phy2log, ep).tolist(),
               "balancedness_after": balancedness(load, new.phy2log, ep).tolist(),
               "slots_moved": int(moved_slots(current.phy2log, new.phy2log).sum()),
               "before": "stats phy2log" if known else "initial placement (slot p -> expert p % E)"}
    return {"current": current, "new": new, "summary": summary}


def draw_report(load: torch.Tensor, before, after, ep_size: int, out: str, title: str = "") -> str:
    """PNG: expert load per layer (heatmap), expected load per EP rank before/after (heatmaps on one
    colour scale, balancedness per layer in the labels). before/after: phy2log [L, P]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wideep.eplb import balancedness
    from wideep.eplb.placement import rank_load
    load = torch.as_tensor(load, dtype=torch.float64)
    rb, ra = rank_load(load, before, ep_size), rank_load(load, after, ep_size)
    bb, ba = balancedness(load, torch.as_tensor(before), ep_size), balancedness(load, torch.as_tensor(after), ep_size)
    L, E = load.shape
    fig, axes = plt.subplots(1, 3, figsize=(7 + E / 8 + ep_size / 2, 2 + 0.35 * L),
                             gridspec_kw={"width_ratios": [max(E, 4), max(ep_size, 2), max(ep_size, 2)]})
    im = axes[0].imshow(load.numpy(), aspect="auto", cmap="viridis")
    axes[0].set(title="expert load (tokens)", xlabel="logical expert", ylabel="MoE layer")
    fig.colorbar(im, ax=axes[0], fraction=0.04)
    vmax = float(max(rb.max(), ra.max()))
    for ax, rl, bal, name in ((axes[1], rb, bb, "before"), (axes[2], ra, ba, "after")):
        im = ax.imshow(rl.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set(title=f"rank load {name}\nbalanced {float(bal.mean()):.3f}", xlabel="EP rank")
        ax.set_yticks(range(L), [f"{b:.2f}" for b in bal.tolist()])
        ax.set_xticks(range(ep_size))
    fig.colorbar(im, ax=axes[2], fraction=0.08)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def cmd_plan(a) -> None:
    res = plan(_read_stats(a.load), a.ep_size, a.num_redundant_experts, a.num_groups, a.num_nodes, a.policy,
               a.from_scratch)
    s = res["summary"]
    if a.out:
        res["new"].save(a.out, **s)
        s = dict(s, out=a.out)
    print(json.dumps(s))


def cmd_report(a) -> None:
    from wideep.eplb import Placement
    stats = _read_stats(a.load)
    ep = a.ep_size or stats.get("ep_size") or 1
    if a.placement:
        with open(a.placement) as f:
            after = Placement.from_phy2log(json.load(f)["phy2log"], stats["load"].shape[1])
        before = (Placement.from_phy2log(stats["phy2log"], stats["load"].shape[1]) if stats.get("phy2log")
                  else Placement.initial(after.num_layers, after.num_experts, after.num_physical))
    else:
        res = plan(stats, ep, a.num_redundant_experts)
        before, after = res["current"], res["new"]
    draw_report(stats["load"], before.phy2log, after.phy2log, ep, a.out, title=a.title or a.load)
    print(json.dumps({"out": a.out}))


def add_parsers(sub) -> None:
    """Register eplb-plan and eplb-report on the `wideep` subcommand parser."""
    p = sub.add_parser("eplb-plan", help="plan an expert placement offline from recorded loads (JSON)")
    p.add_argument("--load", required=True, help="stats JSON: {\"load\": [[...]], \"phy2log\": ..., \"ep_size\": N}")
    p.add_argument("--ep-size", type=int, help="EP ranks (default: the stats' ep_size, else 1)")
    p.add_argument("--num-redundant-experts", type=int,
                   help="replica slots per layer (default: as in the stats' phy2log, else 0)")
    p.add_argument("--num-groups", type=int, help="expert groups (n_group; default: the stats', else 1)")
    p.add_argument("--num-nodes", type=int, help="nodes (default: the stats', else 1)")
    p.add_argument("--policy", choices=["auto", "hierarchical", "global"], default="auto")
    p.add_argument("--from-scratch", action="store_true", help="ignore the stats' placement (move freely)")
    p.add_argument("--out", help="write the placement here (usable as eplb.initial_placement)")
    p.set_defaults(fn=cmd_plan)
    r = sub.add_parser("eplb-report", help="PNG: expert load heatmap, per-rank load before/after a placement")
    r.add_argument("--load", required=True, help="stats JSON as for eplb-plan")
    r.add_argument("--placement", help="placement JSON to show as 'after' (default: plan one now)")
    r.add_argument("--ep-size", type=int)
    r.add_argument("--num-redundant-experts", type=int)
    r.add_argument("--title")
    r.add_argument("--out", default="eplb_report.png")
    r.set_defaults(fn=cmd_report)
