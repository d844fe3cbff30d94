"""Installing pinned npm packages for tests (third-party MCP servers and clients).

Installs go into one cache directory shared by test runs; a file lock keeps two test
runs in the same tree from installing into it at once.

The harness CLIs' tests run pinned versions; ``LUFTPAUSE_NPM_LATEST=1`` runs them with the
newest version of each CLI in the registry instead (``versions_under_test``), to find out
whether a newer CLI still works before moving a pin. CI never sets it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

NPM_INSTALL_TIMEOUT_S = 240
NPM_VIEW_TIMEOUT_S = 60
LATEST_ENV = "LUFTPAUSE_NPM_LATEST"


class NpmUnavailable(RuntimeError):
    """node or npm is missing, or the install failed."""


def installed_version(directory: Path, package: str) -> str | None:
    manifest = directory / "node_modules" / package / "package.json"
    try:
        return json.loads(manifest.read_text()).get("version")
    except (OSError, ValueError):
        return None


def install_npm_packages(directory: Path, packages: Mapping[str, str]) -> None:
    """Make ``directory/node_modules`` hold exactly these versions (no-op when it does)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise NpmUnavailable(f"{tool} is not on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(installed_version(directory, name) == version for name, version in packages.items()):
            return
        # Exact versions in package.json, so a plain `npm install` installs just these.
        (directory / "package.json").write_text(json.dumps({"private": True, "dependencies": dict(packages)}))
        command = ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(directory)]
        try:
            subprocess.run(
                command, cwd=directory, capture_output=True, text=True, timeout=NPM_INSTALL_TIMEOUT_S, check=True
            )
        except subprocess.TimeoutExpired as exc:
            raise NpmUnavailable(f"npm install took longer than {NPM_INSTALL_TIMEOUT_S} s") from exc
        except subprocess.CalledProcessError as exc:
            raise NpmUnavailable(f"npm install failed: {exc.stderr[-2000:]}") from exc


def versions_under_test(packages: Mapping[str, str]) -> dict[str, str]:
    """``packages`` as pinned; with ``LUFTPAUSE_NPM_LATEST=1``, each but ``node`` (the
    runtime the CLIs run on) at the newest version the registry has (``npm view``)."""
    if os.environ.get(LATEST_ENV) != "1":
        return dict(packages)
    newest = {}
    for name, pinned in packages.items():
        if name == "node":
            newest[name] = pinned
            continue
        try:
            viewed = subprocess.run(["npm", "view", name, "version"], capture_output=True, text=True,
                                    timeout=NPM_VIEW_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NpmUnavailable(f"npm view {name} version failed: {exc}") from exc
        newest[name] = viewed.stdout.strip()
    return newest
