"""The docs name the scheduler's defaults as its command line has them.

The defaults are read from the scheduler's own argument parser (``luftpause.scheduler.__main__``,
each option built by ``luftpause.options.env_option``: a flag, its ``LUFTPAUSE_*`` variable and a
built-in default), with no ``LUFTPAUSE_*`` variable set. Every page under ``docs/`` and the
README is scanned for a default stated next to one of those options: by its flag or its
variable, or, for the on/off policy switches, by the words a page uses for them ("the lifted
ceiling", "the due-back slot"), in forms such as

- ``LUFTPAUSE_LIFT_CEILING=off`` (the default), ``--lift-ceiling on`` (default);
- ``--probe-period`` (default 2), (env ``LUFTPAUSE_INTERACTIVE_SLOTS``, default off), defaults to ``on``;
- (``LUFTPAUSE_RESUME_SLOTS``, on by default), the lifted ceiling stays off by default;
- a table with a "default" column, or a cell such as "off (default)" in an option's row.

A default so stated that the code does not have fails the test, naming the page and line.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Words a page uses for a policy switch without naming its flag or variable.
ALIASES = {
    "--lift-ceiling": (r"\blift(?:ed|ing|s)?\b",),
    "--resume-slots": (r"\bdue[- ]back slots?\b", r"\bresume slots?\b"),
    "--interactive-slots": (r"\binteractive[- ]slots?\b",),
}
NEAR = 200  # characters: how far before a stated default its option may be named
VALUE = r"[\w./:-]+"
# "X (the default)", "X (default)", "X, the default", "X is the default": the value before.
VALUE_THEN_DEFAULT = re.compile(
    rf"`?=?(?P<value>{VALUE})`?\s*(?:\((?:the )?default\b[^)]*\)|,\s*the default\b|\s+is the default\b)", re.IGNORECASE)
# "default X", "default: X", "defaults to X", "default is X": the value after.
DEFAULT_THEN_VALUE = re.compile(rf"\bdefault(?:s to|:| is)?\s+`?(?P<value>{VALUE})`?", re.IGNORECASE)
# "X by default" (not "was X by default": a page may tell what the default used to be).
BY_DEFAULT = re.compile(rf"(?<!\bwas )(?<!\bwere )\b(?P<value>{VALUE})`?\s+by default\b", re.IGNORECASE)


@dataclass(frozen=True)
class Option:
    flag: str
    env: str | None
    default: object
    choices: tuple[str, ...] | None

    def mentions(self) -> list[re.Pattern]:
        names = [re.escape(self.flag) + r"(?![\w-])"]
        if self.env:
            names.append(r"\b" + re.escape(self.env) + r"\b")
        return [re.compile(name) for name in names] + [re.compile(a, re.IGNORECASE) for a in ALIASES.get(self.flag, ())]

    def about_me(self, value: str) -> bool:
        """Whether ``value`` could be a value of this option at all (else the claim is about
        something else: "the default policy", "default with strict affinity")."""
        if self.choices is not None:
            return value.lower() in self.choices
        if isinstance(self.default, (int, float)):
            return _number(value) is not None
        if self.default is None:
            return value.lower() in ("none", "unset", "empty")
        return "." in value or "/" in value or value == "localhost"

    def has(self, value: str) -> bool:
        if isinstance(self.default, (int, float)):
            return _number(value) == float(self.default)
        if self.default is None:
            return True
        return value.lower() == str(self.default).lower()


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def scheduler_options(monkeypatch) -> list[Option]:
    """The scheduler's options and their built-in defaults, from the parser its ``parse_args``
    builds (caught as it parses an empty command line with no LUFTPAUSE_* variable set)."""
    from luftpause.scheduler import __main__ as scheduler_main

    for name in [n for n in os.environ if n.startswith("LUFTPAUSE_")]:
        monkeypatch.delenv(name)
    parsers: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        parsers.append(self)
        return parse(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    scheduler_main.parse_args([])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    (parser,) = parsers
    options = []
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.default is argparse.SUPPRESS:
            continue
        env = re.search(r"\benv (LUFTPAUSE_\w+)", action.help or "")
        choices = tuple(str(c).lower() for c in action.choices) if action.choices else None
        options.append(Option(flags[0], env and env.group(1), action.default, choices))
    return options


def units(text: str) -> list[tuple[int, str]]:
    """The page cut into sentences, each with the line its paragraph starts on: paragraphs joined across
    their line breaks; a table row, list item or heading starts a paragraph of its own."""
    out: list[tuple[int, str]] = []
    lines: list[tuple[int, str]] = []

    def flush():
        if not lines:
            return
        start = lines[0][0]
        joined = " ".join(line.strip() for _, line in lines).replace("**", "")
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\[])", joined):
            out.append((start, sentence))
        lines.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            flush()
            continue
        if stripped.startswith(("|", "#", "- ", "* ", "```")) or re.match(r"\d+\. ", stripped):
            flush()
        lines.append((number, line))
        if stripped.startswith(("|", "#", "```")):
            flush()
    flush()
    return out


DEFAULT_HEADINGS = ("default", "default value", "shipped")


def _cells(row: str) -> list[str]:
    """A table row's cells (a ``\\|`` inside a cell is not a border)."""
    return re.split(r"(?<!\\)\|", row.strip().strip("|"))


def default_columns(text: str) -> dict[int, int]:
    """Line -> column, for each row of a table whose heading row has a "default" (or "shipped")
    column."""
    columns: dict[int, int] = {}
    lines = text.splitlines()
    column = -1
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped.startswith("|"):
            column = -1
            continue
        cells = [cell.strip(" `*").lower() for cell in _cells(stripped)]
        if column == -1 and number < len(lines) and re.fullmatch(r"\|[\s|:-]+\|", lines[number].strip()):
            column = next((i for i, cell in enumerate(cells) if cell in DEFAULT_HEADINGS), -2)
        elif column >= 0 and not re.fullmatch(r"\|[\s|:-]+\|", stripped):
            columns[number] = column
    return columns


