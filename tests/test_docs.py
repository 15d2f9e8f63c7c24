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
