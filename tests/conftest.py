"""Shared fixtures: the stack as real processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from luftpause.stack import Stack


def start_stack(directory: Path, **options) -> Stack:
    stack = Stack.on_free_ports(directory, **options)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def proxy_stack(tmp_path_factory) -> Iterator[Stack]:
    """Fake engines, scheduler and dataplane (no runtime, no fake MCP)."""
    stack = start_stack(tmp_path_factory.mktemp("proxy"), without=frozenset({"runtime", "fake-mcp"}))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def full_stack(tmp_path_factory) -> Iterator[Stack]:
    """Everything `make run` starts, on free ports."""
    stack = start_stack(tmp_path_factory.mktemp("full"), fake_mcp_args=["--delay-s", "0.2"])
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def make_stack(tmp_path) -> Iterator:
    """Start a stack with custom options; every stack started is stopped afterwards."""
    started: list[Stack] = []

    def make(**options) -> Stack:
        stack = start_stack(tmp_path / f"stack{len(started)}", **options)
        started.append(stack)
        return stack

    try:
        yield make
    finally:
        for stack in started:
            stack.stop()