def stated_defaults(text: str, options: list[Option]) -> list[tuple[int, Option, str, str]]:
    """(line, option, value stated as its default, the sentence) for every default the text
    states next to one of ``options``."""
    found = []
    columns = default_columns(text)
    for line, sentence in units(text):
        mentions = sorted(((m.start(), m.end(), option) for option in options
                           for pattern in option.mentions() for m in pattern.finditer(sentence)), key=lambda m: m[:2])
        if not mentions:
            continue
        claims = [(m.start("value"), m.group("value")) for pattern in (VALUE_THEN_DEFAULT, DEFAULT_THEN_VALUE, BY_DEFAULT)
                  for m in pattern.finditer(sentence)]
        for at, value in claims:
            before = [(start, end, option) for start, end, option in mentions if end <= at and at - end <= NEAR]
            if not before:
                continue
            option = before[-1][2]
            if option.about_me(value):
                found.append((line, option, value, sentence))
        named = {option.flag: option for _, _, option in mentions}
        if line in columns and sentence.startswith("|") and len(named) == 1:
            (option,) = named.values()
            cells = [cell.strip(" `") for cell in _cells(sentence)]
            if columns[line] < len(cells) and option.about_me(cells[columns[line]]):
                found.append((line, option, cells[columns[line]], sentence))
    return found


def wrong_defaults(text: str, options: list[Option]) -> list[str]:
    return sorted({f"line {line}: {option.flag} (env {option.env}) stated default {value!r}, the code's is "
                   f"{option.default!r}: {sentence[:160]!r}"
                   for line, option, value, sentence in stated_defaults(text, options) if not option.has(value)})


@pytest.fixture
def options(monkeypatch):
    return scheduler_options(monkeypatch)


def test_the_parser_is_read(options, monkeypatch):
    """Every policy switch is found, with the default the scheduler parses to."""
    from luftpause.scheduler.__main__ import parse_args

    by_flag = {option.flag: option for option in options}
    assert {"--interactive-slots", "--resume-slots", "--lift-ceiling", "--probe-period"} <= set(by_flag)
    assert by_flag["--lift-ceiling"].env == "LUFTPAUSE_LIFT_CEILING"
    parsed = vars(parse_args([]))
    for option in options:
        assert parsed[option.flag.removeprefix("--").replace("-", "_")] == option.default


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_only_defaults_the_scheduler_has(page, options):
    wrong = wrong_defaults(page.read_text(), options)
    assert not wrong, f"{page.relative_to(ROOT)} states scheduler defaults the code does not have:\n" + "\n".join(wrong)


# Sentences of docs/results/README-eager.md as it stood (commit 06d03a1), when the scheduler
# already shipped --lift-ceiling on: each states the old default.
STALE = [
    'What was tried to make luftpause keep its batch throughput at eager step 0 without losing the preset cell, '
    'and what it measured. The rule is described in docs/admission.md ("Lifted where the engine shows it costs '
    'little"); it stays **off by default** because the preset cell was lost with it on (below).',
    "`python -m luftpause.loadgen.regimes --cell gpus=separate`, with `LUFTPAUSE_LIFT_CEILING=on`\n"
    "and then `=off` (the default), one repeat each, right after one another:",
    "Not met: no version of the rule tells eager 0 from eager 20 on this host reliably (on a\n"
    "shared GPU or on separate ones), so lifting stays off by default and the default's\n"
    "figures stand.",
    "| option | values | default |\n|---|---|---|\n| `--lift-ceiling` | on, off, throughput | off |",
    "| switch | environment, flag | shipped |\n|---|---|---|\n"
    "| the lifted ceiling | `LUFTPAUSE_LIFT_CEILING`, `--lift-ceiling on\\|off\\|throughput` | off |",
    "The scheduler's `--probe-period` (default 5 s) sets how often engines are probed.",
    "The wall is kept unless asked: `LUFTPAUSE_LIFT_CEILING` defaults to `off`.",
]
RIGHT = [
    "### Lifted where the engine shows it pays (on by default)",
    "while its tool call is due back (`LUFTPAUSE_RESUME_SLOTS`, on by default), or for the whole pause with\n"
    "`LUFTPAUSE_INTERACTIVE_SLOTS=on` (`docs/admission.md`).",
    "Before this the rule was off by default.",
    "`LUFTPAUSE_LIFT_CEILING=off` (or the scheduler's `--lift-ceiling off`) keeps the graph size as the wall.",
    "| option | values | default |\n|---|---|---|\n| `--lift-ceiling` | on, off, throughput | on |",
    "| switch | environment, flag | shipped |\n|---|---|---|\n"
    "| the lifted ceiling | `LUFTPAUSE_LIFT_CEILING`, `--lift-ceiling on\\|off\\|throughput` | on |\n"
    "| a slot for the whole pause | `LUFTPAUSE_INTERACTIVE_SLOTS`, `--interactive-slots on\\|off` | off |",
    "The scheduler's `--probe-period` (default 2 s) sets how often engines are probed.",
    "(default with strict affinity; `LUFTPAUSE_RESUME_SLOTS=off`, or the scheduler's `--resume-slots off`,\n"
    "turns it off)",
]


@pytest.mark.parametrize("text", STALE)
def test_a_stale_default_is_found(text, options):
    assert wrong_defaults(text, options), text


@pytest.mark.parametrize("text", RIGHT)
def test_a_right_default_passes(text, options):
    assert not wrong_defaults(text, options), text
