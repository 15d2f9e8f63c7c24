"""Catalogue-scale validation: ``validate_many`` on threads, processes and a real Dask ``LocalCluster`` gives
the serial results; ``dduf validate --from-file LIST --jobs N --json-lines`` streams exactly ``--json``'s
entries, is concurrent, and bad lines (missing files, unreachable or slow URLs) are report lines, never the
end of the batch."""

from __future__ import annotations

import io
import json
import multiprocessing
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest
from servers import FileServer

from conftest import HOSTILE
from dduf_plus import validate, validate_many
from dduf_plus.catalogue import validate_one
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFUsageError

CASES: dict[str, dict] = json.loads((HOSTILE / "cases.json").read_text())


def hostile_corpus() -> list[str]:
    """Every committed hostile case plus the valid baseline (as tests/test_hostile.py enumerates them)."""
    return [str(HOSTILE / name) for name in ["valid.dduf", *sorted(CASES)]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """Valid archives (the packed fixture pipelines and the baseline) and two hostile cases on a FileServer."""
    from conftest import FIXTURE_NAMES, PIPELINES
    from dduf_plus.format.pack import pack_folder

    root = tmp_path_factory.mktemp("served")
    for name in FIXTURE_NAMES:
        pack_folder(PIPELINES / name, root / f"{name}.dduf", quiet=True)
    for name in ("valid.dduf", "crc-mismatch.dduf", "duplicate-name.dduf"):
        shutil.copy(HOSTILE / name, root / name)
    with FileServer(root) as server:
        yield server, sorted(p.name for p in root.iterdir())


@pytest.fixture(scope="module")
def sources(served) -> list[str]:
    server, names = served
    bad = ["/no/such/archive.dduf", server.url("missing.dduf"), f"http://127.0.0.1:{closed_port()}/x.dduf"]
    return hostile_corpus() + [server.url(n) for n in names] + bad


def serial(sources: list[str], **kwargs) -> list:
    return [validate_one(s, **kwargs) for s in sources]


def test_results_are_what_validate_returns_one_per_source(sources):
    """validate_many / validate_one yield ValidationReport objects, as validate returns them (``as_dict()``: the
    ``--json`` record); an unreadable source is a report with ``io_error``."""
    from dduf_plus.format.validate import ValidationReport

    results = serial(sources)
    assert [r.path for r in results] == sources
    for r in results:
        assert isinstance(r, ValidationReport)
        d = r.as_dict()
        assert d["path"] == r.path and d["valid"] == r.valid
        assert (r.io_error is None) == ("io_error" not in d)
    by_source = {r.path: r for r in results}
    assert by_source[str(HOSTILE / "valid.dduf")].valid
    assert by_source[str(HOSTILE / "valid.dduf")] == validate(HOSTILE / "valid.dduf")  # the same object
    for name, case in CASES.items():  # the corpus' own verdicts (test_hostile) survive the batch form
        r = by_source[str(HOSTILE / name)]
        assert r.io_error is None and case["code"] in r.codes or case["verify"], name
    bad = [r for r in results if r.io_error is not None]
    assert [r.path for r in bad] == sources[-3:]
    assert all(not r.valid and not r.findings for r in bad)
    assert "No such file" in bad[0].io_error and "404" in bad[1].io_error and "refused" in bad[2].io_error


def test_thread_and_process_executors_match_serial(sources):
    expected = serial(sources, verify=True)
    assert list(validate_many(sources, verify=True)) == expected  # the default thread pool
    with ThreadPoolExecutor(3) as pool:
        assert list(validate_many(sources, executor=pool, verify=True)) == expected
        unordered = list(validate_many(sources, executor=pool, verify=True, ordered=False))
    assert sorted(unordered, key=lambda r: r.path) == sorted(expected, key=lambda r: r.path)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert list(validate_many(sources, executor=pool, verify=True)) == expected
    assert any(r.errors and r.errors[0].code == "H001" for r in expected)  # verify ran


def test_strict_reaches_the_workers():
    path = str(HOSTILE / "reference-without-source.dduf")  # a warning-only case (R003)
    assert validate_one(path).valid and not validate_one(path, strict=True).valid
    with ThreadPoolExecutor(2) as pool:
        assert [r.valid for r in validate_many([path], executor=pool, strict=True)] == [False]


def test_sources_are_read_lazily_through_a_bounded_window():
    consumed = []

    def sources():
        for i in range(200):
            consumed.append(i)
            yield str(HOSTILE / "valid.dduf")

    results = validate_many(sources(), max_workers=2)
    first = next(results)
    assert first.valid and len(consumed) <= 2 * 4 + 1
    assert sum(1 for _ in results) == 199


def test_a_broken_executor_gives_results_not_an_exception():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    results = list(validate_many(hostile_corpus()[:3], executor=pool))
    assert len(results) == 3 and not any(r.valid for r in results)
    assert all("executor error: RuntimeError" in r.io_error for r in results)
    with pytest.raises(DDUFUsageError, match="at least 1"):
        validate_many([], max_workers=0)
    with pytest.raises(DDUFUsageError, match="list of sources"):
        validate_many(str(HOSTILE / "valid.dduf"))
    with pytest.raises(DDUFUsageError, match=r"validate_many\(sources=\.\.\.\): expected an iterable .* got int 5"):
        validate_many(5)  # type: ignore[arg-type]  # refused at the call (was a TypeError at the first next())


def test_per_source_time_limit(tmp_path):
    """The slow server would answer after 60 s: the batch ends with its deadline error while that answer is
    still being held back (an event, not a wall-clock figure: a busy machine cannot pass or fail it)."""
    shutil.copy(HOSTILE / "valid.dduf", tmp_path / "slow.dduf")
    with FileServer(tmp_path, latency=60.0) as slow:
        results = list(validate_many([slow.url("slow.dduf"), str(HOSTILE / "valid.dduf")], timeout=0.5))
        assert slow.waited_out == 0  # no answer came: the batch did not wait for the slow check
    assert "deadline of 0.5 s" in results[0].io_error and not results[0].valid
    assert results[1].valid


def test_stopping_early_does_not_wait_for_running_checks(tmp_path):
    shutil.copy(HOSTILE / "valid.dduf", tmp_path / "slow.dduf")
    with FileServer(tmp_path, latency=60.0) as slow:
        results = validate_many([str(HOSTILE / "valid.dduf")] + [slow.url("slow.dduf")] * 8, max_workers=2)
        assert next(results).valid
        results.close()  # a consumer that has seen enough (or Ctrl-C): the queued checks are cancelled
        assert slow.waited_out == 0  # close() returned with both running checks still held at the server


# --- the command line --------------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["validate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_list(path: Path, sources: list[str]) -> Path:
    body = "# a catalogue\n\n" + "".join(f"  {s}  \n" + ("# comment\n\n" if i % 5 == 0 else "") for i, s in enumerate(sources))
    path.write_text(body)
    return path


def test_json_lines_equal_json_of_each_source(sources, tmp_path, capsys):
    listing = write_list(tmp_path / "urls.txt", sources)
    code, out, err = run_cli(capsys, "--from-file", str(listing), "--jobs", "4", "--json-lines")
    assert code == 2  # unreadable sources are I/O errors, as for `dduf validate FILE...`; they win over 1
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(line["path"] for line in lines) == sorted(sources)
    for line in lines:
        single_code, single, _ = run_cli(capsys, line["path"], "--json")
        assert json.loads(single) == {"schema_version": 1, "files": [line]}
        assert single_code == (2 if "io_error" in line else 0 if line["valid"] else 1)
    assert err.count("dduf validate: error:") == 3  # one stderr line per unreadable source


def test_json_lines_from_stdin_and_exit_codes(tmp_path, capsys, monkeypatch):
    valid, invalid = str(HOSTILE / "valid.dduf"), str(HOSTILE / "duplicate-name.dduf")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"# header\n{valid}\n\n{valid}\n"))
    code, out, _ = run_cli(capsys, "--from-file", "-", "--json-lines")
    assert code == 0 and [json.loads(x)["valid"] for x in out.splitlines()] == [True, True]
    code, out, _ = run_cli(capsys, invalid, "--from-file", str(write_list(tmp_path / "l.txt", [valid])), "--json-lines")
    assert code == 1 and len(out.splitlines()) == 2
    code, out, _ = run_cli(capsys, "--from-file", str(tmp_path / "l.txt"))  # human output, threads
    assert code == 0 and out.startswith("VALID ")
    code, out, _ = run_cli(capsys, "--from-file", str(tmp_path / "l.txt"), "--json")  # one document, in order
    assert code == 0 and [f["path"] for f in json.loads(out)["files"]] == [valid]


