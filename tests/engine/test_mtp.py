"""Speculative decoding with the checkpoint's MTP layer (engine/model/mtp.py, engine/spec_decode/drafter.py, mla_passes.py).

- The drafter equals a reference built from transformers, for DeepSeek-V3, V3.2 (the MTP layer's sparse
  attention and indexer, prompts past index_topk) and GLM-4.x-MoE-lite: the MTP layer's decoder layer is
  transformers' own (DeepseekV3/DeepseekV32/Glm4MoeLite DecoderLayer, loaded from the same checkpoint with the
  layer counted as a normal one), around it enorm/hnorm/eh_proj/shared_head as DeepSeek-V3 defines them, fed
  transformers' own final hidden states: the engine's first and second drafts after a prefill are that
  reference's argmaxes.
- Greedy outputs equal no speculation (k = 1 and 3; V3.2 and GLM-lite, its config with and without
  mlp_layer_types), under preemption, with stop tokens; the MTP models of launch/tiny/cycle.py accept part of
  their drafts; a checkpoint without an MTP layer, or whose config names one it does not hold, is refused.
- draft_dtype "bfloat16" beside a float32 model: the layer's weights bfloat16 (router and embeddings float32), its
  passes on the fused C halves and, past the kernels' row limits, on BLAS over float32 copies; greedy outputs equal,
  acceptance as the float32 layer's; refused where the layer cannot take it (torch backends, V3.2's indexer).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.launch.tiny import cycle as tiny_cycle
from wideep.launch.tiny.cycle import make_cycle_checkpoint
from tests.engine.test_engine import drive, workload

pytest.importorskip("transformers")


def mtp(k, **kw):
    return dict(method="mtp", num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """Its target follows the cycle most of the time (mix 2), its MTP layer predicts the cycle (mtp_mix 0.1):
    some drafts right, some wrong."""
    return make_cycle_checkpoint(str(tmp_path_factory.mktemp("mtp_cycle")), period=12, mix=2.0, gain=20.0, seed=1,
                                 mtp=True, mtp_mix=0.1)


def cycle_prompts(nxt, n, length=20, seed=0):
    return tiny_cycle.cycle_prompts(nxt, n, length, seed)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def with_mlp_layer_types(d: str) -> str:
    """A GLM-lite checkpoint's config as transformers' Glm4MoeLiteConfig saves it: mlp_layer_types for the stack,
    no first_k_dense_replace (the MTP layer past it is still MoE: the checkpoint holds its router)."""
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    first = cfg.pop("first_k_dense_replace")
    cfg["mlp_layer_types"] = ["dense"] * first + ["sparse"] * (cfg["num_hidden_layers"] - first)
    json.dump(cfg, open(path, "w"), indent=2)
    return d


@torch.no_grad()
@pytest.mark.parametrize("arch", ["v3", "v32", "glm4_moe_lite"])
def test_drafts_equal_a_transformers_reference(tmp_path, arch):
    from safetensors.torch import load_file

    from tests.oracle import TINY_CLASSES

    d, _ = make_cycle_checkpoint(str(tmp_path / "m"), period=12, mix=1.0, seed=3, mtp=True, mtp_hidden=2.0,
                                 initializer_range=0.3, arch=arch)
    cfg = json.load(open(os.path.join(d, "config.json")))
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    t = load_file(os.path.join(d, "model.safetensors"))
    pre = f"model.layers.{L}."
    # transformers' model of the target, and one that holds the MTP layer's decoder layer as layer L
    import transformers
    cls = getattr(transformers, TINY_CLASSES[arch])
    hf = cls.from_pretrained(d, attn_implementation="eager").eval().float()
    d2 = str(tmp_path / "with_layer")
    shutil.copytree(d, d2)
    json.dump(dict(cfg, num_hidden_layers=L + 1), open(os.path.join(d2, "config.json"), "w"))
    hf2 = cls.from_pretrained(d2, attn_implementation="eager").eval().float()
    layer, rotary = hf2.model.layers[L], hf2.model.rotary_emb
    assert hasattr(layer.self_attn, "indexer") == (arch == "v32") and hasattr(layer.mlp, "gate")

    def reference(tokens, prev_hidden):
        """rows i = 0..T-1: token tokens[i] (position i + 1's), hidden prev_hidden[i] -> (layer out, logits)."""
        T = len(tokens)
        e = _rms(hf.model.embed_tokens(torch.tensor(tokens)), t[pre + "enorm.weight"], eps)
        h = _rms(prev_hidden, t[pre + "hnorm.weight"], eps)
        x = torch.cat([e, h], -1) @ t[pre + "eh_proj.weight"].t()
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out, _rms(out, t[pre + "shared_head.norm.weight"], eps) @ t[pre + "shared_head.head.weight"].t()

    # 23 tokens: past V3.2's index_topk (16), so the MTP layer's indexer picks among its own cached keys
    prompt = [7, 120, 33, 71, 2, 88, 14, 160, 99, 5, 42, 61, 230, 17, 150, 9, 77, 201, 3, 64, 128, 45, 190]
    eng = Engine(d, progress=False, block_size=16, kv_cache_blocks=16, speculative_config=mtp(2))
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()   # the prefill: the first token, and the drafts after it
    seq = eng.core.scheduler.running[0]
    first = seq.output_token_ids[0]
    hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]           # final-normed, [T, H]
    out, logits = reference(prompt[1:] + [first], hidden)
    d1 = int(logits[-1].argmax())
    # the second draft: one more row at position T, its token d1 and its hidden the layer's output at T - 1
    _, logits2 = reference(prompt[1:] + [first, d1], torch.cat([hidden, out[-1:]]))
    assert seq.spec.mtp_drafts == [d1, int(logits2[-1].argmax())]
    # and the drafter's own logits at every prompt row against the reference's
    drafter, kv = eng.core.loaded.draft, eng.core.kv
    from wideep.attention_mla.meta import AttnMeta, int64_tensor
    from wideep.parallel.step_plan import StepPlan
    T, bs = len(prompt), 16
    meta = AttnMeta(positions=torch.arange(T), slot_mapping=torch.arange(T) + 5 * bs,
                    block_table=int64_tensor([5, 6], None).view(1, 2), query_lens=[T], ctx_lens=[T], block_size=bs)
    ours = drafter.logits(drafter(torch.tensor(prompt[1:] + [first]), hidden, meta, kv.pools, StepPlan(T),
                                  kv.index_pools))
    assert (ours - logits).abs().max() < 1e-4
    eng.shutdown()


