"""Regenerate the Python gRPC modules beside ``scheduler.proto``.

Run through ``make proto``. ``python -m luftpause.proto.generate --check`` exits 1 when
the committed modules differ from what the .proto produces (the staleness test uses
the same function).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("scheduler.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile the protos into ``out_dir`` and return the generated module paths."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as build:
        # The virtual path makes generated imports read `from luftpause.proto import ...`.
        args = [
            "protoc",
            f"-Iluftpause/proto={PROTO_DIR}",
            f"--python_out={build}",
            f"--pyi_out={build}",
            f"--grpc_python_out={build}",
            *(f"luftpause/proto/{name}" for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        produced = sorted((Path(build) / "luftpause" / "proto").glob("*_pb2*"))
        written = []
        for path in produced:
            target = out_dir / path.name
            target.write_bytes(path.read_bytes())
            written.append(target)
        return written


def stale_modules() -> list[str]:
    """Names of committed generated modules that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as fresh:
        stale = []
        for path in generate(Path(fresh)):
            committed = PROTO_DIR / path.name
            if not committed.exists() or committed.read_bytes() != path.read_bytes():
                stale.append(path.name)
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale modules")
    args = parser.parse_args()
    if args.check:
        stale = stale_modules()
        if stale:
            sys.stderr.write(f"stale generated modules: {', '.join(stale)}; run `make proto`\n")
            return 1
        return 0
    generate(PROTO_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
