/* A decoder layer's halves and a decode step's whole stack of layers, each one C call (cpu/fused.py):
   exactly the kernel calls of the operation-by-operation path, in its order. */
#include "wideep.h"

/* The cache entries of T rows from their kv_a projections kv [T, C+R]: lat [T, C+R] = (kv_a_norm(c), rope(k_pe)),
   written to the pool's rows slots[t] (dtype pdt; a bfloat16 pool rounded to nearest even). kpe: T R floats. */
static void write_latents(const wd_mla_weights *w, const float *kv, int64_t T, const float *cos, const float *sin,
                          void *pool, int64_t pdt, const int64_t *slots, float *lat, float *kpe) {
    int64_t C = w->C, R = w->R, D = C + R;
    rmsnorm(kv, D, w->kva_w, w->wdt, lat, D, T, C, w->kva_eps);            /* the normed latent c */
    rope(kv + C, T, 1, R, D, R, cos, sin, kpe, (int)w->interleave);        /* k_pe */
    for (int64_t t = 0; t < T; t++) {
        memcpy(lat + t * D + C, kpe + t * R, R * sizeof(float));
        if (pdt == WD_BF16)
            for (int64_t c = 0; c < D; c++) ((uint16_t *)pool)[slots[t] * D + c] = to_bf16(lat[t * D + c]);
        else
            memcpy((float *)pool + slots[t] * D, lat + t * D, D * sizeof(float));
    }
}

/* One decode step of an MLA layer around its attention (attention_mla/mla.py MLA's decode; cpu/decode_plan.py): T
   tokens, each the only query of its sequence, a float32 cache. h = x + o_proj(attention(input_norm(x)))
   and mlp_in = post_norm(h): the same kernels, in the same order, as the unfused path (q-LoRA or q_proj,
   kv_a, the two RoPEs, the cache write, the absorbed query, mla_decode, W_UV, o_proj), in one call.
   The layer's weights and sizes in a struct made once (cpu/fused.py MlaWeights): wq is q_b_proj
   [N (dn+R), Q] (Q > 0, after wqa [Q, H]) or q_proj [N (dn+R), H] (Q = 0); wkvb kv_b_proj [N (dn+dv), C];
   wuk_t [N, C, dn] apart (MLA.w_uk_t, made again when kv_b_proj changes). buf: T (2H + Q + N(dn+R) +
   2(C+R) + R + NR + N(C+R) + NC + N dv) + N (max_len + 1) floats. The weights (and W_UK^T) of dtype
   w->wdt (the projections wqa, wq, wkva, wo of w->pwdt), the pool of dtype pdt (a bfloat16 pool is written rounded to nearest even). Returns 0; -1 (mla_decode's: a length or block id
   out of range, nothing attended); -2 - t when token t's slot is outside the pool's S rows (nothing
   written). */
