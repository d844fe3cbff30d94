"""No product function over 60 lines or 12 branches without a comment saying why.

Every function (methods and nested functions too) of the services and the shared and
tooling packages (``PRODUCT_DIRS``; the benchmarks' ``loadgen/``, packaged as
``luftpause.loadgen`` but a folder of its own, and the generated ``proto/`` are not
product code, and no folder in ``PRODUCT_DIRS`` is a link to another) is parsed, not
imported. Its lines are the ``def``'s, decorators left out, to its last line, nested
functions included; its branches are the ``if``/``elif``, ``for``, ``async for``,
``while``, ``except`` and ``case`` clauses in its own body (not in a nested function's or
lambda's). A function over a limit passes only with a comment just above its ``def`` (or
its first decorator) saying why it is long (``# long: ...``) or branchy
(``# branchy: ...``), or an entry in ``ALLOWED``.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("scheduler", "dataplane", "runtime", "picker", "luftpause", "fakes")
MAX_LINES = 60
MAX_BRANCHES = 12
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.match_case)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)

# Functions that may stay over the limits without a comment (file relative to the
# repository, then the dotted name): none now. An entry must be removed once its function
# is back under the limits (test_allowed_entries_are_still_needed says so).
ALLOWED: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Function:
    name: str  # "<file>::<dotted name>"
    lines: int
    branches: int
    says_long: bool  # a "# long: why" comment above it
    says_branchy: bool  # a "# branchy: why" comment above it

    @property
    def over(self) -> list[str]:
        """What it is over that no comment explains."""
        return ([f"{self.lines} lines"] if self.lines > MAX_LINES and not self.says_long else []) + \
            ([f"{self.branches} branches"] if self.branches > MAX_BRANCHES and not self.says_branchy else [])


def branches(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The branch clauses in ``function``'s own body (not in nested functions or lambdas)."""
    count, todo = 0, list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (*FUNCTIONS, ast.Lambda)):
            continue
        count += isinstance(node, BRANCHES)
        todo.extend(ast.iter_child_nodes(node))
    return count


def reasons_above(lines: list[str], first_line: int) -> list[str]:
    """The comment lines right above line ``first_line`` (1-based), nearest last."""
    comments, index = [], first_line - 2
    while index >= 0 and lines[index].lstrip().startswith("#"):
        comments.insert(0, lines[index].strip())
        index -= 1
    return comments


def says(comments: list[str], tag: str) -> bool:
    """Whether a comment is ``# <tag>: <a reason>``."""
    return any(c.startswith(f"# {tag}:") and c.removeprefix(f"# {tag}:").strip() for c in comments)


def functions_in(source: str, file: str) -> Iterator[Function]:
    lines = source.splitlines()

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, FUNCTIONS):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                comments = reasons_above(lines, first)
                yield Function(f"{file}::{prefix}{child.name}", child.end_lineno - child.lineno + 1,
                               branches(child), says(comments, "long"), says(comments, "branchy"))
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


@functools.cache
def product_functions() -> tuple[Function, ...]:
    found: list[Function] = []
    for folder in PRODUCT_DIRS:
        assert not (ROOT / folder).is_symlink(), folder
        for path in sorted((ROOT / folder).rglob("*.py")):
            file = path.relative_to(ROOT).as_posix()
            found.extend(functions_in(path.read_text(encoding="utf-8"), file))
    return tuple(found)


def test_no_function_is_long_or_branchy_without_saying_why() -> None:
    offenders = [f"{f.name}: {', '.join(f.over)}" for f in product_functions() if f.over and f.name not in ALLOWED]
    assert not offenders, (
        f"functions over {MAX_LINES} lines or {MAX_BRANCHES} branches: split them, or say why above the def "
        "(# long: ... / # branchy: ...):\n" + "\n".join(offenders))


def test_allowed_entries_are_still_needed() -> None:
    over = {f.name for f in product_functions() if f.over}
    stale = sorted(ALLOWED - over)
    assert not stale, f"no longer over the limits (or gone): remove from ALLOWED in {Path(__file__).name}: {stale}"


def test_the_scan_finds_what_it_should() -> None:
    """The counting itself, on a made-up module."""
    ifs = "".join(f"if x == {i}:\n    pass\n" for i in range(13))
    source = (
        "class C:\n"
        "    # branchy: one case per value, as the format lists them\n"
        "    @staticmethod\n"
        "    def explained(x):\n" + textwrap.indent(ifs, " " * 8)
        + "def unexplained(x):\n" + textwrap.indent(ifs, " " * 4)
        + "    def nested():\n"
        "        return [y for y in range(3) if y]\n"
        "    return lambda: 1 if x else 2\n"
        "# long:\n"
        "def no_reason(x):\n" + "    x += 1\n" * 60
    )
    found = {f.name.split("::")[1]: f for f in functions_in(source, "m.py")}
    assert found["C.explained"].branches == 13 and found["C.explained"].over == []
    assert found["unexplained"].branches == 13 and found["unexplained"].over == ["13 branches"]
    assert found["unexplained.nested"].branches == 0
    assert found["no_reason"].over == ["61 lines"]  # a tag without a reason says nothing
