/* Every struct of wideep.h, field by field, as this compiler lays it out: cpu/build.py checks each ctypes
   Structure against this table when it loads the library (a field the two sides disagree on, or one only
   one side has, is an error naming the struct and the field), so a struct edited on one side only fails
   at load instead of passing garbage. */
#include "wideep.h"

#define FIELD(S, f) {#S, #f, offsetof(S, f), sizeof(((S *)0)->f)},
#define SIZE(S) {#S, NULL, 0, sizeof(S)},

static const wd_layout table[] = {
    SIZE(wd_mla_weights)
    FIELD(wd_mla_weights, wdt)
    FIELD(wd_mla_weights, in_w) FIELD(wd_mla_weights, post_w) FIELD(wd_mla_weights, wqa) FIELD(wd_mla_weights, qa_w)
    FIELD(wd_mla_weights, wq) FIELD(wd_mla_weights, wkva) FIELD(wd_mla_weights, kva_w) FIELD(wd_mla_weights, wkvb)
    FIELD(wd_mla_weights, wo) FIELD(wd_mla_weights, in_eps) FIELD(wd_mla_weights, post_eps)
    FIELD(wd_mla_weights, qa_eps) FIELD(wd_mla_weights, kva_eps) FIELD(wd_mla_weights, scale)
    FIELD(wd_mla_weights, H) FIELD(wd_mla_weights, Q) FIELD(wd_mla_weights, N) FIELD(wd_mla_weights, dn)
    FIELD(wd_mla_weights, R) FIELD(wd_mla_weights, C) FIELD(wd_mla_weights, dv) FIELD(wd_mla_weights, interleave)
    FIELD(wd_mla_weights, pwdt)

    SIZE(wd_moe_weights)
    FIELD(wd_moe_weights, wdt)
    FIELD(wd_moe_weights, gw) FIELD(wd_moe_weights, gbias) FIELD(wd_moe_weights, w13) FIELD(wd_moe_weights, w2)
    FIELD(wd_moe_weights, sg) FIELD(wd_moe_weights, su) FIELD(wd_moe_weights, sd) FIELD(wd_moe_weights, scale)
    FIELD(wd_moe_weights, H) FIELD(wd_moe_weights, E) FIELD(wd_moe_weights, I) FIELD(wd_moe_weights, Is)
    FIELD(wd_moe_weights, k) FIELD(wd_moe_weights, G) FIELD(wd_moe_weights, topk_group)
    FIELD(wd_moe_weights, sigmoid) FIELD(wd_moe_weights, method) FIELD(wd_moe_weights, norm)
    FIELD(wd_moe_weights, s13) FIELD(wd_moe_weights, s2) FIELD(wd_moe_weights, br) FIELD(wd_moe_weights, bk)
    FIELD(wd_moe_weights, sdt)

    SIZE(wd_fp8_mat)
    FIELD(wd_fp8_mat, q) FIELD(wd_fp8_mat, s) FIELD(wd_fp8_mat, lds) FIELD(wd_fp8_mat, br) FIELD(wd_fp8_mat, bk)

    SIZE(wd_mlp_weights)
    FIELD(wd_mlp_weights, wdt)
    FIELD(wd_mlp_weights, sg) FIELD(wd_mlp_weights, su) FIELD(wd_mlp_weights, sd) FIELD(wd_mlp_weights, H)
    FIELD(wd_mlp_weights, Is)

    SIZE(wd_layer_desc)
    FIELD(wd_layer_desc, pdt)
    FIELD(wd_layer_desc, mla) FIELD(wd_layer_desc, wuk_t) FIELD(wd_layer_desc, pool) FIELD(wd_layer_desc, S)
    FIELD(wd_layer_desc, moe) FIELD(wd_layer_desc, mlp) FIELD(wd_layer_desc, load)

    SIZE(wd_hc_enter_args)
    FIELD(wd_hc_enter_args, x) FIELD(wd_hc_enter_args, fn) FIELD(wd_hc_enter_args, base)
    FIELD(wd_hc_enter_args, scale) FIELD(wd_hc_enter_args, pre) FIELD(wd_hc_enter_args, post)
    FIELD(wd_hc_enter_args, comb) FIELD(wd_hc_enter_args, y) FIELD(wd_hc_enter_args, T) FIELD(wd_hc_enter_args, n)
    FIELD(wd_hc_enter_args, H) FIELD(wd_hc_enter_args, iters) FIELD(wd_hc_enter_args, head)
    FIELD(wd_hc_enter_args, xdt) FIELD(wd_hc_enter_args, ydt) FIELD(wd_hc_enter_args, eps)
    FIELD(wd_hc_enter_args, norm_eps)

    SIZE(wd_hc_leave_args)
    FIELD(wd_hc_leave_args, x) FIELD(wd_hc_leave_args, out) FIELD(wd_hc_leave_args, post)
    FIELD(wd_hc_leave_args, comb) FIELD(wd_hc_leave_args, y) FIELD(wd_hc_leave_args, T) FIELD(wd_hc_leave_args, n)
    FIELD(wd_hc_leave_args, H) FIELD(wd_hc_leave_args, xdt) FIELD(wd_hc_leave_args, odt)

    SIZE(wd_rmsnorm_args)
    FIELD(wd_rmsnorm_args, wdt)
    FIELD(wd_rmsnorm_args, x) FIELD(wd_rmsnorm_args, w) FIELD(wd_rmsnorm_args, y) FIELD(wd_rmsnorm_args, ldx)
    FIELD(wd_rmsnorm_args, ldy) FIELD(wd_rmsnorm_args, M) FIELD(wd_rmsnorm_args, N) FIELD(wd_rmsnorm_args, eps)
    FIELD(wd_rmsnorm_args, xdt) FIELD(wd_rmsnorm_args, ydt)

    SIZE(wd_rope_args)
    FIELD(wd_rope_args, x) FIELD(wd_rope_args, cos) FIELD(wd_rope_args, sin) FIELD(wd_rope_args, y)
    FIELD(wd_rope_args, T) FIELD(wd_rope_args, Hh) FIELD(wd_rope_args, R) FIELD(wd_rope_args, sxt)
    FIELD(wd_rope_args, sxh) FIELD(wd_rope_args, interleave) FIELD(wd_rope_args, xdt) FIELD(wd_rope_args, ydt)

    SIZE(wd_bmm_nt_args)
    FIELD(wd_bmm_nt_args, wdt)
    FIELD(wd_bmm_nt_args, x) FIELD(wd_bmm_nt_args, w) FIELD(wd_bmm_nt_args, y) FIELD(wd_bmm_nt_args, B)
    FIELD(wd_bmm_nt_args, sxb) FIELD(wd_bmm_nt_args, ldx) FIELD(wd_bmm_nt_args, swb) FIELD(wd_bmm_nt_args, ldw)
    FIELD(wd_bmm_nt_args, syb) FIELD(wd_bmm_nt_args, ldy) FIELD(wd_bmm_nt_args, M) FIELD(wd_bmm_nt_args, N)
    FIELD(wd_bmm_nt_args, K) FIELD(wd_bmm_nt_args, xdt)

    SIZE(wd_experts_args)
    FIELD(wd_experts_args, wdt)
    FIELD(wd_experts_args, x) FIELD(wd_experts_args, w13) FIELD(wd_experts_args, w2) FIELD(wd_experts_args, wts)
    FIELD(wd_experts_args, ids) FIELD(wd_experts_args, out) FIELD(wd_experts_args, scratch)
    FIELD(wd_experts_args, iscratch) FIELD(wd_experts_args, T) FIELD(wd_experts_args, H) FIELD(wd_experts_args, I)
    FIELD(wd_experts_args, El) FIELD(wd_experts_args, k) FIELD(wd_experts_args, s13) FIELD(wd_experts_args, s2)
    FIELD(wd_experts_args, br) FIELD(wd_experts_args, bk) FIELD(wd_experts_args, limit) FIELD(wd_experts_args, xdt)

    SIZE(wd_linear_fp4_args)
    FIELD(wd_linear_fp4_args, x) FIELD(wd_linear_fp4_args, w) FIELD(wd_linear_fp4_args, s) FIELD(wd_linear_fp4_args, y)
    FIELD(wd_linear_fp4_args, xp)
    FIELD(wd_linear_fp4_args, M) FIELD(wd_linear_fp4_args, N) FIELD(wd_linear_fp4_args, K)
    FIELD(wd_linear_fp4_args, ldx) FIELD(wd_linear_fp4_args, ldw) FIELD(wd_linear_fp4_args, lds)
    FIELD(wd_linear_fp4_args, ldy) FIELD(wd_linear_fp4_args, odt)

    SIZE(wd_linear_fp8_args)
    FIELD(wd_linear_fp8_args, x) FIELD(wd_linear_fp8_args, w) FIELD(wd_linear_fp8_args, s) FIELD(wd_linear_fp8_args, y)
    FIELD(wd_linear_fp8_args, M) FIELD(wd_linear_fp8_args, N) FIELD(wd_linear_fp8_args, K)
    FIELD(wd_linear_fp8_args, ldx) FIELD(wd_linear_fp8_args, ldw) FIELD(wd_linear_fp8_args, lds)
    FIELD(wd_linear_fp8_args, ldy) FIELD(wd_linear_fp8_args, br) FIELD(wd_linear_fp8_args, bk)
    FIELD(wd_linear_fp8_args, odt)

    SIZE(wd_mla_decode_args)
    FIELD(wd_mla_decode_args, pdt)
    FIELD(wd_mla_decode_args, q) FIELD(wd_mla_decode_args, pool) FIELD(wd_mla_decode_args, table)
    FIELD(wd_mla_decode_args, lens) FIELD(wd_mla_decode_args, out) FIELD(wd_mla_decode_args, scratch)
    FIELD(wd_mla_decode_args, pool8) FIELD(wd_mla_decode_args, kb) FIELD(wd_mla_decode_args, B)
    FIELD(wd_mla_decode_args, Nh) FIELD(wd_mla_decode_args, D) FIELD(wd_mla_decode_args, C)
    FIELD(wd_mla_decode_args, num_blocks) FIELD(wd_mla_decode_args, max_blocks) FIELD(wd_mla_decode_args, max_len)
    FIELD(wd_mla_decode_args, bs) FIELD(wd_mla_decode_args, W) FIELD(wd_mla_decode_args, soff)
    FIELD(wd_mla_decode_args, roff) FIELD(wd_mla_decode_args, group) FIELD(wd_mla_decode_args, scale)
    FIELD(wd_mla_decode_args, fp4) FIELD(wd_mla_decode_args, toff)

    SIZE(wd_bf16_dot_args)
    FIELD(wd_bf16_dot_args, want) FIELD(wd_bf16_dot_args, supported)

    SIZE(wd_amx_args)
    FIELD(wd_amx_args, want) FIELD(wd_amx_args, supported) FIELD(wd_amx_args, gemm_calls)
    FIELD(wd_amx_args, mla_calls) FIELD(wd_amx_args, fp8_parts)

    SIZE(wd_route_args)
    FIELD(wd_route_args, x) FIELD(wd_route_args, w) FIELD(wd_route_args, bias) FIELD(wd_route_args, logits)
    FIELD(wd_route_args, wts) FIELD(wd_route_args, ids) FIELD(wd_route_args, T) FIELD(wd_route_args, H)
    FIELD(wd_route_args, E) FIELD(wd_route_args, G) FIELD(wd_route_args, topk_group) FIELD(wd_route_args, k)
    FIELD(wd_route_args, sigmoid) FIELD(wd_route_args, method) FIELD(wd_route_args, norm) FIELD(wd_route_args, scale)

    SIZE(wd_mla_layer_args)
    FIELD(wd_mla_layer_args, pdt)
    FIELD(wd_mla_layer_args, w) FIELD(wd_mla_layer_args, wuk_t) FIELD(wd_mla_layer_args, x)
    FIELD(wd_mla_layer_args, cos) FIELD(wd_mla_layer_args, sin) FIELD(wd_mla_layer_args, pool)
    FIELD(wd_mla_layer_args, slots) FIELD(wd_mla_layer_args, table) FIELD(wd_mla_layer_args, lens)
    FIELD(wd_mla_layer_args, h) FIELD(wd_mla_layer_args, mlp_in) FIELD(wd_mla_layer_args, buf)
    FIELD(wd_mla_layer_args, T) FIELD(wd_mla_layer_args, S) FIELD(wd_mla_layer_args, max_blocks)
    FIELD(wd_mla_layer_args, max_len) FIELD(wd_mla_layer_args, bs)

    SIZE(wd_moe_layer_args)
    FIELD(wd_moe_layer_args, w) FIELD(wd_moe_layer_args, h) FIELD(wd_moe_layer_args, x) FIELD(wd_moe_layer_args, load)
    FIELD(wd_moe_layer_args, ids) FIELD(wd_moe_layer_args, iscratch) FIELD(wd_moe_layer_args, out)
    FIELD(wd_moe_layer_args, wts) FIELD(wd_moe_layer_args, scratch) FIELD(wd_moe_layer_args, T)

    SIZE(wd_mlp_layer_args)
    FIELD(wd_mlp_layer_args, w) FIELD(wd_mlp_layer_args, h) FIELD(wd_mlp_layer_args, x) FIELD(wd_mlp_layer_args, out)
    FIELD(wd_mlp_layer_args, scratch) FIELD(wd_mlp_layer_args, T)

    SIZE(wd_decode_stack_args)
    FIELD(wd_decode_stack_args, layers) FIELD(wd_decode_stack_args, x0) FIELD(wd_decode_stack_args, cos)
    FIELD(wd_decode_stack_args, sin) FIELD(wd_decode_stack_args, slots) FIELD(wd_decode_stack_args, table)
    FIELD(wd_decode_stack_args, lens) FIELD(wd_decode_stack_args, out) FIELD(wd_decode_stack_args, wts)
    FIELD(wd_decode_stack_args, buf) FIELD(wd_decode_stack_args, ids) FIELD(wd_decode_stack_args, ibuf)
    FIELD(wd_decode_stack_args, failed) FIELD(wd_decode_stack_args, L) FIELD(wd_decode_stack_args, T)
    FIELD(wd_decode_stack_args, max_blocks) FIELD(wd_decode_stack_args, max_len) FIELD(wd_decode_stack_args, bs)

    SIZE(wd_mtp_pass_args)
    FIELD(wd_mtp_pass_args, layer) FIELD(wd_mtp_pass_args, ids) FIELD(wd_mtp_pass_args, embed)
    FIELD(wd_mtp_pass_args, enorm_w) FIELD(wd_mtp_pass_args, hnorm_w) FIELD(wd_mtp_pass_args, eh_w)
    FIELD(wd_mtp_pass_args, norm_w) FIELD(wd_mtp_pass_args, head_w) FIELD(wd_mtp_pass_args, prev)
    FIELD(wd_mtp_pass_args, cos) FIELD(wd_mtp_pass_args, sin) FIELD(wd_mtp_pass_args, rest_cos)
    FIELD(wd_mtp_pass_args, rest_sin) FIELD(wd_mtp_pass_args, ncos) FIELD(wd_mtp_pass_args, nsin)
    FIELD(wd_mtp_pass_args, slots) FIELD(wd_mtp_pass_args, table) FIELD(wd_mtp_pass_args, rest)
    FIELD(wd_mtp_pass_args, rest_slots) FIELD(wd_mtp_pass_args, out_rows) FIELD(wd_mtp_pass_args, nslots)
    FIELD(wd_mtp_pass_args, lens) FIELD(wd_mtp_pass_args, nlens) FIELD(wd_mtp_pass_args, out)
    FIELD(wd_mtp_pass_args, wts) FIELD(wd_mtp_pass_args, buf) FIELD(wd_mtp_pass_args, pf) FIELD(wd_mtp_pass_args, tok)
    FIELD(wd_mtp_pass_args, moe_ids) FIELD(wd_mtp_pass_args, ibuf) FIELD(wd_mtp_pass_args, pi)
    FIELD(wd_mtp_pass_args, failed) FIELD(wd_mtp_pass_args, enorm_eps) FIELD(wd_mtp_pass_args, hnorm_eps)
    FIELD(wd_mtp_pass_args, norm_eps) FIELD(wd_mtp_pass_args, pad) FIELD(wd_mtp_pass_args, T)
    FIELD(wd_mtp_pass_args, n_in) FIELD(wd_mtp_pass_args, n_rest) FIELD(wd_mtp_pass_args, passes)
    FIELD(wd_mtp_pass_args, H) FIELD(wd_mtp_pass_args, V) FIELD(wd_mtp_pass_args, edt) FIELD(wd_mtp_pass_args, wdt)
    FIELD(wd_mtp_pass_args, max_blocks) FIELD(wd_mtp_pass_args, max_len) FIELD(wd_mtp_pass_args, bs)

    SIZE(wd_layout)
    FIELD(wd_layout, name) FIELD(wd_layout, field) FIELD(wd_layout, offset) FIELD(wd_layout, size)

    {NULL, NULL, 0, 0},
};

const wd_layout *wd_layouts(void) { return table; }
