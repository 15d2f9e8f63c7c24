"""How many requests opening a remote archive takes (issue 22, "one round trip to open").

An http(s) source opens with one suffix range request (``Range: bytes=-N``, ``storage/http_range.SUFFIX_BYTES``):
it gives the size and brings the end records, directory and index (all of an archive up to N bytes). Before,
a 1-byte probe came first and the tail was a second request. Structural reads of a URL (``dduf validate URL``,
``dduf info URL``, ``DDUFArchive(URL)``, hosted references) go through ``storage/prefetch_source.PrefetchSource``,
which takes those bytes over and fetches the local headers, safetensors headers and configs the plan names in
a few merged requests. Before the plan, each header was read with its own request(s): 54 requests to validate
a 5.4 MB archive. Every hostile archive gives the same findings over HTTP as from disk, with or without the
plan. ``dduf info URL``, ``inspect_dtypes(URL)`` and hosted references of an indexed archive answer from the tail
alone (``remote/indexed.py``: one request) when the index agrees with the central directory, and check each
entry's local and safetensors header as its bytes arrive; otherwise they open in full, as before."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from servers import FileServer
from test_remote_cache_identity import rewrite_index

from conftest import HOSTILE, PIPELINES, ROOT
from dduf_plus.cli.info import FROM_INDEX
from dduf_plus.errors import DDUFError
from dduf_plus.format.validate import validate
from dduf_plus.storage.http_range import SUFFIX_BYTES, HTTPSource
from dduf_plus.storage.prefetch_source import PrefetchSource, coalesce

WEIGHT_FILES = 4  # tiny-sd's safetensors files: each starts a cluster of headers that cannot be merged
SUFFIX = f"bytes=-{SUFFIX_BYTES}"  # the opening request's Range header


def _pad_weights(folder: Path) -> None:
    """Each weights file grows past 1 MiB (a random 512x512 float32 tensor), so that the archive (5.4 MB) is
    read by ranges, not whole (storage/http_range.WHOLE_FILE_BELOW), and headers lie far apart."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    for path in sorted(folder.rglob("*.safetensors")):
        tensors = load_file(path)
        tensors["zz_padding.weight"] = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
        save_file(tensors, path)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(server, {name: archive}) with an indexed archive (dduf_plus) and one without an index
    (huggingface_hub's export_folder_as_dduf), both of the padded tiny-sd, and ``tiny``: tiny-dit packed by
    dduf_plus (456 KiB: shorter than the opening's suffix range)."""
    from dduf_plus.format.pack import pack_folder

    root = tmp_path_factory.mktemp("remote-requests")
    folder = root / "src"
    shutil.copytree(PIPELINES / "tiny-sd", folder)
    _pad_weights(folder)
    www = root / "www"
    www.mkdir()
    archives = {"indexed": pack_folder(folder, www / "indexed.dduf", quiet=True).path,
                "tiny": pack_folder(PIPELINES / "tiny-dit", www / "tiny.dduf", quiet=True).path}
    assert archives["tiny"].stat().st_size <= SUFFIX_BYTES
    hub = pytest.importorskip("huggingface_hub")
    hub.export_folder_as_dduf(str(www / "plain.dduf"), folder_path=str(folder))
    archives["plain"] = www / "plain.dduf"
    with FileServer(www) as server:
        yield server, archives


class _Plain:
    """An http(s) source read as before: a 1-byte probe, then one request per read (validate() plans the reads
    of an HTTPSource)."""

    def __init__(self, url: str):
        self.inner = HTTPSource(url, suffix=0)
        self.name, self.size = url, self.inner.size

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def read_at(self, offset: int, length: int) -> bytes:
        return self.inner.read_at(offset, length)

    def close(self) -> None:
        self.inner.close()


def _findings(report) -> list[tuple]:
    return sorted((f.code, f.severity, f.entry, f.message) for f in [*report.errors, *report.warnings])


def _count(server: FileServer, call) -> tuple[object, int]:
    server.reset()
    out = call()
    return out, server.gets


@pytest.mark.parametrize("name", ["indexed", "plain"])
def test_validate_url_takes_a_few_merged_requests(served, name: str) -> None:
    server, archives = served
    url = server.url(f"{name}.dduf")
    before, old = _count(server, lambda: validate(_Plain(url)))  # one request a read, as before
    after, new = _count(server, lambda: validate(url))
    assert _findings(after) == _findings(before) == _findings(validate(archives[name]))
    size = archives[name].stat().st_size
    tail_start, tail_length = server.ranges[0]
    assert tail_start + tail_length == size and server.range_headers[0] == SUFFIX  # size and tail: one request
    # the opening + one merged request per cluster of headers (each weights file ends one); was 54 / 39, then 6
    assert new <= 1 + WEIGHT_FILES + (name == "plain"), (new, server.ranges)
    assert new * 5 < old, (old, new)
    # a source opened by the caller (dduf serve's URL checks pass their own HTTPSource) is planned the same way
    given, direct = _count(server, lambda: validate(HTTPSource(url)))
    assert _findings(given) == _findings(after) and direct == new, (direct, new)


def test_archive_open_takes_a_few_requests(served) -> None:
    from dduf_plus.format.archive import DDUFArchive

    server, archives = served
    url = server.url("indexed.dduf")
    _, old = _count(server, lambda: DDUFArchive(_Plain(url)).close())
    _, new = _count(server, lambda: DDUFArchive(url).close())  # the full open: every header, merged reads
    assert new <= 1 + WEIGHT_FILES and new * 5 < old, (old, new)


def _info(url: str, capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    """(dduf info URL --json, dduf info URL's text)."""
    import json

    from dduf_plus.cli import main

    assert main(["info", url, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert main(["info", url]) == 0
    return described, capsys.readouterr().out


def test_info_of_an_indexed_archive_is_one_request(served, capsys: pytest.CaptureFixture) -> None:
    """dduf info URL of a 5.4 MB indexed archive: the opening suffix range only (directory, index and the
    index's copy of model_index.json); was 1 + one per weights file (5). Same description as from disk."""
    from dduf_plus.cli import main

    server, archives = served
    url = server.url("indexed.dduf")
    (described, text), gets = _count(server, lambda: _info(url, capsys))
    assert gets == 2 and server.range_headers == [SUFFIX, SUFFIX], server.range_headers  # one per command
    assert described.pop("from_index") is True and FROM_INDEX in text
    assert main(["info", str(archives["indexed"]), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert {**described, "path": None} == {**local, "path": None, "size": described["size"]}


def test_inspect_dtypes_of_an_indexed_archive_is_one_request(served) -> None:
    from dduf_plus.inspection import inspect_dtypes

    server, archives = served
    got, gets = _count(server, lambda: inspect_dtypes(server.url("indexed.dduf")))
    assert gets == 1 and got == inspect_dtypes(archives["indexed"]) and got["unet"]["dtype"] == "float32"


def test_hosted_reference_records_take_one_request(served) -> None:
    from dduf_plus.refs.hosted import hosted_member_records

    server, _ = served
    found, gets = _count(server, lambda: hosted_member_records(server.url("indexed.dduf"), "vae"))
    assert found is not None and set(found[0]) == {"config.json", "diffusion_pytorch_model.safetensors"}
    assert found[1]["_class_name"] == "StableDiffusionPipeline"
    assert gets == 1, (gets, server.ranges)  # was 1 + one per weights file


def _rewritten(path: Path, out: Path, change) -> Path:
    out.write_bytes(rewrite_index(path.read_bytes(), change))
    return out


def _first_2d(index: dict, entry: str) -> dict:
    """The record of the entry's first tensor whose shape reversed is another shape (of the same size)."""
    return next(t for t in index["files"][entry]["tensors"].values() if t["shape"] != t["shape"][::-1])


VAE = "vae/diffusion_pytorch_model.safetensors"
# index edits: one that only drops its copy of model_index.json (archives packed before it had one: one exact
# range request more), and lies the tail alone shows (full open: every header read, the same verdict as before)
EDITS = {
    "older index": lambda i: i.pop("model_index_json"),
    "offset off by one": lambda i: i["files"]["unet/config.json"].update(offset=i["files"]["unet/config.json"]["offset"] + 1),
    "entry missing": lambda i: i["files"].pop("tokenizer/vocab.json"),
    "tensor past its file": lambda i: _first_2d(i, VAE).update(offset=i["files"][VAE]["offset"] + i["files"][VAE]["size"]),
    "nbytes not its shape": lambda i: _first_2d(i, VAE).update(nbytes=_first_2d(i, VAE)["nbytes"] + 4),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_info_falls_back_when_the_index_does_not_answer(served, edit: str, capsys: pytest.CaptureFixture) -> None:
    """An index that disagrees with the central directory or the safetensors rules is not believed: dduf info
    opens the archive in full (every header read) and gives the full open's verdict (I002 here), as before."""
    from dduf_plus.cli import main
    from dduf_plus.format.archive import DDUFArchive

    server, archives = served
    name = f"edit-{list(EDITS).index(edit)}.dduf"
    path = _rewritten(archives["indexed"], server.root / name, EDITS[edit])
    try:
        url = server.url(name)
        if edit == "older index":  # still from the index: model_index.json's own bytes, one exact range more
            (described, _), gets = _count(server, lambda: _info(url, capsys))
            assert described["from_index"] and gets == 2 * 2 and server.range_headers[1].startswith("bytes=0-")
            return
        code, gets = _count(server, lambda: main(["info", url]))
        captured = capsys.readouterr()
        assert FROM_INDEX not in captured.out, captured
        _, full = _count(server, lambda: DDUFArchive(url, check=False).close())
        assert gets == full > 1, (gets, full)  # the full open's reads, over the same source
        try:  # the same verdict as the full open from disk (the nbytes lie is one it never looked at)
            DDUFArchive(path).close()
            assert code == 0 and edit == "nbytes not its shape"
        except DDUFError:
            assert code == 1 and "I002" in captured.err, captured
    finally:
        path.unlink()


def test_load_of_an_index_lying_about_a_safetensors_header_is_refused(served, tmp_path: Path, monkeypatch) -> None:
    """load_dduf(URL) opens from the one suffix range, then checks every local and safetensors header against
    the index as the bytes that hold them arrive, before any model is built: a swapped tensor shape (same
    size, so the entry's sha256 still matches) is refused by rule I002."""
    from dduf_plus import load_dduf

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online (unset, huggingface_hub's import-time value would decide)
    server, archives = served

    def lie(index: dict) -> None:
        record = _first_2d(index, VAE)
        record["shape"] = record["shape"][::-1]

    path = _rewritten(archives["indexed"], server.root / "lying-header.dduf", lie)
    try:
        with pytest.raises(DDUFError, match="I002") as info:
            load_dduf(server.url(path.name), remote={"cache_dir": str(tmp_path)})
        assert VAE in str(info.value) and "tensor records differ" in str(info.value)
    finally:
        path.unlink()


@pytest.mark.parametrize("name", ["plain", "tiny"])
def test_info_without_an_index_or_whole_in_the_tail_opens_as_before(served, name: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    server, _ = served
    (described, text), gets = _count(server, lambda: _info(server.url(f"{name}.dduf"), capsys))
    assert "from_index" not in described and FROM_INDEX not in text
    assert gets == (2 if name == "tiny" else 2 * 6), server.range_headers  # tiny: whole in the suffix range


def test_tiny_indexed_archive_opens_in_one_request(served, tmp_path: Path, monkeypatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    """An archive shorter than the opening's suffix range comes whole with it: validate, info, DDUFArchive, a
    hosted reference and the fetch behind load_dduf(URL) (all load_dduf sends over the network) send one request
    each (before: the size probe, then the whole file: two)."""
    from dduf_plus.cli import main
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.refs.hosted import hosted_member_records
    from dduf_plus.remote.fetch import fetch_archive

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online (unset, huggingface_hub's import-time value would decide)
    server, archives = served
    url, data = server.url("tiny.dduf"), archives["tiny"].read_bytes()
    calls = {"validate": lambda: validate(url).valid, "info": lambda: main(["info", url, "--json"]) == 0,
             "DDUFArchive": lambda: len(DDUFArchive(url).read_bytes("model_index.json")) > 0,
             "hosted reference": lambda: hosted_member_records(url, "vae") is not None,
             "fetch": lambda: fetch_archive(url, {"cache_dir": str(tmp_path / "fetch")}).read_bytes() == data}
    for what, call in calls.items():
        ok, gets = _count(server, call)
        assert ok and gets == 1 and server.range_headers == [SUFFIX], (what, gets, server.range_headers)
    capsys.readouterr()


@pytest.mark.parametrize("answer", ["200", "416"])
def test_server_without_suffix_ranges_costs_one_request_more(tmp_path: Path, answer: str, monkeypatch) -> None:
    """A server that answers ``bytes=-N`` with 200 (the whole file: its body is not read) or 416 but serves
    ``bytes=a-b``: opening asks ``bytes=0-0`` instead; everything works, one request later than before."""
    from dduf_plus.cli import main
    from dduf_plus.format.pack import pack_folder
    from dduf_plus.remote.fetch import fetch_archive

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online (unset, huggingface_hub's import-time value would decide)
    www = tmp_path / "www"
    www.mkdir()
    path = www / "tiny.dduf"
    pack_folder(PIPELINES / "tiny-dit", path, quiet=True)
    with FileServer(www, suffix=answer) as server:
        url = server.url("tiny.dduf")
        source = HTTPSource(url)
        assert source.size == path.stat().st_size and server.range_headers == [SUFFIX, "bytes=0-0"]
        assert source.bytes_received < 64 << 10  # the 200's headers, and what one socket read held of its body
        source.close()
        report, gets = _count(server, lambda: validate(url))
        assert report.valid and gets == 3, server.range_headers  # suffix, probe, the whole (small) file
        assert main(["info", url]) == 0
        _, gets = _count(server, lambda: fetch_archive(url, {"cache_dir": str(tmp_path / "c")}))
        assert gets >= 3 and server.range_headers[:2] == [SUFFIX, "bytes=0-0"], server.range_headers


def test_a_tight_byte_budget_opens_with_the_one_byte_probe(served) -> None:
    """A caller's fixed byte budget too small for the suffix range (4x its bytes and headers) keeps 0.5.0's
    1-byte probe; a roomier one gets the suffix range, counted against it like any answer."""
    server, archives = served
    url = server.url("indexed.dduf")
    for budget, first in ((1 << 20, "bytes=0-0"), (8 << 20, SUFFIX)):
        server.reset()
        source = HTTPSource(url, max_bytes=budget)
        try:
            assert source.size == archives["indexed"].stat().st_size and server.range_headers == [first]
            assert source._budget.fetched == source.bytes_received <= (2 << 10) + (SUFFIX_BYTES if first == SUFFIX else 1)
        finally:
            source.close()


def test_load_open_is_one_request(served, tmp_path: Path, monkeypatch) -> None:
    """The fetch behind load_dduf(URL): the size and the whole tail (directory and index) in one suffix range
    request; everything else it reads is entry data (headers are checked as those ranges land)."""
    from dduf_plus.remote.fetch import fetch_archive

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online (unset, huggingface_hub's import-time value would decide)
    server, archives = served
    size = archives["indexed"].stat().st_size
    server.reset()
    path = fetch_archive(server.url("indexed.dduf"), {"cache_dir": str(tmp_path)})
    assert path.read_bytes() == archives["indexed"].read_bytes()
    assert server.range_headers[0] == SUFFIX and sum(server.ranges[0]) == size  # was the probe, then the tail
    tail_start = server.ranges[0][0]
    assert all(start + length <= tail_start for start, length in server.ranges[1:])  # nothing of the tail twice


def _loading_corpus(root: Path) -> None:
    generator = ROOT / "fixtures" / "hostile_loading" / "make_hostile_loading.py"
    module_spec = importlib.util.spec_from_file_location("make_hostile_loading", generator)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    (root / "canary").mkdir()
    module.build(root / "www", root / "canary")


# The loading corpus is generated (packing with torch: ~30 s on 2 cores): run with DDUF_SLOW_TESTS=1.
_SLOW = pytest.mark.skipif(not os.environ.get("DDUF_SLOW_TESTS"), reason="set DDUF_SLOW_TESTS=1 (~35 s)")


@pytest.mark.parametrize("corpus", ["hostile", pytest.param("hostile_loading", marks=[pytest.mark.slow, _SLOW])])
def test_every_hostile_archive_gives_the_same_findings_over_http(corpus: str, tmp_path: Path, monkeypatch) -> None:
    """Read by exact ranges (WHOLE_FILE_BELOW 0, a 4 KiB opening suffix: these archives are small enough to be
    read whole otherwise), with the plan and without it: the same findings as from disk. (The loading corpus is
    generated: ~30 s.)"""
    monkeypatch.setattr("dduf_plus.storage.http_range.WHOLE_FILE_BELOW", 0)
    monkeypatch.setattr("dduf_plus.storage.http_range.SUFFIX_BYTES", 4096)
    www = tmp_path / "www"
    if corpus == "hostile":
        shutil.copytree(HOSTILE, www, ignore=shutil.ignore_patterns("*.py", "*.json"))
    else:
        _loading_corpus(tmp_path)
    files = sorted(www.glob("*.dduf"))
    assert len(files) >= (80 if corpus == "hostile" else 19)
    totals = {"plain": 0, "prefetch": 0, "short-tail": 0}
    with FileServer(www) as server:
        for path in files:
            url = server.url(path.name)
            expected = _findings(validate(path))
            ways = {"plain": lambda u=url: validate(_Plain(u)), "prefetch": lambda u=url: validate(u),
                    # a tail guess too short for the directory and index: the plan guesses, reads fall through
                    "short-tail": lambda u=url: validate(PrefetchSource(HTTPSource(u), tail=2048, gap=4096))}
            for how, call in ways.items():
                report, gets = _count(server, call)
                assert _findings(report) == expected, (path.name, how)
                totals[how] += gets
    print(corpus, len(files), "archives, requests:", totals)
    assert totals["prefetch"] * 2 < totals["plain"], totals


class _Counting:
    """An in-memory ByteSource counting its reads."""

    def __init__(self, data: bytes):
        self.data, self.name, self.size, self.bytes_read, self.reads = data, "mem", len(data), 0, 0

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads += 1
        self.bytes_read += length
        return self.data[offset:offset + length]

    def close(self) -> None:
        pass


def test_prefetch_source_merges_bounds_and_falls_through() -> None:
    assert coalesce([(100, 10), (0, 10), (30, 5), (5000, 1)], gap=20) == [(0, 35), (100, 110), (5000, 5001)]
    data = bytes(range(256)) * 4096  # 1 MiB
    inner = _Counting(data)
    source = PrefetchSource(inner, tail=64 << 10, gap=1024, keep=200 << 10)
    assert source.read_at(len(data) - 22, 22) == data[-22:] and inner.reads == 1  # the tail, at once
    assert source.read_at(len(data) - 60_000, 100) == data[-60_000:-59_900] and inner.reads == 1
    assert source.prefetch([(0, 30), (500, 30), (1400, 10), (9000, 10)]) == 2  # gaps under 1 KiB merged
    assert source.read_at(1400, 10) == data[1400:1410] and inner.reads == 3
    assert source.prefetch([(200_000, 150 << 10)]) == 0  # over the memory bound: left to be read on demand
    assert source.read_at(200_000, 10) == data[200_000:200_010] and inner.reads == 4  # read through, exact
    with pytest.raises(Exception, match="outside the file"):
        source.read_at(len(data) - 1, 2)


def test_hostile_archives_opened_from_the_index_serve_only_what_the_full_open_would(tmp_path: Path) -> None:
    """Every hostile archive over HTTP with a 4 KiB opening suffix (so few are whole in it): opened from the index
    or not, the description is the full open's from disk, and each entry read either gives the bytes the full
    open gives or is refused (a local or safetensors header that is not the index's: Z014/I002). An archive the
    full open refuses is never described from its index unless its lie lies in a header that only the first read
    of that entry shows, which then refuses it."""
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.format.describe import describe_archive
    from dduf_plus.remote.indexed import IndexedArchive, open_indexed

    mp = pytest.MonkeyPatch()
    mp.setattr("dduf_plus.storage.http_range.WHOLE_FILE_BELOW", 0)
    mp.setattr("dduf_plus.storage.http_range.SUFFIX_BYTES", 4096)
    www = tmp_path / "www"
    shutil.copytree(HOSTILE, www, ignore=shutil.ignore_patterns("*.py", "*.json"))
    indexed = 0
    try:
        with FileServer(www) as server:
            for path in sorted(www.glob("*.dduf")):
                try:
                    remote = open_indexed(server.url(path.name))
                except DDUFError:
                    continue  # the full open's verdict (the fallback): nothing was described
                with remote:
                    if not isinstance(remote, IndexedArchive):
                        continue
                    indexed += 1
                    refused = 0
                    for name in remote:
                        try:
                            got = remote.read_bytes(name)
                        except DDUFError:
                            refused += 1
                            continue
                        with DDUFArchive(path, check=False) as local:
                            assert got == local.read_bytes(name), (path.name, name)
                    try:
                        with DDUFArchive(path) as local:
                            assert describe_archive(remote) == {**describe_archive(local), "path": remote.path}
                    except DDUFError:
                        assert refused, path.name  # refused from disk: some entry's own read refuses it
    finally:
        mp.undo()
    assert indexed >= 5, indexed
