"""Online EPLB for one model on one rank: record load while serving, rebalance every step_interval.

    model = load_model(..., ctx=ctx, eplb=cfg)       # placement with cfg's redundant slots
    ctl = EplbController(model, ctx, cfg)            # hooks the recorder into the MoE layers
    each engine step, on every rank, after the forward (dummy steps included, num_tokens = 0):
        ctl.after_step(num_tokens)                   # collective on rebalance steps
    ctl.rebalance()                                  # collective: plan + move + swap now
    ctl.metrics                                      # dict, see below

Every rank must make the same calls in the same order: the step counter is the schedule. A
rebalance all-reduces the recorded window over the EP group, plans (same plan on every rank),
stages the moving weights (all layers at once, or transfer_layers_per_step per step while the
model keeps serving on the old placement), then swaps weights + maps on every rank at one step.
Legend: L MoE layers, E logical experts, P physical slots, ep EP ranks.
"""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from wideep.eplb.algorithm import balancedness
from wideep.eplb.config import EplbConfig
from wideep.eplb.rebalancer import Rebalance, plan_placement
from wideep.eplb.recorder import LoadRecorder
from wideep.parallel.watchdog import guard_collective


class EplbController:
    def __init__(self, model, ctx, cfg: EplbConfig | dict | None = None):
        self.cfg = EplbConfig.coerce(cfg)
        self.model, self.ctx = model, ctx
        self.layers = model.moe_layers()
        if not self.layers or model.placement is None:
            raise ValueError("EPLB needs a model with MoE layers built by engine.model.families.load_model")
        p = model.placement
        self.ep_rank, self.ep_size = ctx.ep_rank, ctx.ep_size
        self.num_groups = model.cfg.moe.n_group
        self.num_nodes = ctx.num_nodes  # the EP group is the world, laid out node-major (parallel/topology.py)
        if self.cfg.policy == "hierarchical" and self.num_groups % self.num_nodes:
            raise ValueError(f"eplb.policy = 'hierarchical' needs n_group ({self.num_groups}) divisible by the "
                             f"number of nodes ({self.num_nodes}); use 'auto' or 'global'")
        self.device = model.device
        self.recorder = LoadRecorder(p.num_layers, p.num_physical, p.num_experts, self.cfg.window_size,
                                     self.ep_size, self.device)
        model.routing.record_into([self.recorder.layer_counts(l) for l in range(len(self.layers))])
        self._phy2log = p.phy2log.to(self.device)     # [L, P] the live placement, for the recorder
        self.steps = 0
        self._job: Rebalance | None = None
        self._record: dict | None = None
        self.history: list[dict] = []

    @property
    def placement(self):
        return self.model.placement

    # -- the engine's per-step call ----------------------------------------------------------------
    def after_step(self, num_tokens: int) -> dict | None:
        """Close step `steps` (num_tokens: this rank's tokens; 0 for a dummy step). Every
        step_interval steps a rebalance starts; returns its metrics on the step it takes effect."""
        self.recorder.end_step(num_tokens, self._phy2log)
        self.steps += 1
        if self._job is None and self.steps % self.cfg.step_interval == 0:
            self._begin(None)
        if self._job is None:
            return None
        self._job.stage(self.cfg.transfer_layers_per_step or None)
        return self._finish() if self._job.staged else None

    def rebalance(self, load: torch.Tensor | None = None) -> dict | None:
        """Collective: plan from the recorded window (or `load` [L, E], the same on every rank),
        move and swap now; a rebalance already staging is finished first. Returns the metrics, or
        None when there is no load to plan from."""
        if self._job is not None:
            self._job.stage()
            self._finish()
        if not self._begin(load):
            return None
        self._job.stage()
        return self._finish()

    # -- collectives over the EP group ---------------------------------------------------------------
    def global_load(self) -> torch.Tensor:
        """[L, E] int64 CPU: the window summed over the EP ranks (collective)."""
        self.recorder.flush(self._phy2log)
        return self._all_reduce(self.recorder.window_load())

    def local_window_load(self) -> torch.Tensor:
        """[L, E] this rank's recorded window alone (no collective: recovery reads it before the ranks re-form)."""
        self.recorder.flush(self._phy2log)
        return self.recorder.window_load()

    def rank_load(self) -> torch.Tensor:
        """[L, ep] int64 CPU: (token, expert) pairs each EP rank received since
        recorder.reset_rank_load(), summed over the senders (collective)."""
        self.recorder.flush(self._phy2log)
        return self._all_reduce(self.recorder.rank_load)

    def dump_stats(self, path: str | None) -> dict:
        """Collective: the global window load and the live placement, as `wideep eplb-plan` and
        `wideep eplb-report` read them; written to `path` by EP rank 0 (when given)."""
        stats = {"load": self.global_load().tolist(), "phy2log": self.placement.phy2log.tolist(),
                 "ep_size": self.ep_size, "num_groups": self.num_groups, "num_nodes": self.num_nodes}
        if path and self.ep_rank == 0:
            with open(path, "w") as f:
                json.dump(stats, f)
        return stats

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to("cpu", torch.int64, copy=True)  # SYNC: rebalance/report only, not per step
        if self.ep_size > 1 and not self.ctx.is_single:
            with guard_collective(self.ctx):
                dist.all_reduce(out, group=self.ctx.cpu_group)
        return out

    # -- one rebalance ---------------------------------------------------------------------------------
    def _begin(self, load: torch.Tensor | None) -> bool:
        t0 = time.perf_counter()
        load = self.global_load() if load is None else torch.as_tensor(load).to("cpu", torch.int64)
        if int(load.sum()) == 0:  # nothing recorded anywhere (same verdict on every rank)
            return False
        old = self.placement
        new = plan_placement(load, old, self.ep_size, self.num_groups, self.num_nodes, self.cfg.policy,
                             self.cfg.migration_aware)
        before, after = balancedness(load, old.phy2log, self.ep_size), balancedness(load, new.phy2log, self.ep_size)
        self._job = Rebalance(self.layers, old, new, self.ctx, self.model.routing)
        self._record = {"planned_at_step": self.steps, "window_pairs": int(load.sum()),
                        "balancedness_before": before.tolist(), "balancedness_after": after.tolist(),
                        "balancedness_before_mean": float(before.mean()),
                        "balancedness_after_mean": float(after.mean()),
                        "plan_s": time.perf_counter() - t0}
        return True

    def _finish(self) -> dict:
        job, rec = self._job, self._record
        job.commit()   # the model's routing now holds job.new (model.placement reads it)
        self._phy2log = job.new.phy2log.to(self.device)
        self._job = self._record = None
        rec.update(job.stats(), step=self.steps)
        rec["total_s"] = rec["plan_s"] + rec["transfer_s"] + rec["swap_s"]
        self.history.append(rec)
        return rec

    @property
    def rebalancing(self) -> bool:
        """True while a rebalance is staging (the old placement still serves)."""
        return self._job is not None

    @property
    def metrics(self) -> dict:
        """steps, rebalances, totals, and the last rebalance: per-layer balancedness of the
        planning window before/after, slots and bytes moved (all ranks; this rank's share),
        wall time split plan / transfer / swap."""
        return {"steps": self.steps, "rebalances": len(self.history),
                "total_slots_moved": sum(r["slots_moved"] for r in self.history),
                "total_bytes_moved": sum(r["bytes_moved"] for r in self.history),
                "last": self.history[-1] if self.history else None}

    def detach(self) -> None:
        """Stop recording (the placement stays)."""
        self.model.routing.record_into(None)