def _greedy_equal_with_mtp(d: str, prompts, max_tokens: int, k: int, **spec) -> LLM:
    """Greedy outputs (tokens, logprobs within 1e-4) equal with and without MTP drafting k -> the drafting LLM."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ref = [o.outputs[0] for o in LLM(d, progress=False, block_size=16, kv_cache_blocks=64).generate(prompts, sp)]
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=mtp(k, **spec))
    got = [o.outputs[0] for o in llm.generate(prompts, sp)]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for x, y in zip(got, ref):
        assert [list(e.values())[0] for e in x.logprobs] == pytest.approx([list(e.values())[0] for e in y.logprobs],
                                                                          abs=1e-4)
    return llm


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equal_and_drafts_partly_accepted(cycle, k):
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 5)
    llm = _greedy_equal_with_mtp(d, prompts, 36, k)
    m = llm.engine.metrics()
    assert 0.2 < m["spec_decode_acceptance_rate"] < 1.0, m["spec_decode_acceptance_rate"]
    assert llm.engine.core.runner.drafter.passes > 0


@pytest.mark.parametrize("arch,k", [("v32", 2), ("glm4_moe_lite", 3), ("glm4_moe_lite+mlp_layer_types", 2)])
def test_sparse_attention_and_glm_lite_mtp_greedy_equal_and_accept(tmp_path, arch, k):
    """DeepSeek-V3.2's MTP layer (its own indexer keys beside its latents, prompts past index_topk) and
    GLM-4.x-lite's (a MoE layer past an mlp_layer_types stack) draft; greedy outputs equal no speculation."""
    name, _, types = arch.partition("+")
    # seeds where the target follows its cycle often but not always (GLM-lite's seed 1 follows it 16% of the time)
    d, nxt = make_cycle_checkpoint(str(tmp_path / name), period=12, mix=2.0, gain=20.0, seed=1 if name == "v32" else 2,
                                   mtp=True, mtp_mix=0.1, arch=name)
    if types:
        with_mlp_layer_types(d)
    prompts = cycle_prompts(nxt, 4)
    llm = _greedy_equal_with_mtp(d, prompts, 30, k)
    core = llm.engine.core
    assert core.loaded.draft.layer.is_moe and core.runner.drafter.passes > 0
    L = core.config.num_hidden_layers
    if name == "v32":   # the drafter's indexer keys live in the pool's last layer, like its latents
        assert len(core.kv.index_pools) == L + 1 and core.kv.index_pools[L].abs().sum() > 0
    else:
        assert core.kv.index_pools is None
    assert 0.2 < llm.engine.metrics()["spec_decode_acceptance_rate"] < 1.0, llm.engine.metrics()


