"""A real Prometheus (Debian's `prometheus`; .ci/run installs it) scrapes the three
services with the repository's own scrape config while load runs, then every query of
every panel of the Grafana dashboard is executed against it and must return data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from ops_load import drive

from luftpause.dev.procs import eventually, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "monitoring" / "grafana" / "dashboards" / "luftpause.json"
SCRAPE_CONFIG = ROOT / "config" / "monitoring" / "prometheus.yml"
# What Grafana substitutes for $__rate_interval at this scrape interval (at least 4 scrapes).
RATE_INTERVAL = "20s"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: .ci/run installs Debian's prometheus package")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return found


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    return queries


def scrape_config(stack, scrape_interval: str) -> dict:
    """The repository's scrape config with the compose host names replaced by the
    stack's loopback ports."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    ports = {"scheduler:5001": stack.ports.scheduler_http, "dataplane:8080": stack.ports.dataplane,
             "runtime:7000": stack.ports.runtime}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [f"127.0.0.1:{ports[t]}" for t in static["targets"]]
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = scrape_interval
    return config


def test_dashboard_is_grafana_json_over_luftpause_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "luftpause" and dashboard["panels"]
    queries = panel_queries()
    assert len(queries) >= 20
    assert all("luftpause_" in expr for _, expr in queries if not expr.startswith("up{"))


async def test_every_dashboard_query_returns_data_from_a_real_prometheus(ops_stack, tmp_path):
    binary = prometheus_binary()
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(scrape_config(ops_stack, "1s")))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5, trust_env=False) as client:
            async def ready() -> bool:
                assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    return (await client.get("/-/ready")).status_code == 200
                except httpx.HTTPError:
                    return False

            async def values(query: str) -> list[dict]:
                answer = (await client.get("/api/v1/query", params={"query": query})).json()
                assert answer["status"] == "success", (query, answer)
                return answer["data"]["result"]

            async def scraped_three_times() -> bool:
                counts = await values("count_over_time(up[1m])")
                return len(counts) == 3 and all(float(c["value"][1]) >= 3 for c in counts)

            await eventually(ready, what="prometheus ready")
            # a few scrapes before the load, so rates have a baseline
            await eventually(scraped_three_times, what="three scrapes of each service")
            codes = await drive(ops_stack)
            assert codes.count(200) >= 40

            targets = (await client.get("/api/v1/targets")).json()["data"]["activeTargets"]
            assert sorted(t["labels"]["job"] for t in targets) == [
                "luftpause-dataplane", "luftpause-runtime", "luftpause-scheduler"]
            assert all(t["health"] == "up" for t in targets), targets

            empty: list[tuple[str, str]] = []

            async def every_panel_has_data() -> bool:
                empty.clear()
                for title, expr in panel_queries():
                    query = expr.replace("$__rate_interval", RATE_INTERVAL)
                    if not await values(query):
                        empty.append((title, query))
                return not empty

            # the load's last samples reach the rates at the scrapes after it
            try:
                await eventually(every_panel_has_data, what="data in every panel")
            except AssertionError as timeout:
                raise AssertionError(f"panels without data: {empty}") from timeout
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