static int64_t mla_layer(const wd_mla_weights *w, const void *wuk_t, const float *x, int64_t T, const float *cos,
                         const float *sin, void *pool, int64_t pdt, int64_t S, const int64_t *slots,
                         const int64_t *table, int64_t max_blocks, const int32_t *lens, int64_t max_len, int64_t bs,
                         float *h, float *mlp_in, float *buf) {
    int64_t H = w->H, Q = w->Q, N = w->N, dn = w->dn, R = w->R, C = w->C, dv = w->dv, wdt = w->wdt;
    int64_t pwdt = w->pwdt;
    int64_t esz = wdt == WD_BF16 ? 2 : 4;
    int64_t D = C + R, dq = dn + R;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= S) return -2 - t;
    float *xn = buf, *qa = xn + T * H, *q = qa + T * Q, *kv = q + T * N * dq, *lat = kv + T * D,
          *kpe = lat + T * D, *qpe = kpe + T * R, *qabs = qpe + T * N * R, *olat = qabs + T * N * D,
          *o = olat + T * N * C, *y = o + T * N * dv, *msc = y + T * H;
    rmsnorm(x, H, w->in_w, wdt, xn, H, T, H, w->in_eps);
    int hints = pwdt == WD_BF16 && wdt == WD_BF16;   /* each projection's successor asked into L2 (amx_next) */
    if (Q) {
        if (hints) amx_next(w->wq, Q, N * dq, Q);
        linear_w(xn, H, w->wqa, pwdt, H, qa, Q, T, Q, H);
        rmsnorm(qa, Q, w->qa_w, wdt, qa, Q, T, Q, w->qa_eps);
        if (hints) amx_next(w->wkva, H, D, H);
        linear_w(qa, Q, w->wq, pwdt, Q, q, N * dq, T, N * dq, Q);
    } else {
        if (hints) amx_next(w->wkva, H, D, H);
        linear_w(xn, H, w->wq, pwdt, H, q, N * dq, T, N * dq, H);
    }
    if (hints) amx_next(wuk_t, dn, C, dn);
    linear_w(xn, H, w->wkva, pwdt, H, kv, D, T, D, H);
    write_latents(w, kv, T, cos, sin, pool, pdt, slots, lat, kpe);
    rope(q + dn, T, N, R, N * dq, dq, cos, sin, qpe, (int)w->interleave);  /* q_pe [T, N, R] */
    bmm_nt(N, q, dq, N * dq, wuk_t, wdt, C * dn, dn, qabs, D, N * D, T, C, dn);   /* q_nope W_UK per head */
    for (int64_t t = 0; t < T * N; t++) memcpy(qabs + t * D + C, qpe + t * R, R * sizeof(float));
    int64_t rc = mla_decode(qabs, T, N, D, C, pool, pdt, S / bs, table, max_blocks, lens, max_len, bs, w->scale, olat,
                            msc, NULL, 0, 0, 0, 0, NULL, 0, 0);
    if (rc) return rc;
    bmm_nt(N, olat, C, N * C, (const char *)w->wkvb + dn * C * esz, wdt, (dn + dv) * C, C, o, dv, N * dv, T, dv,
           C);   /* W_UV */
    linear_w(o, N * dv, w->wo, pwdt, N * dv, y, H, T, H, N * dv);
    for (int64_t i = 0; i < T * H; i++) h[i] = x[i] + y[i];
    rmsnorm(h, H, w->post_w, wdt, mlp_in, H, T, H, w->post_eps);
    return 0;
}

/* An MoE layer's half on one EP rank (moe/layer.py MoELayer's operations; cpu/decode_plan.py): T tokens,
   every expert local
   and physical id = logical id. ids, wts = route(x); out = h + (experts(x) + shared(x)) with
   the shared experts' SwiGLU (sg, su [Is, H], sd [H, Is]; sg NULL: none): the kernels and the order of
   the operation-by-operation path. The layer's weights and router settings in a struct made once
   (cpu/fused.py MoeWeights). load [E] (NULL: off) += 1 per chosen id, as MoELayer.route counts for
   EPLB. iscratch: 2 (E + 1) + T k ints; scratch: T (E + H + max(2H + 3I, H + 2 Is)) floats. Returns 0
   (experts' error codes cannot occur: the router's ids are < E). */
static int64_t moe_layer(const wd_moe_weights *w, const float *h, const float *x, int64_t T, int64_t *load,
                         float *out, int64_t *ids, float *wts, int64_t *iscratch, float *scratch) {
    int64_t H = w->H, E = w->E, I = w->I, Is = w->Is, k = w->k;
    float *logits = scratch, *ye = logits + T * E, *rest = ye + T * H;
    route(x, T, H, w->gw, E, w->gbias, (int)w->sigmoid, (int)w->method, w->G, w->topk_group, k, (int)w->norm,
          w->scale, logits, ids, wts);
    if (load)
        for (int64_t p = 0; p < T * k; p++) load[ids[p]]++;
    memset(ye, 0, T * H * sizeof(float));
    int64_t rc = experts(x, WD_F32, T, H, I, E, w->w13, w->w2, w->wdt, w->s13, w->s2, w->br, w->bk, ids, wts, k, ye, iscratch,
                         rest, 0.0f);
    if (rc) return rc;
    if (!w->sg) {
        for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + ye[i];
        return 0;
    }
    float *y = rest;
    swiglu(x, T, H, w->sg, w->su, w->sd, w->sdt, Is, y, y + T * H);
    for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + (ye[i] + y[i]);
    return 0;
}

/* A dense layer's MLP half: out = h + MLP(x) (layers/mlp.py MLP on the cpu backend). */
static void mlp_half(const wd_mlp_weights *w, const float *h, const float *x, int64_t T, float *out, float *scratch) {
    int64_t H = w->H;
    float *y = scratch;
    swiglu(x, T, H, w->sg, w->su, w->sd, w->wdt, w->Is, y, y + T * H);
    for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + y[i];
}

