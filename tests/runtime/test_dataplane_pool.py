"""The runtime's client to the dataplane runs on httpcore's connection pool with its request
assignment replaced (runtime/dataplane.py, _LinearPool): pinned here, so that an httpcore
that renames or drops the method it replaces fails a test instead of silently running the
slow one again."""

from __future__ import annotations

import httpcore

from luftpause.runtime.dataplane import _LinearPool, _transport


def test_the_pool_replaces_a_method_httpcore_still_has_and_the_client_uses_it():
    assert "_assign_requests_to_connections" in vars(httpcore.AsyncConnectionPool)
    assert "_assign_requests_to_connections" in vars(_LinearPool)
    assert type(_transport()._pool) is _LinearPool
