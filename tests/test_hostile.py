"""The committed hostile corpus (fixtures/hostile): every case triggers its rule code, the reader refuses
what validation refuses, and the generator reproduces the corpus."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from dduf_plus.errors import DDUFValidationError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.findings import RULES
from dduf_plus.format.validate import validate

HOSTILE = Path(__file__).resolve().parent.parent / "fixtures" / "hostile"
CASES: dict[str, dict] = json.loads((HOSTILE / "cases.json").read_text())


def test_corpus_is_complete():
    assert len(CASES) >= 25
    on_disk = {p.name for p in HOSTILE.glob("*.dduf")} - {"valid.dduf"}
    assert on_disk == set(CASES)
    assert all(case["code"] in RULES for case in CASES.values())
    assert all((HOSTILE / f).stat().st_size < 16 << 10 for f in CASES)


def test_corpus_covers_every_rule():
    covered = {case["code"] for case in CASES.values()}
    # internal errors are tested by fault injection (test_validate); Z021/Z022 need a .zst (test_validate_zst,
    # test_security_caches)
    # S011 needs more than 65,536 tensors: far past the corpus' 16 KiB per file (tests/test_security_budgets.py)
    # Q006 needs the model class, so only load_dduf checks it (tests/test_quant_backends.py, test_quant_sdnq.py)
    # L001-L005 need the model built: only the opt-in load check finds them (tests/test_validate_loadable.py)
    load_check = {"L001", "L002", "L003", "L004", "L005"}
    assert set(RULES) - covered == {"X000", "Z021", "Z022", "S011", "Q006"} | load_check


def test_the_baseline_is_valid_everywhere():
    path = HOSTILE / "valid.dduf"
    report = validate(path, verify=True, strict=True)
    assert report.valid, report
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    from huggingface_hub import read_dduf_file

    assert "model_index.json" in read_dduf_file(path)


@pytest.mark.parametrize("file", sorted(CASES))
def test_case_triggers_its_code(file):
    case = CASES[file]
    rule = RULES[case["code"]]
    report = validate(HOSTILE / file, verify=case["verify"])
    assert case["code"] in report.codes, report
    assert "X000" not in report.codes
    if rule.severity == "error":
        assert not report.valid and case["code"] in [f.code for f in report.errors]
    else:
        assert report.valid, report  # warning and info cases break nothing else
        # --strict promotes warnings, never infos (a foreign or slower archive)
        assert validate(HOSTILE / file, strict=True).valid == (rule.severity == "info")
    if case["verify"]:
        assert validate(HOSTILE / file).valid  # damaged data is invisible without hashing


# validate() adds these to the reader's record-level rules (configs parse, shard indexes, references,
# index digests): the reader may open such archives.
ADDED_BY_VALIDATE = {"D007", "D011", "D013", "D014", "D015", "R001", "I001", "I002",
                     "Q001", "Q002", "Q003", "Q004", "Q005",
                     "D016", "D017", "D019", "Q007",
                     "A001", "A002", "A003", "A004", "A005", "A006"}  # (the loader refuses these where it builds the component)


@pytest.mark.parametrize("file", sorted(CASES))
def test_reader_refuses_what_validation_refuses(file):
    case = CASES[file]
    must_refuse = RULES[case["code"]].severity == "error" and not case["verify"]
    try:
        with DDUFArchive(HOSTILE / file) as archive:
            opened = "model_index.json" in archive
    except DDUFValidationError as e:
        assert must_refuse, f"{file}: {e}"
        assert case["code"] in e.codes or case["code"] in ADDED_BY_VALIDATE
        return
    assert opened
    assert not must_refuse or case["code"] in ADDED_BY_VALIDATE, f"{file} opened"


def test_generator_reproduces_the_corpus(tmp_path):
    module_spec = importlib.util.spec_from_file_location("make_hostile", HOSTILE / "make_hostile.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    cases = module.build(tmp_path)
    assert cases == CASES
    for file, case in cases.items():
        assert case["code"] in validate(tmp_path / file, verify=case["verify"]).codes, file