/* A whole decode step's decoder layers, one call (cpu/decode_plan.py, the stack path): layer l's
   attention half (mla_layer) then its MoE half (moe_layer) or dense MLP half (mlp_half), each
   layer's output the next one's input, exactly the calls the per-layer path makes. layers[l]: its
   structs (mlp NULL for an MoE layer), W_UK^T, its cache pool [S, C+R] and EPLB counts (or NULL).
   x0 [T, H] in, out [T, H] the last layer's output; ids, wts [n_moe, T, k] the MoE layers' routing.
   buf: T (4 H) + the largest scratch of a layer; ibuf: the MoE layers' int scratch. Returns 0, or a
   layer's error code (mla_layer's) with *failed = its layer (earlier layers have run). */
static int64_t decode_stack(const wd_layer_desc *layers, int64_t L, const float *x0, int64_t T, const float *cos,
                            const float *sin, const int64_t *slots, const int64_t *table, int64_t max_blocks,
                            const int32_t *lens, int64_t max_len, int64_t bs, float *out, int64_t *ids, float *wts,
                            float *buf, int64_t *ibuf, int64_t *failed) {
    int64_t H = layers[0].mla->H;
    float *h = buf, *mlp_in = h + T * H, *xa = mlp_in + T * H, *xb = xa + T * H, *scratch = xb + T * H;
    const float *x = x0;
    for (int64_t l = 0, m = 0; l < L; l++) {
        const wd_layer_desc *d = layers + l;
        int64_t rc = mla_layer(d->mla, d->wuk_t, x, T, cos, sin, d->pool, d->pdt, d->S, slots, table, max_blocks, lens,
                               max_len, bs, h, mlp_in, scratch);
        if (rc) { *failed = l; return rc; }
        float *dst = l == L - 1 ? out : (l % 2 ? xb : xa);
        if (d->moe) {
            int64_t k = d->moe->k;
            moe_layer(d->moe, h, mlp_in, T, d->load, dst, ids + m * T * k, wts + m * T * k, ibuf, scratch);
            m++;
        } else {
            mlp_half(d->mlp, h, mlp_in, T, dst, scratch);
        }
        x = dst;
    }
    return 0;
}

int64_t wd_mla_layer(const wd_mla_layer_args *a) {
    return mla_layer(a->w, a->wuk_t, a->x, a->T, a->cos, a->sin, a->pool, a->pdt, a->S, a->slots, a->table, a->max_blocks,
                     a->lens, a->max_len, a->bs, a->h, a->mlp_in, a->buf);
}

int64_t wd_moe_layer(const wd_moe_layer_args *a) {
    return moe_layer(a->w, a->h, a->x, a->T, a->load, a->out, a->ids, a->wts, a->iscratch, a->scratch);
}

void wd_mlp_layer(const wd_mlp_layer_args *a) { mlp_half(a->w, a->h, a->x, a->T, a->out, a->scratch); }

int64_t wd_decode_stack(const wd_decode_stack_args *a) {
    return decode_stack(a->layers, a->L, a->x0, a->T, a->cos, a->sin, a->slots, a->table, a->max_blocks, a->lens,
                        a->max_len, a->bs, a->out, a->ids, a->wts, a->buf, a->ibuf, a->failed);
}

