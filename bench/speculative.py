"""Speculative decoding, n-gram and MTP drafts: decode tok/s and TPOT with k = 1, 2, 3 drafts vs none.

Four workloads, each at batch 1, 8 and 32 (all requests arrive together; prefix caching off on every
engine, the same threads, dtype and batch for every k):
- "ngram": launch/tiny/cycle.py's model (its greedy continuation follows a fixed cycle of tokens; `--ngram-mix`
  small: it never leaves it) and prompts that hold the cycle: the n-gram drafts are right.
- "mtp": a cycle model perturbed more (`--mix`: its own greedy tokens leave the cycle now and then) with
  an MTP layer built to predict the cycle (launch/tiny/cycle.py mtp=True): the checkpoint's own MTP
  drafts, mostly right (DeepSeek-V3 reports 85-90 % for its MTP module).
- "ngram_rejected": a random model and prompts over a 12-token alphabet, so n-gram drafts are proposed
  often and almost always rejected (the worst case for drafting's cost: the backoff must hold it).
- "mtp_rejected": the cycle target with an MTP layer that mostly reads a random map of the hidden state
  (`mtp_hidden` 20): its drafts are almost always wrong; backing off, a sequence's MTP rows wait in its
  stash, and once the rank has seen drafts fail new sequences start retired (one probe in eight).
  Engines are reused across batch sizes and trials, so a rank's memory of failing drafts carries over,
  as it does on a server.
Targets (issue 29): >= 1.5x decode tok/s at batch 1 with >= 70 % acceptance; within 5 % of no
speculation where acceptance is near zero. The MTP layer's cost is one decoder layer + the head per
pass: here one layer beside 12 (DeepSeek-V3: beside 61), so MTP's share of a step is ~5x V3's. The model runs
float32; its MTP layer's weights are bfloat16 (`--draft-dtype`, speculative draft_dtype: half the bytes a pass reads,
the rows and the drafts' latents float32; outputs stay exact, the target verifies them).
Each k runs on its own engine (one copy of the weights for all: SharedWeights, its MTP layer in --draft-dtype).
A trial runs the same requests on every engine at once, in lockstep (lockstep(): the engines take one step each in
turn, the first to step rotating), each engine timing its own steps: every k meets the same seconds of the machine's
drifting speed. TPOT: each request's time in its engine's steps from its first token to its last, over its tokens
after the first (in one process an engine does nothing between its steps: what the engine metrics' TPOT measures;
checked in one process on this workload at batch 1, lockstep's TPOTs within 1 % of runs one engine at a time),
median over requests (over 9 trials: the median); decode tok/s = batch / mean TPOT. speedup: paired, the median
over trials of that trial's k = 0 mean TPOT over its k one (its range beside it). Greedy outputs of every k are
checked equal to k = 0's.

    python bench/speculative.py [--batches 1,8,32] [--ks 1,2,3] [--new 64] [--trials 9] [--threads 1]
                                [--workloads ngram,mtp,ngram_rejected,mtp_rejected] [--quick] [--model v3|v4]
                                [--draft-dtype float32|bfloat16]

--model v4: the same four workloads on DeepSeek-V4 (launch/tiny/cycle.py make_v4_cycle_checkpoint, its MTP block
built the same way; V4_MODEL below: 8 layers of sliding / CSA / HCA attention, the torch ops); the random model of
"ngram_rejected" is launch/tiny/v4.py's. Saved as speculative_v4.

Last line (JSON): {"workloads": {name: {"batch": {B: {"k": {k: {"tpot_ms", "decode_tok_s", "speedup",
"speedup_range", "acceptance", "mean_acceptance_length", "backoffs"}}}}}}, "targets": {...}, "model": {...},
"mtp_draft_dtype"}
"""
from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import save  # noqa: E402

_REQ = itertools.count()   # lockstep's request ids

# 12 layers (11 MoE) so that the MTP layer is one layer beside 12, not beside 4 (DeepSeek-V3: beside 61)
MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, moe_intermediate_size=256,
             num_hidden_layers=12, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=4, max_position_embeddings=2048,
             initializer_range=0.05)
# DeepSeek-V4 (launch/tiny/v4.py overrides): 8 layers, the MTP block one sliding-window layer beside them
V4_MODEL = dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
                head_dim=64, q_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4, sliding_window=64, o_groups=2,
                o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=16, qk_rope_head_dim=16,
                layer_types=["sliding_attention", "sliding_attention"]
                + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
                mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, max_position_embeddings=2048)
