"""requirements.lock (what the images install) agrees with pyproject.toml: the same
direct dependencies, each pinned to a version its specifier allows."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def pins() -> dict[str, str]:
    found = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            found[canonicalize_name(match[1])] = match[2]
    return found


def direct_in_lock() -> set[str]:
    """Packages the lock says it holds because pyproject.toml asks for them."""
    direct, current = set(), None
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==", line)
        if match:
            current = canonicalize_name(match[1])
        elif current and "luftpause (pyproject.toml)" in line:
            direct.add(current)
    return direct


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["dependencies"]]


def test_lock_pins_every_dependency_within_its_specifier():
    locked = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if requirement.marker is not None and not requirement.marker.evaluate(
                {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.12"}):
            continue
        assert name in locked, f"{name} is in pyproject.toml but not in requirements.lock: run make lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"requirements.lock pins {name}=={locked[name]}, outside {requirement.specifier}: run make lock")


def test_lock_has_no_direct_dependency_pyproject_dropped():
    wanted = {canonicalize_name(r.name) for r in requirements()}
    assert direct_in_lock() == wanted, "requirements.lock is stale: run make lock"


def test_images_install_the_lock_before_the_source():
    for name in ("scheduler", "dataplane", "runtime", "fakes"):
        text = (ROOT / "docker" / f"Dockerfile.{name}").read_text()
        lock_install = text.index("pip install --no-cache-dir -r /tmp/requirements.lock")
        assert text.index("COPY requirements.lock") < lock_install < text.index("COPY . /src")
        assert "--no-deps /src" in text  # the project itself adds no unlocked dependency
