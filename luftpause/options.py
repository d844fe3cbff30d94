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
    ``text`` followed by ``(env NAME, default VALUE)``."""
    environ = os.environ if environ is None else environ
    parser.add_argument(flag, type=kind, default=kind(environ.get(env_name, default)),
                        help=f"{text} (env {env_name}, default %(default)s)", **extra)
