"""Diagnostics: switches that exist to measure what a part of luftpause is worth, never to run
it. Not for production: each turns off something luftpause relies on (docs/diagnostics.md
says what it costs). They are one environment variable, ``LUFTPAUSE_DIAGNOSTICS``
(comma-separated words; unset or empty: none), read here and nowhere else; a service that
reads it refuses to start on a word it does not know, and logs the switches that are on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from luftpause.errors import LuftpauseError

ENV = "LUFTPAUSE_DIAGNOSTICS"
# The scheduler pins no run to its replica (strict affinity off, Policy.affinity): a run's
# turns go wherever there is room, as a router blind to runs would send them. What the
# benchmarks compare strict affinity against (loadgen/bench.py's roaming row).
ROAMING_RUNS = "roaming-runs"
WORDS = {ROAMING_RUNS: "the scheduler pins no run to its replica, to measure what strict affinity is worth"}
HELP = (f"{ENV}: diagnostics, never for production (docs/diagnostics.md); comma-separated words of "
        + "; ".join(f"{word} ({text})" for word, text in WORDS.items()))


class UnknownDiagnostic(LuftpauseError, ValueError):
    """``LUFTPAUSE_DIAGNOSTICS`` names a switch there is not."""


def read(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The diagnostics switches that are on (none, normally)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV, "")
    words = frozenset(word.strip() for word in raw.split(",") if word.strip())
    unknown = sorted(words - WORDS.keys())
    if unknown:
        raise UnknownDiagnostic(f"{ENV}={raw!r}: no such switch {', '.join(unknown)} "
                                f"(choose from {', '.join(WORDS)})")
    return words
