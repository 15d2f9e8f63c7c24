"""`validate` and `load_dduf` agree on the whole validation corpus (fixtures/hostile): an archive that
structural validation refuses is refused by `load_dduf` with a DDUFError that carries validate's rule codes
(``.codes``, and in its message), before any class is resolved; one that validation accepts is never refused
by the loader with a ZIP, DDUF or safetensors rule code (D/Z/S). The cases that only `validate --verify`
finds (H001, H002: altered bytes) are refused with the same code when the loader reads the entry.

None of the corpus is a loadable pipeline (its model_index.json names `TinyPipeline`, not a diffusers
class), so every case raises: what matters is which error, and that it comes before anything is built."""

from __future__ import annotations

import json
import re

import pytest

from conftest import HOSTILE
from dduf_plus.errors import DDUFError, DDUFIntegrityError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import validate
from dduf_plus.loading.files import ArchiveComponentFiles

CASES = json.loads((HOSTILE / "cases.json").read_text())
RULE_CODE = re.compile(r"[A-Z]\d{3}")


def load_error(file: str) -> DDUFError:
    from dduf_plus import load_dduf

    try:
        load_dduf(HOSTILE / file)
    except DDUFError as e:
        return e
    raise AssertionError(f"{file} loaded")


@pytest.mark.parametrize("file", sorted(CASES))
def test_load_refuses_what_validate_refuses_with_its_codes(file: str) -> None:
    refused = {f.code for f in validate(HOSTILE / file).errors}
    error = load_error(file)
    assert all(RULE_CODE.fullmatch(c) for c in error.codes), error.codes
    if refused:
        assert error.codes, f"{file}: validate refuses it ({sorted(refused)}); load_dduf raised " \
                            f"{type(error).__name__} with no rule code: {error}"
        assert set(error.codes) <= refused, (error.codes, refused)
        assert all(code in str(error) for code in error.codes), str(error)
    else:
        assert not [c for c in error.codes if c[0] in "DZS"], f"{file}: validate accepts it; load_dduf: {error}"


def test_the_corpus_exercises_both_sides() -> None:
    """Guards the test above against a corpus that stops covering it: most cases are refused structurally,
    including the ones only validate's post-open rules found before (D007, D011, D013, I001, I002)."""
    codes = {CASES[f]["code"] for f in CASES if not CASES[f]["verify"]}
    assert {"D007", "D011", "D013", "I001", "I002", "Z001", "S001"} <= codes
    assert sum(not CASES[f]["verify"] for f in CASES) >= 60


@pytest.mark.parametrize("file", sorted(f for f in CASES if CASES[f]["verify"]))
def test_altered_bytes_are_refused_with_verifys_code_when_read(file: str) -> None:
    """H001 (CRC-32) and H002 (sha256: the CRC-32 recomputed, as an attacker does) are what `validate
    --verify` reports; the loader (``verify=True``, the default) checks both for each entry it reads."""
    report = validate(HOSTILE / file, verify=True)
    damaged = {f.entry: f.code for f in report.errors if f.code in ("H001", "H002")}
    assert damaged, report
    with DDUFArchive(HOSTILE / file) as archive:
        for entry in damaged:
            component, name = entry.split("/")
            with pytest.raises(DDUFIntegrityError) as info:
                ArchiveComponentFiles(archive, component, verify=True).read_bytes(name)
            assert info.value.code in {f.code for f in report.errors if f.entry == entry}
            assert info.value.code in str(info.value) and entry in str(info.value)
