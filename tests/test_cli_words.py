"""Every input gets the right words (issue 19): findings grouped by rule for people, `dduf info` of a
.dduf.zst, non-ZIP inputs named for what they are, `dduf refs`/`dduf info` reference lines, info's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from dduf_plus.cli import main as cli_main
from dduf_plus.format.findings import finding, group_findings

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- findings grouped by rule --------------------------------------------------------------------------
def test_group_findings_lists_each_entry_once_in_order() -> None:
    items = [finding("Z018", "b", "entry has no ZIP64 extra field"), finding("I003", None, "no index"),
             finding("Z018", "a", "entry has no ZIP64 extra field"),
             {"code": "Z018", "entry": "b", "message": "entry has no ZIP64 extra field"}]  # a report dict too
    groups = group_findings(items)
    assert [(g.code, g.severity, g.entries) for g in groups] == [("Z018", "warning", ["b", "a"]),
                                                                 ("I003", "warning", [])]
    assert groups[0].message == "entry has no ZIP64 extra field" and groups[0].same_message
    assert len(groups[0].findings) == 3  # nothing dropped: every finding stays in its group


def test_group_findings_with_differing_messages_keeps_each_message() -> None:
    groups = group_findings([finding("S008", "x", "starts at 1"), finding("S008", "y", "starts at 2")])
    assert len(groups) == 1 and not groups[0].same_message
    assert groups[0].message.startswith("tensor data section not page-aligned")  # the rule's title
    assert [f.message for f in groups[0].findings] == ["starts at 1", "starts at 2"]
