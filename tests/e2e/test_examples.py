"""The example agents run against the real proxy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_openai_example_agent_runs_to_an_answer_with_tool_calls(proxy_stack):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_agent.py"), "what is luftpause?",
         "--base-url", f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "tool calls)" in result.stdout and "(0 tool calls)" not in result.stdout


@pytest.mark.parametrize("script", ["agents_sdk_agent.py", "langgraph_agent.py"])
def test_framework_example_agents_run_through_the_proxy(proxy_stack, script):
    engines = [f"http://127.0.0.1:{port}/stats" for port in proxy_stack.ports.engines]
    before = sum(httpx.get(url).json()["requests"] for url in engines)
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "what is luftpause?",
         "--base-url", f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1"],
        capture_output=True, text=True, timeout=90,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "placeholder" in result.stdout  # the fake engine's final answer
    # tool-call turns, then the answer: at least three turns went through the proxy
    assert sum(httpx.get(url).json()["requests"] for url in engines) - before >= 3
