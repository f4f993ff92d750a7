"""AsyncEngine.metrics() -> Prometheus text exposition format (version 0.0.4), written by hand so the
server needs no client library. Every family gets # HELP and # TYPE; counters end in _total;
latencies are histograms (cumulative `le` buckets ending at +Inf, then _sum and _count)."""
from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, key in metrics(), type, help)
_SCALARS = [
    ("wideep_requests_running", "running", "gauge", "Requests in the running batch, all DP ranks."),
    ("wideep_requests_waiting", "waiting", "gauge", "Requests waiting to be scheduled, all DP ranks."),
    ("wideep_requests_active", "active_requests", "gauge", "Requests accepted and not yet finished."),
    ("wideep_kv_cache_blocks_used", "kv_blocks_used", "gauge", "Paged latent KV blocks in use."),
    ("wideep_kv_cache_blocks_free", "kv_blocks_free", "gauge", "Paged latent KV blocks free (incl. evictable cached)."),
    ("wideep_prefix_cache_hit_rate", "prefix_cache_hit_rate", "gauge",
     "Prompt tokens found in the prefix cache / prompt tokens looked up, since start."),
    ("wideep_generation_tokens_per_second", "tokens_per_s", "gauge", "Generated tokens/s over the last 10 s."),
    ("wideep_generation_tokens_total", "generation_tokens_total", "counter", "Generated tokens."),
    ("wideep_prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens of finished requests."),
    ("wideep_preemptions_total", "preemptions", "counter", "Requests preempted (blocks freed, recomputed later)."),
    # prefill/decode disaggregation only (disagg/decode.py)
    ("wideep_kv_transfer_bytes_total", "kv_transfer_bytes_total", "counter", "Latent KV bytes received by decode ranks."),
    ("wideep_kv_transfers_total", "kv_transfers_total", "counter", "KV transfers completed (one per request)."),
    ("wideep_kv_transfers_waiting_for_blocks", "kv_transfers_waiting_for_blocks", "gauge",
     "Transfers waiting for free KV blocks on their decode rank (back-pressure)."),
    ("wideep_prefill_prompt_tokens_in_flight", "prefill_prompt_tokens_in_flight", "gauge",
     "Prompt tokens sent to the prefill pool whose first token is not back yet."),
    # speculative decoding (engine/spec_decode/), all DP ranks: vLLM's spec_decode families
    ("wideep_spec_decode_num_drafts_total", "spec_decode_num_drafts", "counter",
     "Verifications of a sequence's drafts (sequences x steps that drafted)."),
    ("wideep_spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens", "counter", "Draft tokens verified."),
    ("wideep_spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens", "counter",
     "Draft tokens accepted."),
    ("wideep_spec_decode_acceptance_rate", "spec_decode_acceptance_rate", "gauge",
     "Accepted / draft tokens, since start."),
    ("wideep_spec_decode_mean_acceptance_length", "spec_decode_mean_acceptance_length", "gauge",
     "Tokens per verification (1 + accepted / drafts), since start."),
    ("wideep_spec_decode_backoffs_total", "spec_decode_backoffs", "counter",
     "Times a sequence stopped drafting for a while because its drafts were rarely accepted."),
    ("wideep_spec_decode_retired_total", "spec_decode_retired", "counter",
     "MTP: sequences that stopped drafting for good (their drafts kept failing): the drafter skips them."),
    ("wideep_spec_decode_paused_sequences", "spec_decode_paused_seqs", "gauge",
     "Sequences not drafting in the last step because they are backing off."),
    ("wideep_spec_decode_steps_batch_off_total", "spec_decode_steps_batch_off", "counter",
     "Rank steps without drafts because more sequences ran than disable_by_batch_size."),
    ("wideep_spec_decode_started_paused_total", "spec_decode_started_paused", "counter",
     "New sequences that started backed off because their rank's recent drafts were rarely accepted."),
    ("wideep_serving", "serving", "gauge",
     "1 while the deployment serves (/health 200), 0 while ranks are lost and not re-formed out."),
    # surviving lost ranks (on_rank_loss = "continue")
    ("wideep_rank_losses_total", "rank_losses", "counter", "Ranks lost and survived (the ranks re-formed)."),
    ("wideep_requests_readmitted_total", "requests_readmitted", "counter",
     "Requests of lost ranks re-admitted on survivors."),
    ("wideep_recovery_seconds_last", "recovery_s_last", "gauge", "Loss noticed -> serving again, last re-forming."),
    ("wideep_expert_bytes_refetched_peer_total", "expert_bytes_refetched_peer", "counter",
     "Expert weight bytes copied from surviving peers after losses."),
    ("wideep_expert_bytes_refetched_checkpoint_total", "expert_bytes_refetched_checkpoint", "counter",
     "Expert weight bytes read back from the checkpoint after losses."),
    # the KV store (kvstore/metrics.py)
    ("wideep_prefill_tokens_total", "prefill_tokens_total", "counter",
     "Prompt tokens computed (not found in any KV tier), recomputation after preemption included."),
    ("wideep_kv_spills_total", "kv_spills_total", "counter", "Blocks spilled from the device cache to the host tier."),
    ("wideep_kv_spill_seconds_total", "kv_spill_seconds_total", "counter",
     "Step-thread seconds spent spilling blocks to the host tier (enqueueing the copies, on CUDA)."),
    ("wideep_kv_loads_total", "kv_loads_total", "counter", "Blocks loaded from the host tier into the device cache."),
    ("wideep_kv_load_seconds_total", "kv_load_seconds_total", "counter",
     "Step-thread seconds spent loading blocks from the host tier (enqueueing the copies, on CUDA)."),
    ("wideep_kv_disk_reads_total", "kv_disk_reads_total", "counter", "Block files read from the disk tier."),
    ("wideep_kv_disk_read_seconds_total", "kv_disk_read_seconds_total", "counter",
     "Reader-thread seconds spent reading and checking block files."),
    ("wideep_kv_disk_write_seconds_total", "kv_disk_write_seconds_total", "counter",
     "Writer-thread seconds spent writing block files."),
    ("wideep_kv_disk_misses_total", "kv_disk_misses_total", "counter",
     "Block files that were missing, truncated, corrupt or another model's (recomputed instead)."),
]
# (name, figure of metrics()["kv_tiers"][tier], type, help): one sample per tier
_TIER_FAMILIES = [
    ("wideep_kv_tier_blocks", "blocks", "gauge", "KV blocks held per tier (device: cached blocks), all ranks."),
    ("wideep_kv_tier_bytes", "bytes", "gauge", "KV bytes held per tier, all ranks."),
    ("wideep_kv_tier_hit_blocks_total", "hit_blocks", "counter",
     "Prompt-prefix blocks found per tier at admission, all ranks."),
    ("wideep_kv_spill_bytes_total", "spill_bytes", "counter",
     "Bytes spilled into a tier (host: from the device cache; disk: from the host tier)."),
    ("wideep_kv_load_bytes_total", "load_bytes", "counter",
     "Bytes loaded out of a tier (host: into the device cache; disk: into the host tier)."),
]
_PER_RANK = [   # (name, key in a rank's stats, type, help); absent keys are skipped
    ("wideep_rank_requests_running", "running", "gauge", "Running requests on one DP rank."),
    ("wideep_rank_kv_cache_blocks_used", "kv_blocks_used", "gauge", "KV blocks in use on one DP rank."),
    ("wideep_rank_moe_remote_bytes_total", "dispatch_bytes_remote", "counter",
     "MoE dispatch + combine bytes one rank sent to other ranks."),
    ("wideep_rank_moe_intra_node_bytes_total", "dispatch_bytes_intra", "counter",
     "MoE dispatch + combine bytes one rank sent to other ranks of its node."),
    ("wideep_rank_moe_inter_node_bytes_total", "dispatch_bytes_inter", "counter",
     "MoE dispatch + combine bytes one rank sent to ranks of other nodes."),
    ("wideep_rank_moe_nodes_per_token_max_step", "moe_nodes_per_token_max_step", "gauge",
     "Most nodes one token's experts were on, in the rank's last step (<= topk_group with "
     "group-limited routing and expert groups on nodes)."),
    ("wideep_rank_dbo_split_steps_total", "dbo_split_steps", "counter", "Steps run as two DBO microbatches."),
    ("wideep_rank_eplb_rebalances_total", "eplb_rebalances", "counter", "EPLB rebalances completed."),
    ("wideep_rank_eplb_balancedness", "eplb_balancedness", "gauge",
     "Mean per-layer load balancedness (mean/max per rank) the last EPLB plan reached on its window."),
]
# the CPU decode plan's counters (engine/model/fused_decode.py): (name, stats key prefix, label, help)
_DECODE_PLAN = [
    ("wideep_rank_decode_steps_total", "decode_steps_", "path", "counter",
     "Plain steps by the path they ran (stack|layers|mlp_halves: fused C calls; ops: the operations)."),
    ("wideep_rank_decode_declined_total", "decode_declined_", "reason", "counter",
     "Plain steps whose decoder layers did not run fused, by reason."),
    ("wideep_rank_decode_stack_declined_total", "decode_stack_declined_", "reason", "counter",
     "Fused steps that ran layer by layer instead of as one stack call, by reason."),
    ("wideep_rank_decode_fused", "decode_fused_", "bucket", "gauge",
     "Per (path, rows) bucket: 1 when the fused calls measured faster on this rank, 0 when the operations did."),
    ("wideep_cpu_kernel_limit", "cpu_kernel_limit_", "kernel", "gauge",
     "Where each C kernel runs instead of torch, as measured on this rank's CPU (cpu/tune.py): the most rows "
     "(linear_*), mean rows per expert (experts_*), 1/0 (mla_decode); 0: torch's operation."),
]
_HISTOGRAMS = [
    ("wideep_time_to_first_token_seconds", "ttft_s", "Arrival to first token, finished requests."),
    ("wideep_time_per_output_token_seconds", "tpot_s", "Mean time between output tokens after the first."),
    ("wideep_request_queue_time_seconds", "queue_s", "Arrival to first scheduled."),
    ("wideep_e2e_request_latency_seconds", "e2e_s", "Submit to final output, as the server saw it."),
]