def test_a_bfloat16_drafter_beside_a_float32_model(cycle):
    """draft_dtype "bfloat16": the MTP layer's weights are bfloat16 (its router float32 as every router's, the
    embeddings the target's), its rows and latents float32, its decode passes the fused C halves; greedy outputs
    equal no speculation and the drafts are accepted about as often as the float32 layer's."""
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 5)
    rates = {}
    for dt in ("float32", "bfloat16"):
        llm = _greedy_equal_with_mtp(d, prompts, 36, 3, draft_dtype=dt)
        rates[dt] = llm.engine.metrics()["spec_decode_acceptance_rate"]
    model, draft = llm.engine.core.model, llm.engine.core.loaded.draft
    layer = draft.layer
    assert {p.dtype for p in (draft.eh_proj.weight, draft.head.weight, layer.mlp.experts.w13,
                              layer.self_attn.kv_b_proj.weight, layer.input_layernorm.weight)} == {torch.bfloat16}
    assert layer.mlp.gate.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.model.parameters())
    assert llm.engine.core.kv.pools[layer.index].dtype == torch.float32
    extra = model.decode_plan._extra
    assert extra and all(w.fits for w in extra.values())   # the drafter's passes took the fused halves
    assert rates["bfloat16"] > 0.2 and abs(rates["bfloat16"] - rates["float32"]) < 0.1, rates


