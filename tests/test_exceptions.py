"""Each service's own exceptions derive from its base, and every base from LuftpauseError
(luftpause/errors.py): ``except LuftpauseError`` catches what luftpause raised on purpose."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from luftpause.dataplane.errors import DataplaneError
from luftpause.errors import LuftpauseError
from luftpause.picker.errors import PickerError
from luftpause.runtime.errors import RuntimeServiceError
from luftpause.scheduler.errors import SchedulerError

BASES = {"luftpause.scheduler": SchedulerError, "luftpause.dataplane": DataplaneError,
         "luftpause.picker": PickerError, "luftpause.runtime": RuntimeServiceError}
TOOLS = ("luftpause.dev", "luftpause.loadgen", "luftpause.fakes", "luftpause.proto")  # not services


def modules(package: str) -> list[str]:
    root = importlib.import_module(package)
    return [package, *(info.name for info in pkgutil.walk_packages(root.__path__, package + "."))]


def own_exceptions(module_name: str) -> list[type[BaseException]]:
    module = importlib.import_module(module_name)
    return [value for value in vars(module).values()
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module_name]


@pytest.mark.parametrize("package", sorted(BASES))
def test_a_services_exceptions_derive_from_its_base(package):
    found = [(name, cls) for name in modules(package) if not name.endswith(".__main__")
             for cls in own_exceptions(name)]
    assert len(found) >= 2
    strays = [f"{cls.__module__}.{cls.__qualname__}" for _, cls in found if not issubclass(cls, BASES[package])]
    assert strays == []


def test_the_shared_packages_exceptions_derive_from_luftpause_error():
    shared = [info.name for info in pkgutil.iter_modules(importlib.import_module("luftpause").__path__, "luftpause.")
              if not info.name.startswith(TOOLS) and info.name not in {f"luftpause.{s}" for s in
                                                                      ("scheduler", "dataplane", "picker", "runtime")}]
    found = [cls for name in shared for cls in own_exceptions(name)]
    assert len(found) >= 5
    assert [f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, LuftpauseError)] == []
    assert all(issubclass(base, LuftpauseError) for base in BASES.values())
