"""The constant ext_proc servers the picker's benchmarks measure as floors: each is a real
ext_proc server Envoy routes by, the Go one is optional and says why when it cannot run,
and its trimmed proto is the one Envoy's descriptors give."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from luftpause.loadgen import extproc_floors as floors
from luftpause.loadgen import peers
from luftpause.loadgen import proxy_bench as pb


@pytest.mark.parametrize("impl", floors.IMPLS)
def test_a_floor_behind_envoy_sends_every_request_to_its_one_destination(tmp_path, impl):
    if impl == "go" and floors.go_missing():
        pytest.skip(f"the Go floor needs {', '.join(floors.go_missing())}")
    chosen, chosen_url = pb.start_engine("engine-chosen", pb.INSTANT, tmp_path)
    other, other_url = pb.start_engine("engine-other", pb.INSTANT, tmp_path)
    try:
        running = floors.start_behind_envoy(impl, chosen_url, pb.MODEL, tmp_path, also_pooled=(other_url,))
        try:
            before = [s["requests"] for s in peers.engine_stats([chosen_url, other_url])]
            for stream in (False, True):
                for i in range(5):
                    reply = httpx.post(f"{running.url}/v1/chat/completions", json=pb.body(i, stream), timeout=10)
                    assert reply.status_code == 200, reply.text
                    assert "chat.completion" in reply.text
            after = [s["requests"] for s in peers.engine_stats([chosen_url, other_url])]
        finally:
            running.stop()
    finally:
        chosen.stop()
        other.stop()
    # Envoy's own choice (least request over both) would have sent some to the other engine.
    assert [a - b for a, b in zip(after, before, strict=True)] == [10, 0]


def test_without_go_the_picker_mode_skips_the_go_floor_and_says_what_to_install(tmp_path):
    out = tmp_path / "picker.json"
    result = subprocess.run([sys.executable, "-m", "luftpause.loadgen.proxy_bench", "picker", "--floor-only",
                             "--floor-impl", "go", "--json", str(out)],
                            env={"PATH": str(tmp_path), "HOME": str(tmp_path)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Go floor skipped" in result.stdout and "golang-go" in " ".join(result.stdout.split())
    written = json.loads(out.read_text())
    assert written["rows"] == {} and "golang-go" in written["skipped"]["go"]


def test_the_go_floors_proto_is_envoys_ext_proc_as_the_descriptors_give_it():
    generated = subprocess.run([sys.executable, str(floors.SOURCE / "trim_proto.py")], capture_output=True,
                               text=True, check=True, timeout=120).stdout
    assert generated == (floors.SOURCE / "external_processor.proto").read_text()
    assert "service ExternalProcessor" in generated and "package envoy.service.ext_proc.v3;" in generated