def _pass_inputs(core, H):
    """Two sequences (blocks 3, 4 and 5, 6 of 16 slots): rows at positions 29, 30, 31 and 20, 21, the last of
    each running the layer; the MTP layer's cache filled with random entries first."""
    from wideep.attention_mla.meta import attn_meta
    g = torch.Generator().manual_seed(0)
    L = core.config.num_hidden_layers
    core.kv.pools[L].copy_(torch.randn(core.kv.pools[L].shape, generator=g))
    tables, bs = [[3, 4], [5, 6]], 16
    rows = [(0, 29), (0, 30), (0, 31), (1, 20), (1, 21)]
    pos = torch.tensor([p for _, p in rows])
    slots = torch.tensor([tables[s][p // bs] * bs + p % bs for s, p in rows])
    meta = attn_meta([31, 21], [int(slots[2]), int(slots[4])], [32, 22], [1, 1], tables, bs, None)
    return (torch.tensor([5, 9, 14, 2, 7]), torch.randn(5, H, generator=g), pos, slots, 31, torch.tensor([2, 4]),
            meta)


@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_fused_passes_equal_the_layers_operations(cycle, draft_dtype):
    """fused.mtp_pass (the input, the rows that only write their cache entries, the layer over the others, the head
    and the argmax, then the later passes, in one C call) against the layer's own operations pass by pass (the fused
    halves, the head by its matmul): drafts, outputs and the cache entries of every row equal, a sequence whose
    lookahead ends at its last block stopping after its first draft; the engine's passes take it (one EP rank)."""
    from wideep.attention_mla.meta import attn_meta
    from wideep.parallel.step_plan import StepPlan
    d, nxt = cycle
    llm = _greedy_equal_with_mtp(d, cycle_prompts(nxt, 3), 20, 3, draft_dtype=draft_dtype)
    core = llm.engine.core
    layer, L = core.loaded.draft, core.config.num_hidden_layers
    assert layer.fused_passes > 0
    ids, prev, pos, slots, max_pos, out_rows, meta = _pass_inputs(core, layer.hnorm.weight.shape[0])
    tables, P = [[3, 4], [5, 6]], 3
    # the later positions: 32, 33 for the first sequence (past its blocks: it stops), 22, 23 for the second
    later = (P, [0, 0, 22, 23], [-1, -1, 6 * 16 + 6, 6 * 16 + 7], [0, 0, 23, 24])
    pools = core.kv.pools
    got = {}
    for fuse in (True, False):
        ps = list(pools)
        ps[L] = pools[L].clone()
        layer._fuse, n = fuse, layer.fused_passes
        out, drafts, done = layer.first_pass(ids, prev, pos, slots, max_pos, out_rows, meta, ps, StepPlan(5),
                                             later=later)
        assert done == (P if fuse else 1) and layer.fused_passes == n + (P if fuse else 0)
        if not fuse:   # the drafter's own loop: the second sequence alone, at 22 then 23
            for p in (22, 23):
                m = attn_meta([p], [6 * 16 + p % 16], [p + 1], [1], [tables[1]], 16, None)
                o, t = layer.draft_pass(torch.tensor([drafts[1][-1]]), out[1:], m, ps, StepPlan(1))
                out = torch.cat([out[:1], o])
                drafts[1] += t
        got[fuse] = drafts, out, ps[L][slots], ps[L][6 * 16 + 6:6 * 16 + 8]
    layer._fuse = None
    assert got[True][0] == got[False][0] and [len(x) for x in got[True][0]] == [1, 3]
    tol = 1e-4 if draft_dtype == "float32" else 2e-2
    for a, b in zip(got[True][1:], got[False][1:]):
        assert a.shape == b.shape and (a - b).abs().max() < tol * max(1.0, b.abs().max()), (a - b).abs().max()


def test_a_fused_pass_names_a_slot_outside_the_pool(cycle):
    from wideep.parallel.step_plan import StepPlan
    d, _ = cycle
    eng = Engine(d, progress=False, block_size=16, kv_cache_blocks=16, speculative_config=mtp(2))
    core = eng.core
    layer = core.loaded.draft
    ids, prev, pos, slots, max_pos, out_rows, meta = _pass_inputs(core, layer.hnorm.weight.shape[0])
    S = core.kv.pools[core.config.num_hidden_layers].shape[0]
    bad = slots.clone()
    bad[1] = S + 3   # a row that only writes its entry
    with pytest.raises(ValueError, match=f"row 1's slot {S + 3} is outside the pool's {S} rows"):
        layer.first_pass(ids, prev, pos, bad, max_pos, out_rows, meta, core.kv.pools, StepPlan(5))
    eng.shutdown()


def test_a_bfloat16_drafter_past_the_kernels_row_limits(cycle, monkeypatch):
    """Rows past the C kernels' limits (made small here) run BLAS on a float32 copy of the bfloat16 weights
    (cpu/linear.py small_linear, moe/experts.py dense_weights): greedy outputs still equal no speculation."""
    import wideep.cpu.linear as cpu_linear
    d, nxt = cycle
    monkeypatch.setattr(cpu_linear, "max_rows", lambda dtype: 2)
    monkeypatch.setattr(cpu_linear, "EXPERTS_MAX_ROWS", 0)
    llm = _greedy_equal_with_mtp(d, cycle_prompts(nxt, 12), 20, 2, draft_dtype="bfloat16")
    assert llm.engine.metrics()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("arch,options,msg", [
    ("v3", dict(experts_backend="torch", attention_backend="torch"), "runs on the CPU kernels"),
    ("v32", {}, "sparse attention \\(DeepSeek-V3.2's indexer\\)"),
    ("v3", dict(dtype="bfloat16", draft="float32"), "beside a bfloat16 model: the MTP layer's weights can be")])
def test_a_draft_dtype_the_layer_cannot_take_is_refused(tmp_path, arch, options, msg):
    d, _ = make_cycle_checkpoint(str(tmp_path / arch), period=12, mtp=True, arch=arch)
    options = dict(options)
    draft = options.pop("draft", "bfloat16")
    with pytest.raises(ValueError, match=f"draft_dtype '{draft}'.*{msg}"):
        LLM(d, progress=False, speculative_config=mtp(2, draft_dtype=draft), **options)


def test_greedy_equal_under_preemption_and_stop_tokens(cycle):
    d, nxt = cycle
    reqs = workload(30, seed=5, max_prompt=40, max_new=30, last_arrival=20)
    for r, p in zip(reqs, cycle_prompts(nxt, 30, length=40, seed=4)):
        r["prompt"] = p[:max(2, len(r["prompt"]))]
    eng = Engine(d, progress=False, block_size=16, kv_cache_blocks=20, max_num_seqs=10, max_num_batched_tokens=80,
                 speculative_config=mtp(2))
    got = drive(eng, reqs)
    assert eng.core.scheduler.num_preemptions > 0
    assert eng.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert eng.core.blocks.num_free == eng.core.blocks.allocators["latent"].num_blocks
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, enable_prefix_caching=False)
    for r in reqs:
        want = llm.generate([r["prompt"]], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        assert got[r["id"]] == want[0].outputs[0].token_ids, r["id"]
    prompt = cycle_prompts(nxt, 1, seed=8)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    spec = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=mtp(3))
    for i in (4, 11):
        stop = base.token_ids[i]
        out = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop_token_ids=[stop]))[0].outputs[0]
        assert out.token_ids == base.token_ids[:base.token_ids.index(stop) + 1] and out.finish_reason == "stop"