V4_QUICK = dict(V4_MODEL, num_hidden_layers=5, layer_types=V4_MODEL["layer_types"][:5],
                mlp_layer_types=V4_MODEL["mlp_layer_types"][:5])
QUICK = dict(MODEL, hidden_size=256, intermediate_size=1024, moe_intermediate_size=128, q_lora_rank=128,
             kv_lora_rank=64, n_routed_experts=16, num_hidden_layers=4)


def prompts(workload: str, nxt: list[int], batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if workload == "repeats":   # else "alphabet"
            t, p = rng.randrange(len(nxt)), []
            for _ in range(length):
                p.append(t)
                t = nxt[t]
        else:
            p = [rng.randrange(2, 14) for _ in range(length)]
        out.append(p)
    return out


class SharedWeights:
    """The engines of one workload (k = 0, 1, 2, 3) read one copy of the weights: engine/worker/core.py's load_model,
    replaced while they are built, loads a checkpoint once (its MTP layer too when `mtp`) and gives every engine that
    model; one without speculation gets a shallow copy without the MTP drafter (the same parameters). Measured here
    (three engines without speculation, one thread, batch 1, 8 alternating trials): with a copy each, their forwards
    differed by up to 4-6 % between runs, with which engine was fastest changing; sharing one copy, within ~1-2 %.
    Where each engine's weights lie in memory is not what a speculation ratio should measure."""

    def __init__(self, mtp: bool, mtp_dtype: str | None = None):
        """mtp_dtype: the MTP layer's (speculative draft_dtype): the copy is loaded once, by whichever engine comes
        first (k = 0's asks for no MTP layer, and so for no dtype of it)."""
        self.mtp, self.mtp_dtype, self.models = mtp, mtp_dtype, {}

    def __enter__(self):
        import wideep.engine.worker.core as core
        self.core, self.real = core, core.load_model
        core.load_model = self.load
        return self

    def __exit__(self, *exc):
        self.core.load_model = self.real
        self.models.clear()

    def load(self, model_dir, *args, mtp: bool = False, **kw):
        if model_dir not in self.models:
            if self.mtp:
                from wideep.engine.model.build import parse_dtype
                kw["mtp_dtype"] = parse_dtype(self.mtp_dtype) if self.mtp_dtype else None
            self.models[model_dir] = self.real(model_dir, *args, mtp=self.mtp, **kw)
        model = self.models[model_dir]
        if not mtp and getattr(model, "drafter", None) is not None:   # V3: no drafter without speculation
            model = copy.copy(model)
            object.__setattr__(model, "drafter", None)
        return model   # (V4: the engine's config says whether its MTP block drafts)


def run(llm, ps, new: int) -> tuple[list, float]:
    from wideep.engine import SamplingParams
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    tpots = [o.metrics["tpot_s"] for o in outs]
    return [o.outputs[0].token_ids for o in outs], statistics.median(tpots), statistics.fmean(tpots)


def lockstep(llms: dict, ps, new: int, start: int = 0) -> dict:
    """The same requests on every engine of `llms` (k -> LLM), the engines stepping in turn, one step each (the first
    to step moves on by one each round, from `start`): every engine's steps fall in the same seconds of the machine's
    drifting speed. Each engine keeps its own clock, the time spent in its own steps; a request's TPOT is its clock
    from the step that gave its first token to the one that gave its last, over its tokens after the first (in one
    process an engine does nothing between steps: what generate's TPOT measures). -> {k: (token ids per request,
    median TPOT, mean TPOT)}."""
    from wideep.engine import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    st = {}
    for k, llm in llms.items():
        rids = [f"lockstep-{next(_REQ)}" for _ in ps]
        for rid, p in zip(rids, ps):
            llm.engine.add_request(rid, p, sp)
        st[k] = {"clock": 0.0, "first": {}, "last": {}, "toks": {}, "rids": rids}
    live = list(llms)
    for r in itertools.count(start):
        if not live:
            break
        for k in live[r % len(live):] + live[:r % len(live)]:
            s, eng = st[k], llms[k].engine
            t0 = time.perf_counter()
            outs = eng.step()
            s["clock"] += time.perf_counter() - t0
            for o in outs:
                ids = o.outputs[0].token_ids
                if ids and o.request_id not in s["first"]:
                    s["first"][o.request_id] = (s["clock"], len(ids))
                if o.finished:
                    s["last"][o.request_id], s["toks"][o.request_id] = s["clock"], list(ids)
        live = [k for k in live if llms[k].engine.has_unfinished_requests()]
    out = {}
    for k, s in st.items():
        tpots = [(s["last"][r] - s["first"][r][0]) / (len(s["toks"][r]) - s["first"][r][1]) for r in s["rids"]]
        out[k] = ([s["toks"][r] for r in s["rids"]], statistics.median(tpots), statistics.fmean(tpots))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mix", type=float, default=None,
                    help="the cycle model's layer-output scale (launch/tiny/cycle.py): larger, fewer tokens follow the "
                         "cycle; default 0.06 (0.15 with --quick; 0.1 with --model v4): the MTP workloads' target, ~85-90 %% acceptance")
    ap.add_argument("--ngram-mix", type=float, default=0.03,
                    help="the n-gram workload's cycle model: small enough that its greedy output stays on the prompt's "
                         "cycle (a token off it leaves the prompt's n-grams behind)")
    ap.add_argument("--workloads", default="ngram,mtp,ngram_rejected,mtp_rejected",
                    help="which workloads run (the targets and the results file need all four; a partial run only prints)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", choices=("v3", "v4"), default="v3")
    ap.add_argument("--draft-dtype", default=None,
                    help="the MTP layer's weights (speculative draft_dtype): 'float32' (the model's) or 'bfloat16'; "
                         "default bfloat16 with --model v3 (V4's MTP block runs in the model's dtype)")
    a = ap.parse_args()
    if a.draft_dtype is None:
        a.draft_dtype = "float32" if a.model == "v4" else "bfloat16"
    if a.quick:
        a.batches, a.ks, a.new, a.prompt, a.trials = "1,8", "1,3", 24, 48, 1
    torch.set_num_threads(a.threads)
    from wideep.engine import LLM
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    from wideep.launch.tiny.cycle import make_cycle_checkpoint
    v4 = a.model == "v4"
    shape = (V4_QUICK if a.quick else V4_MODEL) if v4 else QUICK if a.quick else MODEL
    mix = a.mix if a.mix is not None else 0.1 if v4 else (0.15 if a.quick else 0.06)
    batches, ks = [int(b) for b in a.batches.split(",")], [0] + [int(k) for k in a.ks.split(",")]
    result = {"workloads": {}, "model": {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                               "num_experts_per_tok", "vocab_size")},
              "new_tokens": a.new, "prompt_tokens": a.prompt, "trials": a.trials, "threads": a.threads,
              "dtype": "float32", "ngram_prompt_lookup": [2, 4], "cycle_mix": mix, "ngram_cycle_mix": a.ngram_mix, "mtp_mix": 0.1,
              "rejected_mtp_hidden": 20.0, "mtp_draft_dtype": a.draft_dtype}
    result["arch"] = a.model
    with tempfile.TemporaryDirectory() as tmp:
        if v4:
            from wideep.launch.tiny.cycle import make_v4_cycle_checkpoint as make_cycle
            from wideep.launch.tiny.v4 import tiny_v4_model
            rnd = os.path.join(tmp, "random")
            tiny_v4_model(0, **shape).save_pretrained(rnd)
        else:
            make_cycle = make_cycle_checkpoint
            rnd = make_tiny_checkpoint(os.path.join(tmp, "random"), arch="v3", seed=0, **shape)
        exact, nxt = make_cycle(os.path.join(tmp, "exact"), period=32, mix=a.ngram_mix, gain=20.0, seed=0, **shape)
        cyc, _ = make_cycle(os.path.join(tmp, "cycle"), period=32, mix=mix, gain=20.0, seed=0, mtp=True, mtp_mix=0.1,
                            **shape)
        bad, _ = make_cycle(os.path.join(tmp, "bad_mtp"), period=32, mix=mix, gain=20.0, seed=0, mtp=True, mtp_mix=0.1,
                            mtp_hidden=20.0, **shape)
        for workload, method, model, kind in (("ngram", "ngram", exact, "repeats"), ("mtp", "mtp", cyc, "repeats"),
                                              ("ngram_rejected", "ngram", rnd, "alphabet"),
                                              ("mtp_rejected", "mtp", bad, "repeats")):
            if workload not in a.workloads.split(","):
                continue
            rows = {}
            spec = {"ngram": dict(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4),
                    "mtp": dict(method="mtp", draft_dtype=a.draft_dtype)}
            with SharedWeights(mtp=method == "mtp", mtp_dtype=a.draft_dtype):
                engines = {k: LLM(model, progress=False, enable_prefix_caching=False, max_num_seqs=max(batches),
                                  dtype="float32",
                                  block_size=64, kv_cache_blocks=max(batches) * (-(-(a.prompt + a.new) // 64) + 1),
                                  speculative_config=None if k == 0 else dict(spec[method], num_speculative_tokens=k))
                           for k in ks}
            if method == "mtp" and not v4:   # the layer the engines share is in the dtype asked for
                from wideep.engine.model.build import parse_dtype
                for k in ks[1:]:
                    got = engines[k].engine.core.loaded.draft.eh_proj.weight.dtype
                    assert got == parse_dtype(a.draft_dtype), f"k={k}: the MTP layer is {got}, not {a.draft_dtype}"
            for B in batches:
                before = {k: engines[k].engine.metrics() for k in ks}   # the counters are cumulative: this batch's
                ps = prompts(kind, nxt, B, a.prompt, seed=B)
                for k in ks:   # warm-up (kernels, first allocations)
                    run(engines[k], ps, 4)
                tp = {k: [] for k in ks}
                mean = {k: [] for k in ks}
                toks = {}
                for t in range(a.trials):   # every k at once, in lockstep (the first to step rotates)
                    for k, (toks[k], med, avg) in lockstep(engines, ps, a.new, start=t).items():
                        tp[k].append(med)
                        mean[k].append(avg)
                row = {}
                for k in ks:
                    assert toks[k] == toks[0], f"{workload} batch {B} k={k}: greedy tokens differ from no speculation"
                    t = statistics.median(tp[k])
                    row[k] = {"tpot_ms": round(1e3 * t, 3), "decode_tok_s": round(B / statistics.median(mean[k]), 1)}
                    if k:
                        m, m0 = engines[k].engine.metrics(), before[k]
                        n, d, acc = (m[f"spec_decode_num_{x}"] - m0[f"spec_decode_num_{x}"]
                                     for x in ("drafts", "draft_tokens", "accepted_tokens"))
                        row[k].update(acceptance=round(acc / d, 3) if d else 0.0,
                                      mean_acceptance_length=round(1 + acc / n, 3) if n else 1.0,
                                      backoffs=m["spec_decode_backoffs"] - m0["spec_decode_backoffs"], drafts=n)
                for k in ks:   # paired: each trial's k = 0 run against its k run, the median of those ratios
                    ratios = [m0 / mk for m0, mk in zip(mean[0], mean[k])]
                    row[k]["speedup"] = round(statistics.median(ratios), 3)
                    if k:
                        row[k]["speedup_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
                rows[B] = {"k": row}
                print(workload, B, json.dumps(row), flush=True)
            for llm in engines.values():
                llm.shutdown()
            del engines, llm
            gc.collect()
            result["workloads"][workload] = {"batch": rows}
    b1 = min(batches)
    result["targets"] = {}
    if len(result["workloads"]) < 4:   # a partial run: printed, not saved (the results file holds all four)
        print(json.dumps(result))
        return
    for name in ("ngram", "mtp"):
        rep = result["workloads"][name]["batch"][b1]["k"]
        best = max((k for k in ks if k), key=lambda k: rep[k]["speedup"])
        rej = result["workloads"][name + "_rejected"]["batch"]
        worst = min(rej[B]["k"][k]["speedup"] for B in batches for k in ks if k)
        result["targets"][name] = {
            "batch1_best_k": best, "batch1_speedup": rep[best]["speedup"], "batch1_acceptance": rep[best]["acceptance"],
            "met_1p5x_at_70pct": rep[best]["speedup"] >= 1.5 and rep[best]["acceptance"] >= 0.7,
            "rejected_worst_speedup": worst, "met_within_5pct_when_rejected": worst >= 0.95}
    save("speculative" + ("_v4" if v4 else "") + ("_quick" if a.quick else ""), result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
