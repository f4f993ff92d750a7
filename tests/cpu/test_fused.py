"""The fused decoder-layer calls (cpu/fused.py) on their own, their structs made here from raw tensors, against
plain torch written here from the same weight tensors: a dense layer's MLP half (mlp_layer, float32 or fp8
projections as Fp8Mat) == h + down(silu(gate x) * up x); a decode step's stack of layers (decode_stack) ==
mla_layer, then moe_layer or mlp_layer, layer by layer (bit-equal: the same C calls) == the layers' math in torch
(naive MLA over the gathered cache, the router, the experts' loop); a slot outside a layer's pool named before
that layer writes; an MTP layer's draft passes (mtp_pass). Fresh random weights, odd sizes (H, C, I not multiples
of 16). The structs built from a model's modules: tests/engine/test_fused_weights.py."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import fused
from wideep.cpu.build import unusable
from wideep.cpu.gemm import WD_FP8, WDT

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")

H, N, DN, R, C, DV, BS = 40, 3, 12, 6, 20, 10, 4   # hidden, heads, nope / rope / latent / value dims, block size
E, K, I, IS = 12, 3, 14, 22                         # experts, top-k, expert and shared-expert intermediate sizes


def _rand(*shape, std=0.2):
    return torch.randn(*shape) * std


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _swiglu(x, g, u, d):
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)


@pytest.mark.parametrize("T,h,i", [(1, 40, 22), (3, 17, 33), (7, 64, 16), (64, 40, 22)])
def test_mlp_layer_equals_torch(T, h, i):
    torch.manual_seed(T * 100 + h + i)
    g, u, d = _rand(i, h), _rand(i, h), _rand(h, i)
    res, x = torch.randn(T, h), torch.randn(T, h)
    w = fused.MlpWeights(g.data_ptr(), u.data_ptr(), d.data_ptr(), H=h, Is=i, wdt=WDT[torch.float32])
    torch.testing.assert_close(fused.mlp_layer(res, x, w), res + _swiglu(x, g, u, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,h,i,block", [(1, 200, 136, (128, 128)), (3, 40, 22, (16, 16)), (17, 64, 48, (32, 32))])
def test_mlp_layer_with_fp8_weights_equals_torch_on_the_dequantised(T, h, i, block):
    """An fp8 checkpoint's MLP kept as stored: e4m3 bytes + block scales, each projection an Fp8Mat the struct points
    at (dtype code WD_FP8)."""
    from wideep.moe.fp8 import dequantize_fp8_block, quantize_fp8_block
    torch.manual_seed(T + h + i)
    qs = [quantize_fp8_block(_rand(n, k), block) for n, k in ((i, h), (i, h), (h, i))]   # gate, up, down
    mats = [fused.Fp8Mat(q.data_ptr(), sc.data_ptr(), sc.shape[1], *block) for q, sc in qs]
    w = fused.MlpWeights(*(ctypes.addressof(m) for m in mats), H=h, Is=i, wdt=WD_FP8)
    res, x = torch.randn(T, h), torch.randn(T, h)
    ref = res + _swiglu(x, *(dequantize_fp8_block(q, sc, block) for q, sc in qs))
    torch.testing.assert_close(fused.mlp_layer(res, x, w), ref, atol=1e-5, rtol=1e-5)


def _attention_layer(Q, interleave):
    t = {"in_w": 1 + _rand(H), "post_w": 1 + _rand(H), "wkva": _rand(C + R, H), "kva_w": 1 + _rand(C),
         "wkvb": _rand(N * (DN + DV), C), "wo": _rand(H, N * DV), "wq": _rand(N * (DN + R), Q or H)}
    if Q:
        t |= {"wqa": _rand(Q, H), "qa_w": 1 + _rand(Q)}
    eps = {"in_eps": 1e-6, "post_eps": 1e-5, "qa_eps": 1e-6 if Q else 0.0, "kva_eps": 1e-5}
    w = fused.MlaWeights(**{n: v.data_ptr() for n, v in t.items()}, **eps, scale=0.3, H=H, Q=Q, N=N, dn=DN, R=R, C=C,
                         dv=DV, interleave=int(interleave))
    w_uk_t = t["wkvb"].view(N, DN + DV, C)[:, :DN].transpose(1, 2).contiguous()      # [N, C, dn]
    return SimpleNamespace(t=t, eps=eps, w=w, w_uk_t=w_uk_t, Q=Q, interleave=interleave)


def _moe_layer(method, sigmoid, G, tg, shared, norm, scale):
    t = {"gw": _rand(E, H, std=0.5), "w13": _rand(E, 2 * I, H), "w2": _rand(E, H, I)}
    if method == 2:
        t["gbias"] = _rand(E, std=0.1)
    if shared:
        t |= {"sg": _rand(IS, H), "su": _rand(IS, H), "sd": _rand(H, IS)}
    w = fused.MoeWeights(**{n: v.data_ptr() for n, v in t.items()}, scale=scale, H=H, E=E, I=I,
                         Is=IS if shared else 0, k=K, G=G, topk_group=tg, sigmoid=int(sigmoid), method=method,
                         norm=int(norm))
    return SimpleNamespace(t=t, w=w, method=method, sigmoid=sigmoid, G=G, tg=tg, norm=norm, scale=scale)


def _dense_layer():
    t = {"sg": _rand(IS, H), "su": _rand(IS, H), "sd": _rand(H, IS)}
    return SimpleNamespace(t=t, w=fused.MlpWeights(**{n: v.data_ptr() for n, v in t.items()}, H=H, Is=IS))


def _rope(x, cos, sin, interleave):
    """x [..., R] with cos/sin broadcast to [..., R/2] (attention_mla/rope.py's two layouts)."""
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    a, b = x[..., :R // 2], x[..., R // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def _attention_ref(a, x, pool, cos, sin, slots, table, lens):
    """The attention half in torch, the naive MLA form (keys and values up-projected from the gathered
    latent rows): h = x + o_proj(attention(in_norm(x))), mlp_in = post_norm(h); writes the cache rows."""
    t, T = a.t, x.shape[0]
    xn = _rms(x, t["in_w"], a.eps["in_eps"])
    q = F.linear(_rms(F.linear(xn, t["wqa"]), t["qa_w"], a.eps["qa_eps"]), t["wq"]) if a.Q else F.linear(xn, t["wq"])
    q = q.view(T, N, DN + R)
    q_nope, q_pe = q[..., :DN], _rope(q[..., DN:], cos[:, None], sin[:, None], a.interleave)
    kv = F.linear(xn, t["wkva"])
    latent = _rms(kv[:, :C], t["kva_w"], a.eps["kva_eps"])
    pool[slots] = torch.cat([latent, _rope(kv[:, C:], cos, sin, a.interleave)], -1)
    w_uk, w_uv = t["wkvb"].view(N, DN + DV, C).split([DN, DV], 1)
    outs = []
    for i in range(T):
        rows = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in table[i].tolist()])[:int(lens[i])]
        lat = pool[rows]                                                           # [L, C+R]
        k_nope = torch.einsum("lc,ndc->nld", lat[:, :C], w_uk)
        v = torch.einsum("lc,nvc->nlv", lat[:, :C], w_uv)
        s = (torch.einsum("nd,nld->nl", q_nope[i], k_nope) + q_pe[i] @ lat[:, C:].T) * a.w.scale
        outs.append(torch.einsum("nl,nlv->nv", s.softmax(-1), v))
    h = x + F.linear(torch.stack(outs).reshape(T, N * DV), t["wo"])
    return h, _rms(h, t["post_w"], a.eps["post_eps"])


