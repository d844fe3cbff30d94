"""The release target and the MCP registry entry (checked without Docker or a registry)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGES = ("scheduler", "dataplane", "runtime", "fakes", "wikipedia-mcp")


def test_dry_run_release_prints_builds_pushes_and_the_git_tag():
    result = subprocess.run(["make", "-s", "release", "DRY_RUN=1", "LUFTPAUSE_REGISTRY=registry.example/team"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for image in IMAGES:
        tag = f"registry.example/team/luftpause-{image}"
        assert (f"docker build -f docker/Dockerfile.{image} -t {tag}:v{VERSION} -t {tag}:latest .") in lines
        assert f"docker push {tag}:v{VERSION}" in lines and f"docker push {tag}:latest" in lines
        assert (ROOT / "docker" / f"Dockerfile.{image}").exists()
    assert lines[-1] == f"git tag v{VERSION}"


def test_server_json_matches_the_release():
    server = json.loads((ROOT / "server.json").read_text())
    assert server["name"] == "io.github.vmedvedovskiy/luftpause"
    assert server["version"] == VERSION
    assert len(server["description"]) <= 100
    [package] = server["packages"]
    assert package["registryType"] == "oci"
    assert package["identifier"].endswith(f"/luftpause-runtime:v{VERSION}")
    assert package["transport"] == {"type": "streamable-http", "url": "http://localhost:7000/mcp"}
    label = re.search(r'io\.modelcontextprotocol\.server\.name="([^"]+)"',
                      (ROOT / "docker" / "Dockerfile.runtime").read_text())
    assert label and label.group(1) == server["name"]