def test_checkpoint_without_an_mtp_layer_is_refused(tmp_path):
    d, _ = make_cycle_checkpoint(str(tmp_path / "plain"), period=12)
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        LLM(d, progress=False, speculative_config=mtp(1))


def test_a_config_naming_an_mtp_layer_the_checkpoint_lacks_is_refused(tmp_path):
    """num_nextn_predict_layers = 1, but no `model.layers.{L}.*` tensor (as transformers saves a V3.2 or GLM)."""
    from safetensors.torch import load_file, save_file
    d, _ = make_cycle_checkpoint(str(tmp_path / "v32"), period=12, mtp=True, arch="v32")
    L = json.load(open(os.path.join(d, "config.json")))["num_hidden_layers"]
    path = os.path.join(d, "model.safetensors")
    t = {n: x for n, x in load_file(path).items() if not n.startswith(f"model.layers.{L}.")}
    save_file(t, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"num_nextn_predict_layers = 1, but the checkpoint holds no tensor of its "
                                         rf"MTP layer \(model\.layers\.{L}\.\*"):
        LLM(d, progress=False, speculative_config=mtp(1))
    LLM(d, progress=False)   # without speculation the checkpoint serves


def test_the_mtp_layers_mlp_is_the_checkpoints(cycle):
    """MoE where the checkpoint holds the layer's router, dense where it does not (mlp_layer_types stops at L)."""
    from wideep.engine.model.loader import CheckpointReader
    from wideep.engine.model.model_config import ModelConfig
    from wideep.engine.model.mtp import mtp_layer_is_moe
    d, _ = cycle
    cfg, names = ModelConfig.from_dir(d), CheckpointReader(d).names
    L = cfg.num_hidden_layers
    assert mtp_layer_is_moe(cfg, names, d)
    assert not mtp_layer_is_moe(cfg, {n for n in names if not n.startswith(f"model.layers.{L}.mlp.gate.")}, d)
    with pytest.raises(ValueError, match="no tensor of its MTP layer"):
        mtp_layer_is_moe(cfg, {n for n in names if not n.startswith(f"model.layers.{L}.")}, d)


def test_sampling_with_mtp_drafts_is_seeded_and_accepts(cycle):
    from tests.engine.test_speculative import seeded_twice
    d, nxt = cycle
    seeded_twice(d, cycle_prompts(nxt, 3, seed=5),
                 SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True), mtp(2))


