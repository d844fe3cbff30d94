"""The example agents run against the real proxy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_openai_example_agent_runs_to_an_answer_with_tool_calls(proxy_stack):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_agent.py"), "what is luftpause?",
         "--base-url", f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "tool calls)" in result.stdout and "(0 tool calls)" not in result.stdout
