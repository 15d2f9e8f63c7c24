"""The README stays a one-screen entry point: at most 10 KB, every relative link resolves, and the two
quick-start commands `.ci/run` executes are where it looks for them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_fits_on_a_screen() -> None:
    assert README.stat().st_size <= 10 * 1024, f"README.md is {README.stat().st_size} bytes; move detail to docs/"


def test_relative_links_resolve() -> None:
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_quick_start_has_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    block = text.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2 and "pytest" in commands[1], commands


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _cli_options() -> dict[str, set[str]]:
    """Every option string of every `dduf` sub-command, from the real parser (plus the global ones)."""
    from dduf_plus.cli import COMMANDS, build_parser

    options = {}
    for command in COMMANDS:
        parser = build_parser(command)
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        options[command] = set(sub._option_string_actions) | set(parser._option_string_actions)
    return options


def _code_pieces(text: str) -> list[str]:
    """Lines of fenced code blocks and inline code spans: where docs write command lines."""
    blocks = re.findall(r"```[\w-]*\n(.*?)```", text, re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for block in blocks for line in block.splitlines()] + spans


def unknown_cli_words(text: str, options: dict[str, set[str]]) -> list[str]:
    """`dduf CMD ... --flag` where CMD is no sub-command or --flag is none of CMD's options."""
    bad = []
    for piece in _code_pieces(text):
        piece = piece.replace("\\|", "/")  # `ARCHIVE\|FOLDER` in a table cell
        for match in re.finditer(r"(?:^|(?<=[\s$(]))dduf ([a-z][\w-]*)(.*)", piece):
            command, tail = match.groups()
            if command not in options:
                bad.append(f"dduf {command}: no such command")
                continue
            tail = re.split(r"\s(?:\||&&|;|#|>)\s?", tail)[0]  # the next command of a pipeline, a comment
            bad += [f"dduf {command} {flag}" for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", tail)
                    if flag not in options[command]]
    return bad


def test_every_documented_dduf_option_exists() -> None:
    """docs/loading.md once sent users to `dduf validate --hash` (it is `--verify`)."""
    options = _cli_options()
    assert unknown_cli_words("see `dduf validate --hash` and\n```sh\n$ dduf verify x.dduf\n```\n", options) == [
        "dduf verify: no such command", "dduf validate --hash"]
    bad = {f"{doc.relative_to(ROOT)}: {word}" for doc in DOCS
           for word in unknown_cli_words(doc.read_text(encoding="utf-8"), options)}
    assert not bad, sorted(bad)


OUTPUTS = {"bench/results/gpu_load.json"}  # written by `python bench/gpu_load.py` on a GPU machine, not yet run


def test_docs_cite_only_files_in_the_repository() -> None:
    """docs/precision.md once cited CONTEXT.md, which is not in the repository."""
    missing = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for name in re.findall(r"\b(?:bench|tests|dduf_plus|fixtures|examples|docs|\.ci)/[\w./-]*\.(?:py|json|md|png)\b",
                               text):
            if not (ROOT / name).exists() and name not in OUTPUTS:
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
        missing += [f"{doc.relative_to(ROOT)}: {name}" for name in re.findall(r"\b[A-Z]+\.md\b", text)
                    if not (ROOT / name).exists()]
    assert not missing, missing


def test_documented_scripts_and_their_options_exist() -> None:
    """`python bench/X.py --flag` lines: the script is in the repository and declares the option."""
    bad = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in re.finditer(r"python ((?:bench|tests|fixtures|examples)/[\w/]+\.py)([^`\n]*)", text):
            script = ROOT / match.group(1)
            if not script.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {match.group(1)} does not exist")
                continue
            source = script.read_text(encoding="utf-8")
            tail = re.split(r"\s(?:\||&&|;|#|>)\s?", match.group(2))[0]
            bad += [f"{doc.relative_to(ROOT)}: {match.group(1)} {flag}"
                    for flag in re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", tail)  # -x=: libFuzzer's own flags
                    if f'"{flag}"' not in source and f"'{flag}'" not in source]
    assert not bad, bad
