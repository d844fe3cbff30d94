"""No service imports another: the scheduler, the dataplane, the runtime and the endpoint
picker talk only over gRPC and HTTP (docs/architecture.md). Every module of each service's
package is parsed (nothing is imported, so a module imported late or only for type checking
counts too) and every import it names is checked: a service may import its own package and
the shared ones (``luftpause.*`` outside the services: ``luftpause.proto``, ``luftpause.link``,
...), never another service's package, nor the development and benchmark tooling. The shared
modules directly in ``luftpause/`` import no service either, so they are no way round it.
The tooling (``luftpause.dev``, ``luftpause.fakes``, ``luftpause.loadgen``) starts and
measures the services and may import them.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"]
SERVICES = ("luftpause.scheduler", "luftpause.dataplane", "luftpause.runtime", "luftpause.picker")
TOOLING = ("luftpause.dev", "luftpause.fakes", "luftpause.loadgen")
# The launcher (``python -m luftpause``, development tooling) is the one module of the
# shared package's folder that is not shared.
NOT_SHARED = ("luftpause.__main__",)


def within(module: str, packages: tuple[str, ...]) -> str | None:
    """The package of ``packages`` that ``module`` is, or is inside of."""
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def modules_of(package: str) -> Iterator[tuple[str, Path, bool]]:
    """(module name, file, is a package's __init__) for every module under ``package``'s folder,
    subpackages included (a shared package's subpackages that are packages of their own,
    ``luftpause.dev``, are not walked)."""
    folder = ROOT / PACKAGE_DIRS[package]
    others = {ROOT / d for p, d in PACKAGE_DIRS.items() if p != package} - {folder}
    for path in sorted(folder.rglob("*.py")):
        if any(parent in others for parent in path.parents):
            continue
        parts = path.relative_to(folder).with_suffix("").parts
        init = parts[-1] == "__init__"
        name = ".".join((package, *(parts[:-1] if init else parts)))
        if within(name, TOOLING) is None:
            yield name, path, init


def imports(module: str, source: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) for every module ``source`` imports, relative imports resolved: each
    ``import x.y``, each ``from x import y`` (as x and as x.y: y may be a module), and each
    ``importlib.import_module("x")`` or ``__import__("x")`` of a literal name."""
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def crossings(owner: str | None, module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports of ``module`` (of the service ``owner``, or shared: None) that cross a
    boundary: into another service, or into the tooling."""
    found: dict[tuple[int, str], str] = {}  # (line, whose): the first name crossing there
    for line, name in imports(module, source, is_package):
        service = within(name, SERVICES)
        if service is not None and service != owner:
            found.setdefault((line, service), f"line {line}: {name} (the {service.rpartition('.')[2]}'s)")
        elif (tooling := within(name, TOOLING)) is not None:
            found.setdefault((line, tooling), f"line {line}: {name} (tooling)")
    return sorted(found.values())


def test_every_service_is_a_package_of_its_own():
    assert set(SERVICES) <= set(PACKAGE_DIRS), f"not mapped in pyproject.toml: {set(SERVICES) - set(PACKAGE_DIRS)}"
    folders = [PACKAGE_DIRS[s] for s in SERVICES]
    assert len(set(folders)) == len(folders)


@pytest.mark.parametrize("service", [s for s in SERVICES if s in PACKAGE_DIRS])
def test_a_service_imports_no_other_service(service):
    crossed = {f"{path.relative_to(ROOT)}: {c}" for module, path, init in modules_of(service)
               for c in crossings(service, module, path.read_text(), init)}
    assert not crossed, f"{service} imports across a service boundary:\n" + "\n".join(sorted(crossed))


def test_the_shared_modules_import_no_service():
    shared = [(module, path, init) for module, path, init in modules_of("luftpause") if module not in NOT_SHARED]
    assert any(module == "luftpause.vocabulary" for module, _, _ in shared)
    crossed = {f"{path.relative_to(ROOT)}: {c}" for module, path, init in shared
               for c in crossings(None, module, path.read_text(), init)}
    assert not crossed, "the shared package imports a service or the tooling:\n" + "\n".join(sorted(crossed))


@pytest.mark.parametrize("source", [
    "from luftpause.dataplane.link import SchedulerLink",
    "import luftpause.dataplane.runs",
    "from luftpause import dataplane",
    "from ..dataplane import link",
    "if TYPE_CHECKING:\n    from luftpause.runtime.service import Runtime",
    "def late():\n    import luftpause.picker.extproc",
    "importlib.import_module('luftpause.runtime.app')",
    "from luftpause.dev.stack import Stack",
])
def test_a_crossing_is_found_however_it_is_written(source):
    assert crossings("luftpause.scheduler", "luftpause.scheduler.picker", source)


@pytest.mark.parametrize("source", [
    "from luftpause.scheduler.core import decide",
    "from . import envoy",
    "from .core import Policy",
    "from luftpause import vocabulary as h",
    "from luftpause.proto import scheduler_pb2 as pb",
    "from luftpause.link import SchedulerLink",
    "import grpc",
])
def test_own_and_shared_imports_pass(source):
    assert not crossings("luftpause.scheduler", "luftpause.scheduler.host", source)