static int64_t mtp_one(const wd_mtp_pass_args *a) {
    int64_t T = a->T, N = a->n_in, H = a->H, V = a->V;
    const wd_layer_desc *d = a->layer;
    const wd_mla_weights *w = d->mla;
    int64_t D = w->C + w->R;
    for (int64_t i = 0; i < a->n_rest; i++)
        if (a->rest_slots[i] < 0 || a->rest_slots[i] >= d->S) return -2 - a->rest[i];
    float *xin = a->buf, *x = xin + N * 2 * H, *xo = x + N * H, *rest = xo + T * H;
    const float *in = a->prev;
    if (a->embed) {   /* the input of every row */
        for (int64_t t = 0; t < N; t++)
            row_f32((const char *)a->embed + a->ids[t] * H * (a->edt == WD_BF16 ? 2 : 4), a->edt, H, xin + t * 2 * H);
        rmsnorm(xin, 2 * H, a->enorm_w, a->wdt, xin, 2 * H, N, H, a->enorm_eps);
        rmsnorm(a->prev, H, a->hnorm_w, a->wdt, xin + H, 2 * H, N, H, a->hnorm_eps);
        linear_w(xin, 2 * H, a->eh_w, a->wdt, 2 * H, x, H, N, H, 2 * H);
        in = x;
    }
    if (a->n_rest) {   /* rows without an output: their cache entries only (MLA.write_entries) */
        int64_t M = a->n_rest;
        float *xr = rest, *kv = xr + M * H, *lat = kv + M * D, *kpe = lat + M * D;
        for (int64_t i = 0; i < M; i++) memcpy(xr + i * H, in + a->rest[i] * H, H * sizeof(float));
        rmsnorm(xr, H, w->in_w, w->wdt, xr, H, M, H, w->in_eps);
        linear_w(xr, H, w->wkva, w->pwdt, H, kv, D, M, D, H);
        write_latents(w, kv, M, a->rest_cos, a->rest_sin, d->pool, d->pdt, a->rest_slots, lat, kpe);
    }
    if (a->out_rows) {
        for (int64_t t = 0; t < T; t++) memcpy(xo + t * H, in + a->out_rows[t] * H, H * sizeof(float));
        in = xo;
    }
    int64_t rc = decode_stack(d, 1, in, T, a->cos, a->sin, a->slots, a->table, a->max_blocks, a->lens,
                              a->max_len, a->bs, a->out, a->moe_ids, a->wts, rest, a->ibuf, a->failed);
    if (rc <= -2 && a->out_rows) return -2 - a->out_rows[-2 - rc];   /* the input row's index */
    if (rc) return rc;
    float *y = rest, *logits = y + T * H;
    rmsnorm(a->out, H, a->norm_w, a->wdt, y, H, T, H, a->norm_eps);
    linear_w(y, H, a->head_w, a->wdt, H, logits, V, T, V, H);
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * V;
        int64_t best = 0;
        for (int64_t v = 1; v < V; v++)
            if (l[v] > l[best]) best = v;
        a->tok[t] = best;
    }
    return 0;
}

int64_t wd_mtp_pass(const wd_mtp_pass_args *a) {
    int64_t P = a->passes, T = a->T, H = a->H, R2 = a->layer->mla->R / 2, M = a->max_blocks;
    if (P <= 1) return mtp_one(a);
    int64_t *live = a->pi, *ids = live + T, *slots = ids + T, *tj = slots + T, *table = tj + T;
    int32_t *lens = (int32_t *)(table + T * M);
    float *cur = a->pf, *prev = cur + T * H, *out = prev + T * H, *cos = out + T * H, *sin = cos + T * R2;
    wd_mtp_pass_args b = *a;
    b.passes = 1;
    b.tok = tj;
    int64_t rc = mtp_one(&b);
    if (rc) return rc;
    for (int64_t t = 0; t < T; t++) {
        a->tok[t * P] = tj[t];
        for (int64_t j = 1; j < P; j++) a->tok[t * P + j] = -1;
        live[t] = t;
    }
    memcpy(cur, a->out, T * H * sizeof(float));
    int64_t n = T;
    for (int64_t j = 1; j < P; j++) {   /* pass j + 1: each row's previous draft and output, one position on */
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++)
            if (a->nslots[live[i] * (P - 1) + j - 1] >= 0) live[m++] = live[i];
        n = m;
        if (!m) break;
        for (int64_t i = 0; i < m; i++) {
            int64_t t = live[i], at = t * (P - 1) + j - 1;
            ids[i] = a->tok[t * P + j - 1];
            slots[i] = a->nslots[at];
            lens[i] = a->nlens[at];
            memcpy(prev + i * H, cur + t * H, H * sizeof(float));
            memcpy(cos + i * R2, a->ncos + at * R2, R2 * sizeof(float));
            memcpy(sin + i * R2, a->nsin + at * R2, R2 * sizeof(float));
            memcpy(table + i * M, a->table + t * M, M * sizeof(int64_t));
        }
        b = *a;
        b.passes = 1;
        b.T = b.n_in = m;
        b.n_rest = 0;
        b.rest = b.rest_slots = b.out_rows = NULL;
        b.ids = ids, b.prev = prev, b.cos = cos, b.sin = sin, b.slots = slots, b.table = table, b.lens = lens;
        b.out = out, b.tok = tj;
        rc = mtp_one(&b);
        if (rc) return rc;
        for (int64_t i = 0; i < m; i++) {
            a->tok[live[i] * P + j] = tj[i];
            memcpy(cur + live[i] * H, out + i * H, H * sizeof(float));
        }
    }
    memcpy(a->out, cur, T * H * sizeof(float));
    return 0;
}
