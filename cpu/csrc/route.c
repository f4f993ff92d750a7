#include "wideep.h"

/* The router (moe/gate.py Gate), fused. logits [T, E] = x [T, H] @ w [E, H]^T (scratch); per token:
   scores (softmax or sigmoid), choice = scores + bias (when given); grouped methods keep the
   topk_group groups with the best group score (method 1: the group's max, 2: the sum of its top
   two) and hide the rest; the top k of choice (descending, the lower id first among equals) are
   the ids, their unbiased scores the weights (renormalised when norm, times scale). */
static int64_t best_of(const float *v, const unsigned char *taken, int64_t n) {
    int64_t b = -1;
    for (int64_t e = 0; e < n; e++)
        if (!taken[e] && (b < 0 || v[e] > v[b])) b = e;
    return b;
}

void route(const float *x, int64_t T, int64_t H, const float *w, int64_t E, const float *bias, int sigmoid,
           int method, int64_t G, int64_t topk_group, int64_t k, int norm, float scale, float *logits, int64_t *ids,
           float *wts) {
    linear(x, H, w, H, logits, E, T, E, H);
    float choice[E], gscore[G > 0 ? G : 1];
    unsigned char taken[E], gtaken[G > 0 ? G : 1];
    int64_t per = G > 0 ? E / G : E;
    for (int64_t t = 0; t < T; t++) {
        float *sc = logits + t * E;
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-sc[e]));
        } else {
            float mx = sc[0], sum = 0;
            for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
            for (int64_t e = 0; e < E; e++) { sc[e] = expf(sc[e] - mx); sum += sc[e]; }
            for (int64_t e = 0; e < E; e++) sc[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) { choice[e] = bias ? sc[e] + bias[e] : sc[e]; taken[e] = 0; }
        if (method != 0 && G > 1) {
            for (int64_t g = 0; g < G; g++) {
                const float *c = choice + g * per;
                float a = c[0], b = -INFINITY;          /* the best and second best of the group */
                for (int64_t j = 1; j < per; j++) {
                    if (c[j] > a) { b = a; a = c[j]; } else if (c[j] > b) b = c[j];
                }
                gscore[g] = method == 2 ? a + b : a;
                gtaken[g] = 0;
            }
            for (int64_t i = 0; i < topk_group; i++) gtaken[best_of(gscore, gtaken, G)] = 1;
            for (int64_t g = 0; g < G; g++)
                if (!gtaken[g]) memset(taken + g * per, 1, per);   /* hidden: never chosen */
        }
        int64_t *id = ids + t * k;
        float *wt = wts + t * k, total = 0;
        for (int64_t i = 0; i < k; i++) {
            int64_t e = best_of(choice, taken, E);
            taken[e] = 1;
            id[i] = e;
            wt[i] = sc[e];
            total += sc[e];
        }
        float f = norm ? scale / (total + 1e-20f) : scale;
        for (int64_t i = 0; i < k; i++) wt[i] *= f;
    }
}

void wd_route(const wd_route_args *a) {
    route(a->x, a->T, a->H, a->w, a->E, a->bias, (int)a->sigmoid, (int)a->method, a->G, a->topk_group, a->k,
          (int)a->norm, a->scale, a->logits, a->ids, a->wts);
}
