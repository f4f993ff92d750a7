"""Two namespace hosts x 2 ranks launched as users launch them (torchrun --nnodes 2, c10d rendezvous
on host 0's address, gloo on each host's own wire): DP attention + EP with the two-level dispatch
prints the greedy tokens of one process, and the bytes on the inter-host wires during the generation
match the dispatcher's inter-node payload and metadata.

Skips with one line where network namespaces cannot be made (not root, no iproute2, a container
without the capability)."""
from __future__ import annotations

import json

import pytest

from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.clusters import cluster_up, run_one_process, run_torchrun
from tests.launch.runs import outputs

pytestmark = pytest.mark.multirank

CONFIG = """
[model]
path = "{path}"

[parallel]
dispatch_backend = "hierarchical"
timeout_s = 30

[engine]
block_size = 16

[run]
prompt_ids = {prompts}
max_tokens = 3
"""
# Long prompts, few new tokens: the prefill's all-to-alls carry most of the bytes, so the transport's
# own bytes per message (headers, ACKs) and the per-step control messages are a small part of the wire.
PROMPTS = [[(7 * i + 13 * j) % 250 + 2 for j in range(96 + 8 * i)] for i in range(8)]
# The comparison, in two parts (docs/wide-ep.md has the measured breakdown):
# - TCP payload on the wires (bytes less one 66-byte Ethernet/IP/TCP header per frame) over the
#   dispatcher's inter-node payload + metadata: measured 1.08-1.11. The rest is traffic the dispatcher
#   does not own: host 1's ZeroMQ reports to the front and its requests (~25 KB here), LLM.generate's
#   broadcast of the results (~7 KB), gloo's 48-byte header per message (~360 messages), the step
#   sync's all-reduces, the ring heartbeats and the window's two barriers.
# - all bytes on the wires (headers and ACK frames too) over the same: measured 1.18-1.25.
# Each bound is about twice the measured excess: the ACK count and the idle steps a rank reports
# vary with how the 2 shared cores schedule the 4 ranks.
TCP_TOLERANCE = 0.20
WIRE_TOLERANCE = 0.45


@pytest.fixture
def cluster():
    with cluster_up() as c:
        yield c


def test_two_hosts_torchrun_equal_one_process_and_wire_bytes(tmp_path, cluster):
    d = make_tiny_checkpoint(str(tmp_path / "m"), arch="v3", seed=4)
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(path=d, prompts=json.dumps(PROMPTS)))
    single = run_one_process(cfg)
    text = run_torchrun(cluster, cfg, tmp_path)
    assert outputs(text[0]) == outputs(single.stdout) and len(outputs(text[0])) == len(PROMPTS)

    summary = json.loads([line for line in text[0].splitlines() if line.startswith('{"ranks"')][0])
    assert summary["ranks"] == 4 and summary["wire"]["dev"] == "eth0"
    per_rank = summary["dispatch_per_rank"]
    computed = sum(s["dispatch_bytes_inter"] + s["combine_bytes_inter"] + s["meta_bytes_inter"] for s in per_rank)
    payload = sum(s["dispatch_bytes_inter"] + s["combine_bytes_inter"] for s in per_rank)
    # every byte between the hosts is sent by one and received by the other: count it once, as sent
    wire = sum(summary["wire"]["sent_per_node"])
    assert summary["wire"]["sent_per_node"][0] <= summary["wire"]["received_per_node"][1] * 1.01
    ratio = wire / computed
    tcp = sum(summary["wire"]["sent_payload_per_node"])
    print(f"wire {wire} B in {sum(summary['wire']['sent_frames_per_node'])} frames, TCP payload {tcp} B; "
          f"dispatcher inter-node payload {payload} B + metadata {computed - payload} B: ratio {ratio:.3f}, "
          f"TCP payload ratio {tcp / computed:.3f}")
    assert payload > 100_000, f"the workload moved only {payload} B between nodes: too little to compare"
    assert 1.0 <= tcp / computed <= 1.0 + TCP_TOLERANCE, (tcp, computed, summary["wire"])
    assert ratio <= 1.0 + WIRE_TOLERANCE, (wire, computed, summary["wire"])