def _num(v) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def render(m: dict) -> str:
    lines: list[str] = []
    ranks = [_with_step_max(st) for st in m.get("per_rank", [])]

    def head(name: str, kind: str, help_: str) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])

    for name, key, kind, help_ in _SCALARS:
        if key in m:
            head(name, kind, help_)
            lines.append(f"{name} {_num(m[key])}")
    for name, key, kind, help_ in _PER_RANK:
        samples = [(r, st[key]) for r, st in enumerate(ranks) if st.get(key) is not None]
        if samples:
            head(name, kind, help_)
            lines.extend(f'{name}{{dp_rank="{r}"}} {_num(v)}' for r, v in samples)
    name = "wideep_rank_moe_nodes_per_token"
    hists = [(r, st["moe_nodes_per_token"]) for r, st in enumerate(ranks) if st.get("moe_nodes_per_token")]
    if hists:
        head(name, "histogram", "Nodes holding a token's experts, per (token, MoE layer) dispatch, since start.")
        for r, counts in hists:
            cum = 0
            for j, n in enumerate(counts):
                cum += n
                lines.append(f'{name}_bucket{{dp_rank="{r}",le="{j}"}} {cum}')
            lines.append(f'{name}_bucket{{dp_rank="{r}",le="+Inf"}} {cum}')
            lines.append(f'{name}_sum{{dp_rank="{r}"}} {sum(j * n for j, n in enumerate(counts))}')
            lines.append(f'{name}_count{{dp_rank="{r}"}} {cum}')
    for name, prefix, label, kind, help_ in _DECODE_PLAN:
        samples = [(r, key[len(prefix):], v) for r, st in enumerate(ranks) for key, v in st.items()
                   if key.startswith(prefix)]
        if samples:
            head(name, kind, help_)
            lines.extend(f'{name}{{dp_rank="{r}",{label}="{k}"}} {_num(v)}' for r, k, v in samples)
    per_pos = m.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos:
        name = "wideep_spec_decode_num_accepted_tokens_per_pos_total"
        head(name, "counter", "Draft tokens accepted, by draft position (0: the first draft).")
        lines.extend(f'{name}{{position="{i}"}} {n}' for i, n in enumerate(per_pos))
    tiers = m.get("kv_tiers", {})
    for name, key, kind, help_ in _TIER_FAMILIES:
        samples = [(t, f[key]) for t, f in tiers.items() if key in f]
        if samples:
            head(name, kind, help_)
            lines.extend(f'{name}{{tier="{t}"}} {_num(v)}' for t, v in samples)
    if m.get("routing_decisions"):
        head("wideep_routing_decisions_total", "counter",
             "Requests routed to a DP rank, by reason (least_loaded|prefix|load|no_prefix).")
        lines.extend(f'wideep_routing_decisions_total{{reason="{r}"}} {n}'
                     for r, n in sorted(m["routing_decisions"].items()))
    if m.get("lost_ranks"):
        head("wideep_lost_rank", "gauge", "1 per rank lost (its rank at start-up), re-formed out or not yet.")
        lines.extend(f'wideep_lost_rank{{rank="{r}"}} 1' for r in m["lost_ranks"])
    if m.get("unreachable"):
        head("wideep_unreachable_rank_silent_seconds", "gauge",
             "Seconds a ring neighbour of rank 0 has been silent, while silent past 3 heartbeats and not yet lost.")
        lines.extend(f'wideep_unreachable_rank_silent_seconds{{rank="{u["rank"]}"}} {_num(float(u["silent_s"]))}'
                     for u in m["unreachable"])
    head("wideep_requests_finished_total", "counter", "Finished requests by finish reason (length|stop|abort).")
    for reason, n in sorted(m.get("requests_finished", {}).items()):
        lines.append(f'wideep_requests_finished_total{{finish_reason="{reason}"}} {n}')
    for name, key, help_ in _HISTOGRAMS:
        h = m.get(key)
        if h is None:
            continue
        head(name, "histogram", help_)
        lines.extend(f'{name}_bucket{{le="{_num(le)}"}} {n}' for le, n in h["buckets"])
        lines.extend([f"{name}_sum {_num(float(h['sum']))}", f"{name}_count {h['count']}"])
    return "\n".join(lines) + "\n"


def _with_step_max(st: dict) -> dict:
    """A rank's stats plus moe_nodes_per_token_max_step, from its last step's histogram."""
    step = st.get("moe_nodes_per_token_step")
    if not step:
        return st
    return dict(st, moe_nodes_per_token_max_step=max((j for j, n in enumerate(step) if n), default=0))


def parse(text: str) -> dict[str, float]:
    """The inverse for tests and scripts: {'name{labels}': value} of every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