@pytest.mark.parametrize("argv, message", [
    ((), "give at least one FILE_OR_URL"),
    (("--from-file", "/no/such/list.txt", "--json-lines"), "cannot open"),
    (("x.dduf", "--json", "--json-lines"), "exclude each other"),
    (("--from-file", "-", "--jobs", "0"), "at least 1"),
])
def test_usage_errors_exit_2_before_any_work(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and message in err


def test_bad_lines_do_not_stop_the_batch(tmp_path, capsys):
    (tmp_path / "a-folder.dduf").mkdir()
    bad = ["/no/such/archive.dduf", f"http://127.0.0.1:{closed_port()}/x.dduf", str(tmp_path / "a-folder.dduf"),
           "ftp://example.invalid/x.dduf", "simplecache::http://127.0.0.1/x.dduf"]
    valid = str(HOSTILE / "valid.dduf")
    listing = write_list(tmp_path / "list.txt", [*bad, valid, *bad, valid])
    code, out, err = run_cli(capsys, "--from-file", str(listing), "-j", "3", "--json-lines")
    lines = [json.loads(x) for x in out.splitlines()]
    assert code == 2 and len(lines) == 12
    assert sum(1 for x in lines if x["valid"]) == 2
    assert all(x["io_error"] and x["path"] in bad for x in lines if not x["valid"])
    assert "Traceback" not in err


def test_json_lines_stream_as_each_archive_finishes(tmp_path):
    """A real process and a pipe (not a terminal): the fast archive's line arrives while the slow one runs
    (its server holds every answer until the test lets it go: an event, whatever the machine's load)."""
    shutil.copy(HOSTILE / "valid.dduf", tmp_path / "slow.dduf")
    with FileServer(tmp_path, latency=60.0) as slow:
        listing = write_list(tmp_path / "l.txt", [slow.url("slow.dduf"), str(HOSTILE / "valid.dduf")])
        proc = subprocess.Popen([sys.executable, "-m", "dduf_plus.cli", "validate", "--from-file", str(listing),
                                 "--jobs", "2", "--json-lines"], stdout=subprocess.PIPE, text=True)
        try:
            first = json.loads(proc.stdout.readline())
            assert proc.poll() is None and slow.waited_out == 0  # printed while the slow check is held
            slow.latency = 0.0
            slow.release.set()  # let the held request go: the slow archive's line follows
            second = json.loads(proc.stdout.readline())
        finally:
            proc.stdout.close()
            proc.wait(60)
    assert first["path"] == str(HOSTILE / "valid.dduf") and second["path"] == slow.url("slow.dduf")
    assert proc.returncode == 0


def test_jobs_8_is_concurrent(tmp_path, capsys):
    """Counted at the server: with --jobs 8, eight requests are held there at once; with --jobs 1, one."""
    for i in range(8):
        shutil.copy(HOSTILE / "valid.dduf", tmp_path / f"a{i:02d}.dduf")
    held, most = [0], {}
    lock = threading.Lock()

    def count(method: str, path: str, headers: object) -> None:
        with lock:
            held[0] += 1
            most[jobs] = max(most.get(jobs, 0), held[0])

    with FileServer(tmp_path, latency=0.2, on_request=count) as server:
        original = server.release.wait

        def wait(timeout: float | None = None) -> bool:  # the latency ends: one request fewer held
            try:
                return original(timeout)
            finally:
                with lock:
                    held[0] -= 1

        server.release.wait = wait  # type: ignore[method-assign]
        listing = write_list(tmp_path / "urls.txt", [server.url(f"a{i:02d}.dduf") for i in range(8)])
        for jobs in ("1", "8"):
            code, out, _ = run_cli(capsys, "--from-file", str(listing), "--jobs", jobs, "--json-lines")
            assert code == 0 and len(out.splitlines()) == 8
    assert most["1"] == 1 and most["8"] >= 4, most  # 8 at once when the threads start together; 4 is proof


# --- Dask -----------------------------------------------------------------------------------------------------


def test_dask_local_cluster_matches_the_local_run(sources):
    distributed = pytest.importorskip("distributed", reason="Dask distributed is not installed (extra `dask`)")
    expected = serial(sources)
    # two worker processes (results and arguments really cross a process boundary), small for 2 cores
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=None,
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        with client.get_executor() as executor:
            assert list(validate_many(sources, executor=executor)) == expected
            unordered = list(validate_many(sources, executor=executor, ordered=False))
    assert sorted(unordered, key=lambda r: r.path) == sorted(expected, key=lambda r: r.path)
