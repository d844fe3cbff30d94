"""A journal line: one record as compact UTF-8 JSON and a newline.

The journal writes its lines and replay and compaction read them back with these two;
this module imports nothing of weight, because the start's compaction runs in a child
forked before the runtime's imports."""

from __future__ import annotations

import json
from typing import Any


def encoded(record: dict[str, Any]) -> bytes:
    """A record as its journal line."""
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def decoded(line: bytes) -> dict[str, Any] | None:
    """The record a journal line holds, or None when the line is torn or corrupt."""
    try:
        # (json.loads of bytes would first guess their encoding; the journal is UTF-8.)
        record = json.loads(line.decode("utf-8", "surrogatepass"))
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("handle"), str) else None
