"""Engine-wide KV figures from the ranks' stats (EngineCore.stats, TieredStore.stats): per tier the
blocks and bytes held and the prefix blocks hit; spill and load bytes per tier and the seconds they
took. Read by the front's metrics() and rendered by launch/server/prometheus.py."""
from __future__ import annotations

# tier -> {figure: the rank-stats key summed for it}
_TIERS = {
    "device": {"blocks": "kv_device_cached_blocks", "bytes": "kv_device_cached_bytes",
               "hit_blocks": "kv_hit_blocks_device"},
    "host": {"blocks": "kv_host_blocks", "bytes": "kv_host_bytes", "hit_blocks": "kv_hit_blocks_host",
             "spill_bytes": "kv_spill_bytes_host", "load_bytes": "kv_load_bytes_host"},
    "disk": {"blocks": "kv_disk_blocks", "bytes": "kv_disk_bytes", "hit_blocks": "kv_hit_blocks_disk",
             "spill_bytes": "kv_spill_bytes_disk", "load_bytes": "kv_load_bytes_disk"},
}
_TOTALS = {"prefill_tokens_total": "prefill_tokens", "kv_spills_total": "kv_spills", "kv_loads_total": "kv_loads",
           "kv_spill_seconds_total": "kv_spill_s", "kv_load_seconds_total": "kv_load_s",
           "kv_disk_reads_total": "kv_disk_reads", "kv_disk_read_seconds_total": "kv_disk_read_s",
           "kv_disk_write_seconds_total": "kv_disk_write_s", "kv_disk_misses_total": "kv_disk_misses"}


def tier_totals(per_rank: list[dict]) -> dict:
    """-> {"kv_tiers": {tier: {figure: total}}, <totals>}; a tier no rank has is left out."""
    def total(key: str):
        return sum(s.get(key, 0) for s in per_rank)
    tiers = {tier: {name: total(key) for name, key in figures.items()}
             for tier, figures in _TIERS.items()
             if tier == "device" or any(figures["blocks"] in s for s in per_rank)}
    return {"kv_tiers": tiers, **{name: total(key) for name, key in _TOTALS.items()}}
