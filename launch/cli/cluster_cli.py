"""`wideep cluster up|down|list|link`: the local cluster of namespace hosts (launch/cluster/) from a shell.

    wideep cluster up --nodes 2 --rate 5gbit      # prints the prefix, each host's address and how to run in it
    wideep cluster down [--prefix P]              # P, or every cluster whose owner process is gone
    wideep cluster link --prefix P --node 1 down  # a partition: host 1's cable pulled (`up` puts it back)
"""
from __future__ import annotations

import json


def cmd_up(a) -> None:
    from ..cluster import Cluster, ClusterSpec
    c = Cluster.up(ClusterSpec(nodes=a.nodes, rate=None if a.rate == "none" else a.rate, prefix=a.prefix or ""),
                   owner_pid=None)
    if a.json:
        print(json.dumps({"prefix": c.prefix, "rate": c.rate, "root_addr": c.root_addr,
                          "hosts": [{"netns": h.netns, "addr": h.addr, "dev": h.dev} for h in c.hosts]}))
        return
    print(f"cluster {c.prefix}: {len(c.hosts)} host(s), links {c.rate or 'unshaped'}; this machine is "
          f"{c.root_addr} on the bridge")
    for h in c.hosts:
        print(f"  host {h.index}: {h.addr} on {h.dev}   run in it: ip netns exec {h.netns} <command> "
              f"(GLOO_SOCKET_IFNAME={h.dev})")
    print(f"remove it: wideep cluster down --prefix {c.prefix}")


def cmd_down(a) -> None:
    from ..cluster import Cluster, down_stale
    if a.prefix:
        Cluster.load(a.prefix).down()
        print(f"removed cluster {a.prefix}")
        return
    gone = down_stale()
    print(f"removed {len(gone)} cluster(s){': ' + ', '.join(gone) if gone else ''} "
          f"(clusters whose owner process still runs are left alone; name one with --prefix)")


def cmd_link(a) -> None:
    from ..cluster import Cluster
    c = Cluster.load(a.prefix)
    c.set_link(a.node, a.state == "up")
    print(f"cluster {a.prefix}: host {a.node}'s link is {a.state}")


def cmd_list(a) -> None:
    from ..cluster import state
    for s in state.all_states():
        owner = "wideep cluster up" if not s["owner_pid"] else (
            f"pid {s['owner_pid']} ({'running' if state.owner_alive(s) else 'gone'})")
        print(f"{s['prefix']}: {len(s['hosts'])} host(s) at 198.18.{s['subnet']}.0/24, links "
              f"{s['rate'] or 'unshaped'}, made by {owner}")


def add_parsers(sub) -> None:
    c = sub.add_parser("cluster", help="a local cluster: network-namespace hosts on one bridge, links shaped with "
                                       "tbf (root only; docs/wide-ep.md)")
    cs = c.add_subparsers(dest="cluster_cmd", required=True)
    up = cs.add_parser("up", help="make N namespace hosts; kept until `wideep cluster down`")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--rate", default="5gbit", help="each host link's rate, tc's spelling (5gbit, 800mbit), or none")
    up.add_argument("--prefix", help="names of its namespaces and link (2-8 of [a-z0-9]; default drawn)")
    up.add_argument("--json", action="store_true", help="one JSON line")
    up.set_defaults(fn=cmd_up)
    down = cs.add_parser("down", help="remove a cluster (--prefix), or every one whose owner process is gone")
    down.add_argument("--prefix")
    down.set_defaults(fn=cmd_down)
    link = cs.add_parser("link", help="set a host's link down (a partition: its ranks fall silent) or up again")
    link.add_argument("--prefix", required=True)
    link.add_argument("--node", type=int, required=True)
    link.add_argument("state", choices=("down", "up"))
    link.set_defaults(fn=cmd_link)
    ls = cs.add_parser("list", help="the recorded clusters")
    ls.set_defaults(fn=cmd_list)
