"""A local cluster of network-namespace hosts for tests and benchmarks (cluster.py), its byte
counters (wire.py), and `wideep cluster up|down|list` (launch/cli/cluster_cli.py)."""
from . import netns, state
from .cluster import Cluster, ClusterSpec, Host, down_stale
from .netns import ClusterUnavailable, rate_bits
from .wire import LinkBytes, wire_device

__all__ = ["Cluster", "ClusterSpec", "Host", "ClusterUnavailable", "LinkBytes", "down_stale", "rate_bits",
           "wire_device", "netns", "state"]
