"""Model families: the interface the engine knows instead of the models. The MLA family (DeepSeek-V2/V3/V3.2,
GLM-4.x-MoE-lite, Kimi-K2.5's text model: engine/model/mla_family.py) and DeepSeek-V4 (engine/model/v4_family.py)
implement it, families.py picks one from the config, and the next family plugs in here. The engine (engine/worker,
engine/sched, engine/front), disagg/, kvstore/ and eplb/ call this interface, never a family's classes:

    family = family_of(model_config)        (engine/model/families.py: the one place that picks)
    family.check(engine_config)              what the family does not serve: ValueError naming the model and the
                                             feature, raised at construction on every rank (the config is the same)
    family.refusal(feature)                  the same for a caller's feature ("disaggregation with MTP", ...): the
                                             reason or None
    loaded = family.load(engine_config, ctx, device, progress)      Loaded: the model, the MTP drafter's layer
    kv = family.kv_cache(engine_config, loaded, max_model_len)      the KV streams as paged pools: the KVCache
                                             interface (engine/model/mla_cache.py lists it), each a family's; its
                                             `spec` declares the streams (kvstore/spec.py KVSpec)
    blocks = family.block_manager(engine_config, kv, store, log, whole_chunks)      engine/sched/block_manager.py's
                                             BlockManager over kv.spec, with the family's pool sizes and slots
    store = family.kv_store(engine_config, kv, log, prefer)         kvstore/store.py's TieredStore over kv.spec:
                                             the host/disk tiers of every stream
    drafter = family.drafter(loaded, kv, k)  speculative method "mtp": engine/spec_decode/drafter.MTPDrafter
    family.expert_groups(loaded)             the routed experts by placement (ExpertGroup): what EPLB rebalances and
                                             what recovery after a lost rank re-lays over the survivors
    family.reader(model_dir)                 the checkpoint as the family names its tensors
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ARCH_NAMES = {"v2": "DeepSeek-V2", "v3": "DeepSeek-V3", "v32": "DeepSeek-V3.2", "glm4_moe_lite": "GLM-4.x-MoE-lite",
              "v4": "DeepSeek-V4"}


@dataclass
class Loaded:
    """What a family's load gives the engine: the model, and the layer the MTP drafter runs (None without method
    "mtp"; DeepSeek-V4: its model's MTP block, which the model holds)."""
    model: torch.nn.Module
    draft: object | None = None


@dataclass
class ExpertGroup:
    """Routed experts that share one placement: MoE layers, in EPLB's order. names(experts, l, e, slot) -> the
    checkpoint names of logical expert e of layer l (an index into `layers`) -> views into local `slot` of `experts`
    (moe/experts.py), as the family's checkpoint spells them. rebalanced: EPLB moves this group (the decoder layers);
    the MTP layers keep their own initial placement, which recovery alone re-lays."""
    name: str
    layers: list
    names: Callable[[object, int, int, int], dict]
    routing: object                       # parallel/expert_routing.ExpertRouting the layers read
    placement: object                     # eplb.placement.Placement, [len(layers), P]
    rebalanced: bool = False


class ModelFamily:
    """The interface; each method raises here. Subclasses say what they serve in REFUSED (feature -> why)."""

    REFUSED: dict[str, str] = {}

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def model_name(self) -> str:
        base = ARCH_NAMES.get(self.cfg.arch, self.cfg.arch)
        return base if self.cfg.wrapper is None else f"{base} ({self.cfg.wrapper})"

    def refusal(self, feature: str) -> str | None:
        """Why this family does not serve `feature` (a key of REFUSED), or None when it does."""
        return self.REFUSED.get(feature)

    def refuse(self, feature: str, detail: str = "") -> None:
        """Raise the refusal of `feature` when the family has one."""
        why = self.refusal(feature)
        if why is not None:
            raise ValueError(f"{self.model_name} does not support {feature}{detail}: {why}")

    def check(self, cfg) -> None:
        """The engine options this family refuses (EngineConfig `cfg`)."""
        raise NotImplementedError

    def load(self, cfg, ctx, device, progress: bool) -> Loaded:
        raise NotImplementedError

    def kv_cache(self, cfg, loaded: Loaded, max_model_len: int):
        raise NotImplementedError

    def block_manager(self, cfg, kv, store, log, whole_chunks: bool):
        raise NotImplementedError

    def kv_store(self, cfg, kv, log, prefer: int):
        raise NotImplementedError

    def drafter(self, loaded: Loaded, kv, k: int):
        raise NotImplementedError

    def expert_groups(self, loaded: Loaded) -> list[ExpertGroup]:
        raise NotImplementedError

    def reader(self, model_dir: str):
        raise NotImplementedError
