"""One stack for the operability tests: fake engines that queue (so turns are held),
JSON logs at debug level, every process real and on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ops_load import ENGINE_ARGS

from luftpause.dev.stack import Stack


@pytest.fixture(scope="session")
def ops_stack(tmp_path_factory) -> Iterator[Stack]:
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("ops"), engine_args=ENGINE_ARGS,
                                env={"LUFTPAUSE_LOG_FORMAT": "json", "LUFTPAUSE_LOG_LEVEL": "debug",
                                     "LUFTPAUSE_PROBE_PERIOD_S": "0.25"})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
