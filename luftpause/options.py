"""Command-line options of the services: each flag defaults to an environment variable,
else to a built-in value, and its ``--help`` names both."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any


def env_option(parser: argparse.ArgumentParser, flag: str, env_name: str, default: Any, text: str, *,
               kind: Callable[[Any], Any] = str, environ: Mapping[str, str] | None = None, **extra: Any) -> None:
    """``flag`` of type ``kind``, defaulting to ``$env_name`` (else ``default``); its help is
    ``text`` followed by ``(env NAME, default VALUE)``.

    argparse checks a flag's type and choices, not a default: a value from the environment
    that ``kind`` refuses or that is not one of ``choices`` ends the program with a usage
    error naming the variable, as a bad flag would (not a traceback, and not a silent
    fallback to some other behaviour)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(env_name)
    value = default
    if raw is not None:
        try:
            value = kind(raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{env_name}={raw!r}: {exc}")
        choices = extra.get("choices")
        if choices is not None and value not in choices:
            parser.error(f"{env_name}={raw!r}: choose from {', '.join(map(str, choices))}")
    parser.add_argument(flag, type=kind, default=kind(value) if raw is None else value,
                        help=f"{text} (env {env_name}, default %(default)s)", **extra)


def positive_float(raw: Any) -> float:
    """An option's kind for durations and the like: a number above zero."""
    value = float(raw)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {raw!r}")
    return value