def _moe_ref(m, res, x):
    """The MoE half in torch: the router (moe/gate.py's rules), the experts one (token, slot) at a time,
    the shared experts, the residual -> (out, ids, weights)."""
    t = m.t
    logits = F.linear(x, t["gw"])
    scores = logits.sigmoid() if m.sigmoid else logits.softmax(-1)
    choice = scores + t["gbias"] if "gbias" in t else scores.clone()
    if m.method and m.G > 1:
        grouped = choice.view(-1, m.G, E // m.G)
        gscore = grouped.topk(2, -1).values.sum(-1) if m.method == 2 else grouped.amax(-1)
        hidden = torch.ones_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(m.tg, -1).indices, False)
        choice = choice.masked_fill(hidden.repeat_interleave(E // m.G, 1), float("-inf"))
    ids = choice.topk(K, -1).indices
    wts = scores.gather(1, ids)
    wts = (wts / (wts.sum(-1, keepdim=True) + 1e-20) if m.norm else wts) * m.scale
    y = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(K):
            e = int(ids[i, j])
            g, u = F.linear(x[i], t["w13"][e]).split(I)
            y[i] += wts[i, j] * F.linear(F.silu(g) * u, t["w2"][e])
    if "sg" in t:
        y = y + _swiglu(x, t["sg"], t["su"], t["sd"])
    return res + y, ids, wts


@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("interleave", [False, True])
def test_decode_stack_equals_the_layer_calls_and_torch(T, interleave):
    torch.manual_seed(10 * T + interleave)
    attn = [_attention_layer(0, interleave), _attention_layer(18, interleave), _attention_layer(18, interleave)]
    mlps = [_dense_layer(),
            _moe_layer(2, True, 4, 2, True, True, 2.5),      # DeepSeek-V3-like: sigmoid, bias, groups, a shared expert
            _moe_layer(0, False, 1, 1, False, False, 1.0)]   # greedy softmax, no shared expert
    lens = torch.randint(1, 14, (T,), dtype=torch.int32)    # context lengths, this step's token included
    M, nblocks = 4, 4 * T + 3
    table = torch.randperm(nblocks)[:T * M].view(T, M)
    slots = torch.stack([table[i, (n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    pools = [torch.randn(nblocks * BS, C + R) for _ in attn]
    x = torch.randn(T, H)
    pos = (lens - 1).float()[:, None] * torch.arange(1, R // 2 + 1) * 0.1
    cos, sin = pos.cos().contiguous(), pos.sin().contiguous()
    max_len = int(lens.max())
    loads = [torch.zeros(E, dtype=torch.int64) if i == 1 else None for i in range(3)]

    # the whole stack in one call
    stack_pools = [p.clone() for p in pools]
    descs = (fused.LayerDesc * 3)()
    for d, a, m, pool, load in zip(descs, attn, mlps, stack_pools, loads):
        d.mla, d.wuk_t, d.pool, d.S = ctypes.addressof(a.w), a.w_uk_t.data_ptr(), pool.data_ptr(), pool.shape[0]
        is_moe = isinstance(m.w, fused.MoeWeights)
        d.moe, d.mlp = (ctypes.addressof(m.w), None) if is_moe else (None, ctypes.addressof(m.w))
        d.load = load.data_ptr() if load is not None else None
    out, ids, wts = fused.decode_stack(x, descs, [a.w for a in attn], [m.w if "gw" in m.t else None for m in mlps],
                                       [None if "gw" in m.t else m.w for m in mlps], cos, sin, slots, table, lens,
                                       max_len, BS)
    assert ids.shape == wts.shape == (2, T, K)
    assert torch.equal(loads[1], torch.bincount(ids[0].flatten(), minlength=E))

    # layer by layer: the same C calls, bit-equal
    h_in, layer_pools, layer_ids, layer_wts = x, [p.clone() for p in pools], [], []
    for a, m, pool in zip(attn, mlps, layer_pools):
        h, mlp_in = fused.mla_layer(h_in, a.w, a.w_uk_t, cos, sin, pool, slots, table, lens, max_len, BS)
        if "gw" in m.t:
            h_in, i_, w_ = fused.moe_layer(h, mlp_in, m.w, None)
            layer_ids.append(i_)
            layer_wts.append(w_)
        else:
            h_in = fused.mlp_layer(h, mlp_in, m.w)
    assert torch.equal(out, h_in)
    assert all(torch.equal(a, b) for a, b in zip(stack_pools, layer_pools))
    assert torch.equal(ids, torch.stack(layer_ids)) and torch.equal(wts, torch.stack(layer_wts))

    # the layers' math in torch
    h_in, ref_pools, ref_ids, ref_wts = x, [p.clone() for p in pools], [], []
    for a, m, pool in zip(attn, mlps, ref_pools):
        h, mlp_in = _attention_ref(a, h_in, pool, cos, sin, slots, table, lens)
        if "gw" in m.t:
            h_in, i_, w_ = _moe_ref(m, h, mlp_in)
            ref_ids.append(i_)
            ref_wts.append(w_)
        else:
            h_in = h + _swiglu(mlp_in, m.t["sg"], m.t["su"], m.t["sd"])
    torch.testing.assert_close(out, h_in, atol=2e-5, rtol=2e-5)
    for a, b in zip(stack_pools, ref_pools):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids, torch.stack(ref_ids))
    torch.testing.assert_close(wts, torch.stack(ref_wts), atol=1e-5, rtol=1e-5)


def test_a_bad_slot_is_named_with_its_layer_before_that_layer_writes():
    """decode_stack and mla_layer refuse a slot outside a layer's pool, naming the token (decode_stack: and the
    layer), before that layer writes anything; the stack's earlier layers have run."""
    torch.manual_seed(4)
    attn = [_attention_layer(0, False), _attention_layer(18, False)]
    mlps = [_dense_layer(), _moe_layer(2, True, 4, 2, True, True, 2.5)]
    table, lens = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([9, 6], dtype=torch.int32)
    pos = (lens - 1).float()[:, None] * torch.arange(1, R // 2 + 1) * 0.1
    cos, sin, x = pos.cos().contiguous(), pos.sin().contiguous(), torch.randn(2, H)
    pools = [torch.randn(8 * BS, C + R), torch.randn(6 * BS, C + R)]   # 32 rows, then 24
    good = int(table[0, 2]) * BS                                       # token 0 at position 8
    for layer in (0, 1):   # a slot outside both pools; outside layer 1's only
        bad, got = pools[layer].shape[0], [p.clone() for p in pools]
        descs = (fused.LayerDesc * 2)()
        for d, a, m, pool in zip(descs, attn, mlps, got):
            d.mla, d.wuk_t, d.pool, d.S = ctypes.addressof(a.w), a.w_uk_t.data_ptr(), pool.data_ptr(), pool.shape[0]
            d.moe, d.mlp = (ctypes.addressof(m.w), None) if "gw" in m.t else (None, ctypes.addressof(m.w))
        with pytest.raises(ValueError, match=f"decode_stack: layer {layer}: token 1's slot {bad} is outside the "
                                             f"pool's {bad} rows"):
            fused.decode_stack(x, descs, [a.w for a in attn], [None, mlps[1].w], [mlps[0].w, None], cos, sin,
                               torch.tensor([good, bad]), table, lens, 9, BS)
        assert torch.equal(got[layer], pools[layer]) and all(not torch.equal(got[i], pools[i]) for i in range(layer))
    pool, bad = pools[1].clone(), pools[1].shape[0]
    with pytest.raises(ValueError, match=f"mla_layer: token 1's slot {bad} is outside the pool's {bad} rows"):
        fused.mla_layer(x, attn[1].w, attn[1].w_uk_t, cos, sin, pool, torch.tensor([good, bad]), table, lens, 9, BS)
    assert torch.equal(pool, pools[1])


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rest", [False, True])
def test_mtp_pass_equals_its_input_the_stack_call_and_the_head(wdt, rest):
    """mtp_pass (an MTP layer's draft pass: input, cache-entry-only rows, the layer, head, argmax) == the input and
    the entries in torch, the layer as decode_stack's one-layer call on that input, the head's argmax in torch; its
    norms, eh_proj and head float32 or bfloat16 (then torch reads them widened; bfloat16 dot products may round
    the activations)."""
    torch.manual_seed(3 + 2 * rest + (wdt == torch.bfloat16))
    V, T = 50, 2
    a, m = _attention_layer(18, False), _moe_layer(2, True, 4, 2, True, True, 2.5)
    embed = _rand(V, H, std=1.0)
    norms = [((1 + _rand(H)).to(wdt), 1e-6) for _ in range(3)]   # enorm, hnorm, norm: (weight, eps)
    eh, head = _rand(H, 2 * H).to(wdt), _rand(V, H).to(wdt)
    nblocks = 8
    pool = torch.randn(nblocks * BS, C + R)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]])
    lens = torch.tensor([9, 6], dtype=torch.int32)
    out_slots = torch.stack([table[i, (n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    # the rows in: with `rest`, two rows that only write entries (positions before each sequence's last) first
    N = T + 2 if rest else T
    ids, prev = torch.randint(0, V, (N,)), torch.randn(N, H)
    out_rows = torch.tensor([2, 3]) if rest else None
    rest_rows = torch.tensor([0, 1]) if rest else None
    rest_slots = torch.tensor([table[0, 0] * BS + 6, table[1, 1] * BS + 0]) if rest else None
    pos = (lens - 1).float()[:, None] * torch.arange(1, R // 2 + 1) * 0.1
    cos, sin = pos.cos().contiguous(), pos.sin().contiguous()
    rpos = torch.tensor([6.0, 4.0])[:, None] * torch.arange(1, R // 2 + 1) * 0.1
    rcos, rsin = (rpos.cos().contiguous(), rpos.sin().contiguous()) if rest else (None, None)
    desc = (fused.LayerDesc * 1)()
    desc[0].mla, desc[0].wuk_t, desc[0].moe = ctypes.addressof(a.w), a.w_uk_t.data_ptr(), ctypes.addressof(m.w)
    got_pool = pool.clone()
    desc[0].pool, desc[0].S = got_pool.data_ptr(), got_pool.shape[0]
    out, tok = fused.mtp_pass(desc, a.w, m.w, None, ids, embed, *norms[:2], eh, prev, norms[2], head, cos, sin,
                              out_slots, table, lens, int(lens.max()), BS, out_rows, rest_rows, rest_slots, rcos, rsin)

    f = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[wdt]
    x = F.linear(torch.cat([_rms(embed[ids], norms[0][0].float(), 1e-6), _rms(prev, norms[1][0].float(), 1e-6)],
                           -1), eh.float())
    ref_pool = pool.clone()
    if rest:
        kv = F.linear(_rms(x[rest_rows], a.t["in_w"], a.eps["in_eps"]), a.t["wkva"])
        ref_pool[rest_slots] = torch.cat([_rms(kv[:, :C], a.t["kva_w"], a.eps["kva_eps"]),
                                          _rope(kv[:, C:], rcos, rsin, False)], -1)
        x = x[out_rows]
    desc[0].pool = ref_pool.data_ptr()
    ref_out, _, _ = fused.decode_stack(x, desc, [a.w], [m.w], [None], cos, sin, out_slots, table, lens,
                                       int(lens.max()), BS)
    torch.testing.assert_close(out, ref_out, atol=f, rtol=f)
    torch.testing.assert_close(got_pool, ref_pool, atol=f, rtol=f)
    logits = F.linear(_rms(out, norms[2][0].float(), 1e-6), head.float())
    assert tok.shape == (T, 1)
    tok = tok[:, 0]
    assert (logits.gather(1, tok[:, None]).squeeze(1) >= logits.max(-1).values - f * logits.abs().max()).all()
    if wdt == torch.float32:
        assert torch.equal(tok, logits.argmax(-1))
    # a slot outside the pool: named, before anything is written
    if rest:
        bad, before, S = rest_slots.clone(), got_pool.clone(), pool.shape[0]
        bad[1] = S
        desc[0].pool = got_pool.data_ptr()
        with pytest.raises(ValueError, match=f"row 1's slot {S} is outside the pool's {S} rows"):
            fused.mtp_pass(desc, a.w, m.w, None, ids, embed, *norms[:2], eh, prev, norms[2], head, cos, sin,
                           out_slots, table, lens, int(lens.max()), BS, out_rows, rest_rows, bad, rcos, rsin)
        assert torch.equal(got_pool, before)


def test_mtp_pass_later_passes_equal_one_pass_at_a_time():
    """mtp_pass with later passes (each row's draft and output fed back in at its next position, a row stopping
    where its slot is -1) == the same passes one call each, on the rows still running: the drafts, each row's last
    output and the cache entries, bit-equal (the same C calls)."""
    torch.manual_seed(5)
    V, T, P = 50, 3, 3
    a, m = _attention_layer(18, True), _moe_layer(2, True, 4, 2, True, True, 2.5)
    embed = _rand(V, H, std=1.0)
    norms = [(1 + _rand(H), 1e-6) for _ in range(3)]
    eh, head = _rand(H, 2 * H), _rand(V, H)
    pool = torch.randn(12 * BS, C + R)
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    lens = torch.tensor([5, 9, 11], dtype=torch.int32)            # positions 4, 8, 10
    slot = lambda t, p: int(table[t, p // BS]) * BS + p % BS
    slots = torch.tensor([slot(t, int(n) - 1) for t, n in enumerate(lens)])
    # later positions: row 0 at 5, 6; row 1 at 9, then stops; row 2 stops at once
    nslots = torch.tensor([[slot(0, 5), slot(0, 6)], [slot(1, 9), -1], [-1, -1]])
    nlens = torch.tensor([[6, 7], [10, 0], [0, 0]], dtype=torch.int32)
    npos = torch.tensor([[5.0, 6.0], [9.0, 0.0], [0.0, 0.0]])
    ang = lambda p: p[..., None] * torch.arange(1, R // 2 + 1) * 0.1
    cos, sin = ang((lens - 1).float()).cos().contiguous(), ang((lens - 1).float()).sin().contiguous()
    ncos, nsin = ang(npos).cos().contiguous(), ang(npos).sin().contiguous()
    ids, prev = torch.randint(0, V, (T,)), torch.randn(T, H)

    def call(pool_, *args, **kw):
        desc = (fused.LayerDesc * 1)()
        desc[0].mla, desc[0].wuk_t, desc[0].moe = ctypes.addressof(a.w), a.w_uk_t.data_ptr(), ctypes.addressof(m.w)
        desc[0].pool, desc[0].S = pool_.data_ptr(), pool_.shape[0]
        return fused.mtp_pass(desc, a.w, m.w, None, *args, **kw)

    got_pool = pool.clone()
    out, tok = call(got_pool, ids, embed, *norms[:2], eh, prev, norms[2], head, cos, sin, slots, table, lens,
                    int(lens.max()), BS, later=(nslots, nlens, ncos, nsin))
    assert tok.shape == (T, P) and tok[1, 2] == -1 and (tok[2, 1:] == -1).all()

    ref_pool = pool.clone()
    o, t1 = call(ref_pool, ids, embed, *norms[:2], eh, prev, norms[2], head, cos, sin, slots, table, lens,
                 int(lens.max()), BS)
    ref_tok, last = [[int(x)] for x in t1[:, 0]], o.clone()
    for j in range(1, P):
        run = [t for t in range(T) if nslots[t, j - 1] >= 0]
        r = torch.tensor(run)
        o, tj = call(ref_pool, torch.tensor([ref_tok[t][-1] for t in run]), embed, *norms[:2], eh,
                     last[r].contiguous(), norms[2], head, ncos[r, j - 1].contiguous(), nsin[r, j - 1].contiguous(),
                     nslots[r, j - 1].contiguous(), table[r].contiguous(), nlens[r, j - 1].contiguous(),
                     int(nlens.max()), BS)
        for i, t in enumerate(run):
            ref_tok[t].append(int(tj[i, 0]))
            last[t] = o[i]
    assert [[x for x in row if x >= 0] for row in tok.tolist()] == ref_tok
    assert torch.equal(out, last) and torch.equal(got_pool, ref_pool)
