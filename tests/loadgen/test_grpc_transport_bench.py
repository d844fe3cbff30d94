"""The gRPC transport bench runs both transports in real process pairs and reports each."""

from __future__ import annotations

import json

from luftpause import grpc_env
from luftpause.loadgen import grpc_transport_bench as bench


def test_a_tiny_run_measures_both_transports_in_separate_processes(tmp_path):
    out = tmp_path / "grpc.json"
    assert bench.main(["--rounds", "1", "--messages", "50", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["transports"]) == set(bench.TRANSPORTS)
    assert results["transports"]["luftpause's choice"]["GRPC_EXPERIMENTS"] == grpc_env.LEGACY_TRANSPORT
    for entry in results["transports"].values():
        (one,) = entry["rounds"]
        assert one["client_cpu_us"] > 0 and one["server_cpu_us"] > 0 and one["wall_us"] > 0
        assert entry["median_wall_us"] == round(one["wall_us"], 1)
