"""bench/multinode.py without a cluster: its --rates parsing and errors, and the wire/computed accounting
read from a `wideep run` summary (the fields launch/cli/main.py prints). No rank or namespace starts here."""
from __future__ import annotations

import pytest

from bench import multinode


def test_rates_sorted_slowest_first():
    assert multinode.parse_rates("25gbit, 1gbit,5gbit") == ["1gbit", "5gbit", "25gbit"]
    assert multinode.parse_rates("500mbit,1gbit") == ["500mbit", "1gbit"]


@pytest.mark.parametrize("bad, says", [("fast", "link rate must be"), ("", "at least one"),
                                       ("1gbit,1000mbit", "twice"), ("0gbit", "link rate must be")])
def test_bad_rates_exit_with_the_reason(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        multinode.main(["--rates", bad])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_wire_over_computed_from_a_run_summary():
    summary = {"elapsed_s": 2.0, "generated_tokens": 8,
               "dispatch_per_rank": [{"dispatch_bytes_inter": 1000, "combine_bytes_inter": 1000,
                                      "meta_bytes_inter": 100}, {}, {"dispatch_bytes_inter": 500,
                                                                     "combine_bytes_inter": 400}, {}],
               "wire": {"sent_per_node": [2000, 1600], "sent_payload_per_node": [1800, 1400]}}
    f = multinode.figures(summary, "prefill", (2, 10, 1))
    assert f["computed_payload"] == 2900 and f["computed_meta"] == 100
    assert f["tok_s"] == (10 + 14) / 2.0     # prompt tokens: 10 and 10 + 4
    assert multinode.ratio([f], "wire_bytes") == 1.2
    assert multinode.ratio([f], "wire_tcp_payload") == round(3200 / 3000, 4)
    assert multinode.figures(summary, "decode", (2, 10, 4))["tok_s"] == 4.0
