"""atheris (libFuzzer) harness for validate() and DDUFArchive.

Each input is an archive's bytes. A crash is any exception but DDUFError, any X000 finding (a bug the
validator caught in itself), or a report whose verdict contradicts its errors. Seeds: the hostile corpus.

    python tests/fuzz/fuzz_validate.py -atheris_runs=200000            # seeds copied to a temp corpus dir
    python tests/fuzz/fuzz_validate.py -max_total_time=600 CORPUS_DIR  # libFuzzer flags and dirs as usual
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

with atheris.instrument_imports(include=["dduf_plus"]):
    from dduf_plus.errors import DDUFError
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.format.validate import validate
    from dduf_plus.storage.source import BytesSource




_runs = 0
_scratch = tempfile.NamedTemporaryFile(prefix="dduf-fuzz-", suffix=".dduf", delete=False)
_scratch.close()


def test_one_input(data: bytes) -> None:
    global _runs
    _runs += 1
    report = validate(BytesSource(data, "<fuzz>"), verify=True)
    if "X000" in report.codes or report.valid != (not report.errors):
        raise RuntimeError(f"validator bug: {report}")
    json.dumps(report.as_dict(), ensure_ascii=False).encode("utf-8")  # the JSON report is valid Unicode for any input
    if _runs % 16 == 0:  # now and then through a real file: LocalSource + the mmap hashing path
        with open(_scratch.name, "wb") as f:
            f.write(data)
        report = validate(_scratch.name, verify=True)
        if "X000" in report.codes:
            raise RuntimeError(f"validator bug (file): {report}")
    try:
        DDUFArchive(BytesSource(data, "<fuzz>")).close()
    except DDUFError:
        pass


def main() -> None:
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = Path(tempfile.mkdtemp(prefix="dduf-fuzz-corpus-"))
        for seed in sorted((ROOT / "fixtures" / "hostile").glob("*.dduf")):
            shutil.copy(seed, corpus / seed.name)
        argv.append(str(corpus))
        print(f"seed corpus: {corpus}", file=sys.stderr)
    atheris.Setup(argv, test_one_input)
    try:
        atheris.Fuzz()
    finally:
        os.unlink(_scratch.name)


if __name__ == "__main__":
    main()
