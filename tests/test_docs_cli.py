"""The command lines README.md and docs/cli.md show are the parsers' own: every command, flag and default they
write exists and holds (as tests/test_readme_numbers.py ties README's numbers to bench/results), and docs/cli.md's
synopsis names every flag each command has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from conftest import ROOT
from dduf_plus.cli import COMMANDS, build_parser

FLAG = re.compile(r"(?<![\w\[-])(--?[a-zA-Z][\w-]*)")
INLINE = re.compile(r"`(dduf [^`]+)`")
TOP_LEVEL = {"-v", "-vv", "--verbose", "--version", "-h", "--help"}  # given before the command


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


def options(command: str) -> dict[str, argparse.Action]:
    return {s: a for a in subparser(command)._actions for s in a.option_strings}


def synopsis_lines() -> list[str]:
    """docs/cli.md's first code block: one `dduf COMMAND ...` line each (comments dropped)."""
    block = (ROOT / "docs" / "cli.md").read_text().split("```")[1]
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def documented() -> list[tuple[str, str]]:
    """(where, command line) for the synopsis and every inline `dduf ...` of README.md and docs/cli.md."""
    found = [("docs/cli.md synopsis", line) for line in synopsis_lines()]
    for name in ("README.md", "docs/cli.md"):
        text = (ROOT / name).read_text().replace("\\|", "|")
        found += [(name, m[1]) for m in INLINE.finditer(text)]
    return found


def flag_values(line: str) -> list[tuple[str, str | None]]:
    """(flag, the word after it in the same bracket or None) for each flag on the line."""
    words = line.replace("[", " [ ").replace("]", " ] ").split()
    out = []
    for i, word in enumerate(words):
        flag = FLAG.fullmatch(word.split("=", 1)[0])
        if flag:
            after = words[i + 1] if i + 1 < len(words) else None
            out.append((flag[1], None if after in (None, "[", "]") or FLAG.fullmatch(after) else after))
    return out


def test_the_synopsis_names_every_command_and_flag() -> None:
    lines = synopsis_lines()
    assert {line.split()[1] for line in lines} == set(COMMANDS)
    for command in COMMANDS:
        written = {flag for line in lines if line.split()[1] == command for flag, _ in flag_values(line)}
        flags = {a.option_strings[-1] for a in set(options(command).values())} - {"--help"}
        missing = sorted(f for f in flags if not set(options(command)[f].option_strings) & written)
        assert missing == [], f"docs/cli.md's synopsis lacks {command} {missing}"


@pytest.mark.parametrize(("where", "line"), documented(), ids=lambda x: x if len(x) < 40 else x[:40])
def test_each_documented_command_flag_and_default_is_the_parsers(where: str, line: str) -> None:
    command = line.split()[1]
    if command.rstrip(":").isupper():  # `dduf COMMAND --help`: a placeholder
        return
    if command.startswith("-"):  # `dduf --version`, `dduf -v ...`
        assert command in TOP_LEVEL, (where, line)
        return
    assert command in COMMANDS, f"{where}: `{line}`: no command {command!r}"
    known = options(command)
    for flag, value in flag_values(line):
        if flag in TOP_LEVEL and flag not in known:
            continue
        assert flag in known, f"{where}: `{line}`: dduf {command} has no {flag}"
        action = known[flag]
        default = action.default
        if value is None or default in (None, False, [], argparse.SUPPRESS) or not action.nargs and action.const:
            continue
        if value.lower() != value or value.startswith("-") and not value[1:].isdigit():
            continue  # a placeholder (N, SIZE, [NAME=]SPEC) or a flag, not a value
        convert = action.type if callable(action.type) else (lambda v: v)
        expected = convert(default) if isinstance(default, str) else default
        assert convert(value) == expected, f"{where}: `{line}`: {flag} {value} is shown, the default is {default!r}"


def test_a_wrong_default_or_flag_would_be_caught() -> None:
    """The checks above can fail: a default the parser does not have, a flag it does not know."""
    with pytest.raises(AssertionError, match="the default is 3"):
        test_each_documented_command_flag_and_default_is_the_parsers("t", "dduf compress A [--level 19]")
    with pytest.raises(AssertionError, match="has no --exlude"):
        test_each_documented_command_flag_and_default_is_the_parsers("t", "dduf pack S -o O [--exlude C]")
    with pytest.raises(AssertionError, match="no command"):
        test_each_documented_command_flag_and_default_is_the_parsers("t", "dduf pakc S")


def test_readme_and_cli_doc_are_read() -> None:
    assert len(documented()) > 30 and all(Path(ROOT / n).is_file() for n in ("README.md", "docs/cli.md"))