def test_an_mtp_layer_whose_drafts_fail_stops_running(tmp_path):
    """Drafts almost never right (the MTP layer reads mostly a random map of the hidden state): the sequences
    back off, then retire, and the drafter stops its passes; outputs equal no speculation. Later sequences of
    the rank start retired, except its probe."""
    d, nxt = make_cycle_checkpoint(str(tmp_path / "bad"), period=12, mix=2.0, gain=20.0, seed=1, mtp=True,
                                   mtp_mix=0.1, mtp_hidden=20.0)
    prompts = cycle_prompts(nxt, 2, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(d, progress=False, block_size=16, kv_cache_blocks=64).generate(prompts, sp)]
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=dict(
        method="mtp", num_speculative_tokens=2, backoff_steps=4))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    m = llm.engine.metrics()
    assert m["spec_decode_acceptance_rate"] < 0.2 and m["spec_decode_retired"] == 2, m
    drafts = m["spec_decode_num_drafts"]
    # the rank remembers: new sequences start backed off (retired: the drafter never runs them) ...
    drafter, sp = llm.engine.core.runner.drafter, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    passes = drafter.passes
    for _ in range(5):   # sequences 3..7 of the rank
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp)] == [ref[0][:40]]
    m = llm.engine.metrics()
    assert drafter.passes == passes and m["spec_decode_started_paused"] == 5, m
    assert m["spec_decode_num_drafts"] == drafts and m["spec_decode_rank_pause_max"] >= 16, m
    # ... except the rank's probe (its 8th sequence), which gets the drafter again
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp)] == [ref[0][:40]]
    assert drafter.passes > passes and llm.engine.metrics()["spec_decode_started_paused"] == 5


def test_backed_off_rows_wait_in_a_stash_and_drafts_are_unchanged(cycle, monkeypatch):
    """A sequence backing off defers its first-pass rows and runs them before it drafts again: whenever it is
    about to draft, the MTP layer's latents of all its positions equal those of a drafter that ran every row
    at once, its drafts are the same, and it took fewer passes."""
    from wideep.engine.spec_decode import speculator as spec_mod
    from wideep.engine.spec_decode import drafter as mtp_drafter
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 1, seed=7)   # one sequence: its backed-off steps have no other rows
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    runs, default = {}, mtp_drafter.STASH_ROWS
    for rows in (default, 0):
        monkeypatch.setattr(mtp_drafter, "STASH_ROWS", rows)
        proposed = []
        real = spec_mod.Speculator.propose

        def propose(self, s, room, _real=real, _log=proposed):
            out = _real(self, s, room)
            _log.append((self.step, s.request_id, tuple(out)))
            return out
        monkeypatch.setattr(spec_mod.Speculator, "propose", propose)
        latents = []   # when a sequence is about to draft: the MTP layer's latents of its positions so far
        real_draft = mtp_drafter.MTPDrafter.draft

        def draft(self, batch, *a, _real=real_draft, _log=latents):
            _real(self, batch, *a)
            layer, kv = self.model_passes.layer, self.model_passes.kv
            pool, bs = kv.pools[layer.index], kv.block_size
            for s in batch.seqs:
                if s.spec is not None and s.spec.mtp_drafts:
                    slots = [s.block_ids[p // bs] * bs + p % bs for p in range(s.num_computed)]
                    _log.append((s.request_id, s.num_computed, pool[slots].clone()))
        monkeypatch.setattr(mtp_drafter.MTPDrafter, "draft", draft)
        llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64,
                  speculative_config=dict(mtp(2), backoff_steps=4))
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        runs[rows] = toks, proposed, llm.engine.core.runner.drafter.passes, llm.engine.metrics(), latents
        llm.shutdown()
        monkeypatch.setattr(spec_mod.Speculator, "propose", real)
        monkeypatch.setattr(mtp_drafter.MTPDrafter, "draft", real_draft)
    (t1, p1, n1, m1, l1), (t0, p0, n0, _, l0) = runs[default], runs[0]
    assert t1 == t0
    assert [(r, c) for r, c, _ in l1] == [(r, c) for r, c, _ in l0]
    for (_, c, x), (_, _, y) in zip(l1, l0):   # complete when it drafts: every position's latent as computed at once
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"latents at {c} positions")
    assert m1["spec_decode_backoffs"] > 0 and any(d for _, _, d in p1), m1   # it backed off, and drafted
    assert p1 == p0   # the same drafts, step by step
    assert n1 < n0, (n1, n0)   # backed-off steps ran no pass
