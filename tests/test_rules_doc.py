"""docs/validation.md's rule table is generated from the rule data (dduf_plus/format/findings.py) and must
match it: one source for the CLI, `dduf serve`'s /v1/rules and the docs."""

from __future__ import annotations

import shutil
from pathlib import Path

from dduf_plus.format.findings import (
    RULES,
    RULES_TABLE_BEGIN,
    RULES_TABLE_END,
    SEVERITIES,
    rules_markdown,
    write_rules_table,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "validation.md"
FIX_COMMAND = "python -m dduf_plus.format.findings docs/validation.md"


def _generated_section(text: str) -> str:
    assert RULES_TABLE_BEGIN in text and RULES_TABLE_END in text, "docs/validation.md lost its table markers"
    return text.split(RULES_TABLE_BEGIN + "\n", 1)[1].split("\n" + RULES_TABLE_END, 1)[0]


def test_docs_table_is_the_rule_data() -> None:
    assert _generated_section(DOC.read_text(encoding="utf-8")) == rules_markdown(), f"run: {FIX_COMMAND}"


def test_every_rule_says_what_why_and_how() -> None:
    for rule in RULES.values():
        assert rule.severity in SEVERITIES, rule.code
        for field in ("title", "checked_by", "meaning", "why", "fix"):
            value = getattr(rule, field)
            assert value.strip() and "|" not in value and "\n" not in value, (rule.code, field)


def test_a_hand_edit_is_found_and_rewritten(tmp_path: Path) -> None:
    doc = tmp_path / "validation.md"
    shutil.copy(DOC, doc)
    doc.write_text(doc.read_text(encoding="utf-8").replace("| Z001 | error |", "| Z001 | warning |"), encoding="utf-8")
    assert _generated_section(doc.read_text(encoding="utf-8")) != rules_markdown()
    assert write_rules_table(str(doc)) is True
    assert _generated_section(doc.read_text(encoding="utf-8")) == rules_markdown()
    assert write_rules_table(str(doc)) is False
