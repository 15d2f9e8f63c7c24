"""What identifies a fetched archive in the remote cache, and what a fetch may build and leave on disk
(issue 18, items 1, 3 and 4).

1. Two loopback servers serve archives with equal tails (end records, central directory, index) whose
   entries differ, the attacker's entry CRC-32 forced back to the official value with a 4-byte patch. Fetching
   the attacker's URL first, then the official one (same process, a new process, after an interrupted
   attacker fetch, offline with a record left by an older dduf_plus) must give the official bytes. Only an
   archive whose index pins every entry by sha256 shares its cache file between URLs.
2. A component is built only over bytes that have arrived and matched: one delayed range, no index.
3. The tail is checked before anything is preallocated; free disk; refused archives leave nothing; an
   interrupted fetch keeps only the bytes that arrived, within $DDUF_PLUS_REMOTE_PARTIALS_MAX."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import FileServer  # noqa: E402

from dduf_plus.errors import (  # noqa: E402
    DDUFIntegrityError,
    DDUFIOError,
    DDUFNotFoundError,
    DDUFUsageError,
    DDUFValidationError,
)
from dduf_plus.format import spec, zipfmt  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.remote import (
    cache_records,  # noqa: E402
    partials,  # noqa: E402
)
from dduf_plus.remote import fetch as fetch_module  # noqa: E402
from dduf_plus.remote.fetch import cached_sha256, fetch_archive, open_remote  # noqa: E402
from dduf_plus.remote.tail import content_key  # noqa: E402
from dduf_plus.storage.http_range import SUFFIX_BYTES  # noqa: E402

SMALL = {"chunk_size": 64 << 10, "timeout": 1.0}
STALL = {"chunk_size": 64 << 10, "timeout": 0.4}  # servers that stall on purpose: cut off fast
VICTIM = "unet/diffusion_pytorch_model-00002-of-00002.safetensors"
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"


# --- forging ----------------------------------------------------------------------------------------------------
def force_crc32(data: bytearray, at: int, target: int) -> None:
    """Set ``data[at:at+4]`` so that ``zlib.crc32(data) == target``: CRC-32 is affine in the message bits,
    so the 32 bits of a 4-byte window solve a 32x32 linear system over GF(2)."""
    data[at:at + 4] = bytes(4)
    base = zlib.crc32(data)
    pivots: dict[int, tuple[int, int]] = {}  # highest bit -> (CRC difference, window bits)
    for bit in range(32):
        data[at + bit // 8] ^= 1 << (bit % 8)
        vec, mask = zlib.crc32(data) ^ base, 1 << bit
        data[at + bit // 8] ^= 1 << (bit % 8)
        while vec:
            top = vec.bit_length() - 1
            if top not in pivots:
                pivots[top] = (vec, mask)
                break
            vec, mask = vec ^ pivots[top][0], mask ^ pivots[top][1]
    want, flips = base ^ target, 0
    while want:
        vec, mask = pivots[want.bit_length() - 1]
        want, flips = want ^ vec, flips ^ mask
    for bit in range(32):
        if flips >> bit & 1:
            data[at + bit // 8] ^= 1 << (bit % 8)
    assert zlib.crc32(data) == target


def forge(official: bytes, name: str = VICTIM) -> bytes:
    """The attacker's archive: the first 8 KiB of ``name``'s tensor data replaced, its CRC-32 forced back."""
    with DDUFArchive(_Bytes(official), check=False) as archive:
        entry, header = archive.entry(name), archive.headers[name]
    data = bytearray(official[entry.offset:entry.offset + entry.length])
    data[header.data_start:header.data_start + 8192] = b"\x7b" * 8192
    force_crc32(data, header.data_start + 100, entry.crc32)
    out = bytearray(official)
    out[entry.offset:entry.offset + entry.length] = data
    assert out != official and len(out) == len(official)
    return bytes(out)


class _Bytes:
    """A ByteSource over bytes in memory (to read an archive being forged without writing it)."""

    def __init__(self, data: bytes):
        self.name, self.size, self.data, self.bytes_read = "<bytes>", len(data), data, 0

    def read_at(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]

    def close(self) -> None:
        pass


def rewrite_index(archive: bytes, change) -> bytes:
    """``archive`` with its dduf_plus index changed by ``change(index)``, padded to the same length (JSON
    allows trailing spaces) and its CRC-32 updated in the local header and the central directory."""
    with DDUFArchive(_Bytes(archive), check=False) as opened:
        entry = opened.entry(spec.INDEX_NAME)
        cd_offset, header_offset = opened.layout.cd_offset, next(
            e.header_offset for e in opened.layout.entries if e.name == spec.INDEX_NAME)
    index = json.loads(archive[entry.offset:entry.offset + entry.length])
    change(index)
    raw = json.dumps(index, separators=(",", ":")).encode()
    assert len(raw) <= entry.length
    raw += b" " * (entry.length - len(raw))
    out = bytearray(archive)
    out[entry.offset:entry.offset + entry.length] = raw
    crc = struct.pack("<I", zlib.crc32(raw))
    out[header_offset + 14:header_offset + 18] = crc
    at = cd_offset
    while True:  # the index's central record
        nlen, xlen, clen = struct.unpack_from("<HHH", out, at + 28)
        if out[at + 46:at + 46 + nlen] == spec.INDEX_NAME.encode():
            out[at + 16:at + 20] = crc
            return bytes(out)
        at += 46 + nlen + xlen + clen


def drop_record(name: str):
    return lambda index: index["files"].pop(name)


def drop_sha(name: str):
    return lambda index: index["files"][name].update(sha256=None)


def drop_unet_sha(index: dict) -> None:
    for name, record in index["files"].items():
        if name.startswith("unet/"):
            record["sha256"] = None


# --- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub_bytes(tmp_path_factory) -> bytes:
    """tiny-sd written by huggingface_hub's export_folder_as_dduf: no dduf_plus index (every DDUF/* archive)."""
    from huggingface_hub import export_folder_as_dduf

    path = tmp_path_factory.mktemp("hub") / "hub.dduf"
    export_folder_as_dduf(path, FIXTURE)
    return path.read_bytes()


@pytest.fixture(scope="module")
def indexed_bytes(packed) -> bytes:
    return Path(packed["tiny-sd"]).read_bytes()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return tmp_path / "cache" / "remote"


def serve(tmp_path: Path, name: str, data: bytes) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "m.dduf").write_bytes(data)
    return folder


def official_and_forged(variant: str, hub_bytes: bytes, indexed_bytes: bytes) -> tuple[bytes, bytes]:
    official = {"no-index": hub_bytes,
                "index-missing-entry": rewrite_index(indexed_bytes, drop_record(VICTIM)),
                "index-without-sha256": rewrite_index(indexed_bytes, drop_sha(VICTIM))}[variant]
    return official, forge(official)


VARIANTS = ["no-index", "index-missing-entry", "index-without-sha256"]


# --- 1. cache identity ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_attacker_url_first_never_serves_the_official_url(variant, hub_bytes, indexed_bytes, tmp_path):
    """Before: the second fetch made 2 requests to the official server and returned the attacker's bytes."""
    official, forged = official_and_forged(variant, hub_bytes, indexed_bytes)
    with FileServer(serve(tmp_path, "a", forged)) as attacker, FileServer(serve(tmp_path, "o", official)) as srv:
        assert fetch_archive(attacker.url("m.dduf"), SMALL).read_bytes() == forged  # its own bytes, CRC-valid
        got = fetch_archive(srv.url("m.dduf"), SMALL)
        assert got.read_bytes() == official
        assert srv.body_bytes >= len(official)  # fetched from the official server, not taken from the cache
        # The official URL's cache file records the sha256 of every entry as fetched and checked.
        with DDUFArchive(got, check=False) as archive:  # (a partial index: I002, refused when loaded)
            assert cached_sha256(got) == {n: hashlib.sha256(archive.view(n)).hexdigest() for n in archive.entries}
        srv.reset()  # a second load of the same URL: the tail only, the same (official) file
        assert fetch_archive(srv.url("m.dduf"), SMALL) == got and srv.gets == 1


def test_new_process_gets_the_official_bytes(hub_bytes, tmp_path):
    official, forged = hub_bytes, forge(hub_bytes)
    with FileServer(serve(tmp_path, "a", forged)) as attacker, FileServer(serve(tmp_path, "o", official)) as srv:
        fetch_archive(attacker.url("m.dduf"), SMALL)
        code = "import sys; from dduf_plus.remote.fetch import fetch_archive; print(fetch_archive(sys.argv[1]))"
        out = subprocess.run([sys.executable, "-c", code, srv.url("m.dduf")], capture_output=True, text=True,
                             env=os.environ, timeout=120)
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()).read_bytes() == official
        assert srv.body_bytes >= len(official)


@pytest.mark.parametrize("variant", ["no-index", "index-without-sha256"])
def test_a_resumed_partial_is_never_taken_from_another_url(variant, hub_bytes, indexed_bytes, tmp_path, private_cache):
    """Before: the official fetch resumed the attacker's interrupted partial (same key) and kept its bytes."""
    official, forged = official_and_forged(variant, hub_bytes, indexed_bytes)
    with FileServer(serve(tmp_path, "a", forged), stall_after_total=len(forged) - (64 << 10)) as attacker:
        with pytest.raises(DDUFIOError):  # one connection: concurrent answers could overshoot the stall point
            fetch_archive(attacker.url("m.dduf"), {**SMALL, "concurrency": 1})
        attacker.stop_stalling.set()
    assert list(private_cache.glob("*.dduf.partial"))  # the attacker's fetch is resumable (from its URL)
    with FileServer(serve(tmp_path, "o", official)) as srv:
        assert fetch_archive(srv.url("m.dduf"), SMALL).read_bytes() == official
        assert srv.body_bytes >= len(official)


def test_a_resume_from_the_same_url_fetches_only_what_is_missing(hub_bytes, tmp_path):
    folder = serve(tmp_path, "o", hub_bytes)
    with FileServer(folder, stall_after_total=len(hub_bytes) // 2) as dying:
        with pytest.raises(DDUFIOError):
            fetch_archive(dying.url("m.dduf"), SMALL)
        dying.stop_stalling.set()
        url = dying.url("m.dduf")
        dying.stall_after_total = None
        dying.reset()
        assert fetch_archive(url, SMALL).read_bytes() == hub_bytes
        assert dying.body_bytes < len(hub_bytes) * 0.5 + 16 * (64 << 10)


def test_full_index_is_shared_between_urls_and_a_forged_entry_is_refused(indexed_bytes, tmp_path):
    """Every entry pinned by sha256: equal tails mean equal archives, one cache file for every URL; a forged
    CRC-32 does not get past the sha256."""
    forged = forge(indexed_bytes)
    with FileServer(serve(tmp_path, "a", forged)) as attacker, FileServer(serve(tmp_path, "o", indexed_bytes)) as srv, \
            FileServer(serve(tmp_path, "m", indexed_bytes)) as mirror:
        with pytest.raises(DDUFIntegrityError, match=r"unet/diffusion_pytorch_model-00002-of-00002.*sha256"):
            fetch_archive(attacker.url("m.dduf"), SMALL)
        first = fetch_archive(srv.url("m.dduf"), SMALL)
        assert first.read_bytes() == indexed_bytes
        assert fetch_archive(mirror.url("m.dduf"), SMALL) == first
        # one request (the tail, as the opening's suffix range): same key, verified file
        assert mirror.gets == 1 and mirror.body_bytes < SUFFIX_BYTES + (44 << 10)


def test_offline_record_of_an_older_version_finds_nothing(hub_bytes, tmp_path, private_cache):
    """An older dduf_plus keyed index-less archives by size + tail only, and may have cached the attacker's
    bytes under the key the official URL's record names: offline, that file is not returned."""
    forged = forge(hub_bytes)
    with FileServer(serve(tmp_path, "o", hub_bytes)) as srv:
        url = srv.url("m.dduf")
        fetch_archive(url, SMALL)
    record_path = cache_records.url_record(fetch_module.Confined(private_cache), url)
    record = json.loads(record_path.read_text())
    tail = hub_bytes[record["tail_start"]:]
    old_key = content_key(len(hub_bytes), tail)
    (private_cache / f"{old_key}.dduf").write_bytes(forged)
    record_path.write_text(json.dumps({**record, "key": old_key}))
    with pytest.raises(DDUFNotFoundError, match="not in the remote cache"):
        open_remote(url, local_files_only=True)
    record_path.write_text(json.dumps(record))  # the record this version wrote: found, no request
    assert Path(open_remote(url, local_files_only=True)).read_bytes() == hub_bytes


def test_load_dduf_attacker_first_then_official(hub_bytes, tmp_path):
    torch = pytest.importorskip("torch")
    from dduf_plus import load_dduf

    forged = forge(hub_bytes)
    with FileServer(serve(tmp_path, "a", forged)) as attacker, FileServer(serve(tmp_path, "o", hub_bytes)) as srv:
        bad = load_dduf(attacker.url("m.dduf"), remote=SMALL).unet.state_dict()
        good = load_dduf(srv.url("m.dduf"), remote=SMALL).unet.state_dict()
    (tmp_path / "official.dduf").write_bytes(hub_bytes)
    with DDUFArchive(tmp_path / "official.dduf") as archive:
        want = {name: tensor.clone() for name, tensor in archive.tensors("unet").items()}
    assert set(good) == set(want) and all(torch.equal(good[n], want[n]) for n in want)
    assert not all(torch.equal(bad[n], want[n]) for n in want)  # the attacker's load did get its own weights


# --- 2. nothing built before its bytes arrived and matched ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["no-index", "index-without-sha256"])
def test_components_wait_for_a_delayed_range(variant, hub_bytes, indexed_bytes, tmp_path, monkeypatch):
    """Before: without an index the loader waited for no entry and built the UNet over the zero-filled file."""
    torch = pytest.importorskip("torch")
    from dduf_plus import load_dduf

    official = hub_bytes if variant == "no-index" else rewrite_index(indexed_bytes, drop_unet_sha)
    local = tmp_path / "local.dduf"
    local.write_bytes(official)
    with DDUFArchive(local, check=False) as archive:
        entries = {n: (e.offset, e.length) for n, e in archive.entries.items()}
    # Tensor data of a UNet shard, past its safetensors header (opening reads that) and before the tail (the
    # first request brings the last 256 KiB).
    late = min(at + n // 2 for name, (at, n) in entries.items() if name.startswith("unet/")
               and name.endswith(".safetensors") and at + n // 2 < len(official) - (300 << 10))
    delayed = threading.Event()

    def on_request(method, path, headers):
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", headers.get("Range", ""))
        if match and int(match[1]) <= late <= int(match[2]) and int(match[2]) - int(match[1]) < 64 << 10:
            delayed.set()
            time.sleep(0.8)  # within the 1 s timeout

    seen: dict[str, bool] = {}
    original = fetch_module.RemoteFetch.wait_component

    def checking(self, component):
        original(self, component)
        # what the component's tensors view, right now (the fetch's fd: the cache file or the memory it is
        # written from)
        seen[component] = all(os.pread(self.fd, n, at) == official[at:at + n]
                              for name, (at, n) in entries.items() if name.startswith(component + "/"))

    monkeypatch.setattr(fetch_module.RemoteFetch, "wait_component", checking)
    with FileServer(serve(tmp_path, "o", official), on_request=on_request) as srv:
        pipe = load_dduf(srv.url("m.dduf"), torch_dtype=torch.float32, remote=SMALL)
    assert delayed.is_set() and seen.get("unet") is True and all(seen.values()), seen
    want = load_dduf(local, torch_dtype=torch.float32)
    for a, b in zip(pipe.unet.state_dict().values(), want.unet.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# --- 3. preallocation on the archive's word, within the disk rules --------------------------------------------------
def write_zip(path: Path, entries: list[tuple[str, int, bytes | None]], *, method: int = 0,
              header_offsets: list[int] | None = None, gap: int = 0) -> None:
    """A ZIP of ``(name, size, data or None for sparse zeros)`` entries with dduf_plus' ZIP64 records; ``method``
    and ``header_offsets`` let a test break the central directory."""
    cd, at = b"", 0
    with open(path, "wb") as f:
        for i, (name, size, data) in enumerate(entries):
            raw = name.encode()
            # (Past 256 MiB the CRC is left 0: such entries are refused from the tail, before any data.)
            crc = zlib.crc32(data) if data is not None else _zeros_crc(size) if size <= 256 << 20 else 0
            head = zipfmt.local_header(raw, size, crc, 0)
            f.seek(at)
            f.write(head)
            if data is not None:
                f.write(data)
            record = zipfmt.central_header(raw, size, crc, header_offsets[i] if header_offsets else at)
            cd += record[:10] + struct.pack("<H", method) + record[12:]
            at += len(head) + size + gap
        f.seek(at)
        f.write(cd)
        n, cd_size = len(entries), len(cd)
        f.write(struct.pack(spec.EOCD64_FMT, spec.SIG_EOCD64, 44, 45, 45, 0, 0, n, n, cd_size, at)
                + struct.pack(spec.LOCATOR_FMT, spec.SIG_EOCD64_LOCATOR, 0, at + cd_size, 1)
                + struct.pack(spec.EOCD_FMT, spec.SIG_EOCD, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))


def _zeros_crc(size: int) -> int:
    crc, block = 0, bytes(1 << 20)
    while size:
        n = min(size, len(block))
        crc, size = zlib.crc32(block[:n], crc), size - n
    return crc


MODEL_INDEX = json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}).encode()
WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*") if p.is_file()) if cache.is_dir() else []


@pytest.mark.parametrize("case, code", [
    ("no-model-index", "D001"),  # 2 GiB claimed, 262 KB answered: before, 2 GiB preallocated and kept
    ("foreign-bytes", "Z016"),  # a 1 KB directory entry in a 2 GiB file
    ("compressed", "Z011"),
    ("overlap", "Z015"),
    ("not-a-zip", "Z001"),
])
def test_a_refused_tail_preallocates_nothing(case, code, tmp_path, private_cache):
    folder = tmp_path / "www"
    folder.mkdir()
    path = folder / "x.dduf"
    big = 2 << 30
    if case == "no-model-index":
        write_zip(path, [("junk.bin", big, None)])
    elif case == "foreign-bytes":
        write_zip(path, [(spec.MODEL_INDEX, len(MODEL_INDEX), MODEL_INDEX)], gap=big)
    elif case == "compressed":
        write_zip(path, [(spec.MODEL_INDEX, len(MODEL_INDEX), MODEL_INDEX), (WEIGHTS, big, None)], method=8)
    elif case == "overlap":
        write_zip(path, [(spec.MODEL_INDEX, len(MODEL_INDEX), MODEL_INDEX), (WEIGHTS, big, None)],
                  header_offsets=[0, 10])
    else:
        with open(path, "wb") as f:
            f.truncate(big)
    with FileServer(folder) as srv:
        with pytest.raises(DDUFValidationError, match=code):
            fetch_archive(srv.url("x.dduf"), SMALL)
        assert srv.body_bytes <= SUFFIX_BYTES + (44 << 10)  # the opening's suffix range, nothing more
    assert not [n for n in cache_files(private_cache) if not n.endswith(".json")]


def test_an_archive_refused_once_opened_leaves_no_partial(tmp_path, private_cache):
    """The tail is sound but model_index.json is not JSON (D002): load_dduf refuses it after the fetch
    began. Before: the preallocated partial stayed (64 MiB here)."""
    pytest.importorskip("torch")
    from dduf_plus import load_dduf

    folder = tmp_path / "www"
    folder.mkdir()
    write_zip(folder / "x.dduf", [(spec.MODEL_INDEX, 20, b"{not json at all ..."), (WEIGHTS, 64 << 20, None)])
    with FileServer(folder, latency=0.05) as srv:
        with pytest.raises(DDUFValidationError, match="D002"):
            load_dduf(srv.url("x.dduf"), remote=SMALL)
    time.sleep(0.3)  # a worker still finishing its request must not bring a progress record back
    assert not [n for n in cache_files(private_cache) if n.endswith((".partial", ".progress.json"))]
    assert sum(partials.allocated(p) for p in private_cache.glob("*")) < 1 << 20


def test_no_preallocation_past_the_free_disk(hub_bytes, tmp_path, private_cache, monkeypatch):
    monkeypatch.setattr(partials._zst, "free_bytes", lambda folder: len(hub_bytes) // 2)
    with FileServer(serve(tmp_path, "o", hub_bytes)) as srv:
        with pytest.raises(DDUFIOError, match=r"free \(keeping 256\.0 MiB spare\)"):
            fetch_archive(srv.url("m.dduf"), SMALL)
        assert srv.gets == 1  # the tail (the opening's suffix range: it gives the size too)
    assert not list(private_cache.glob("*.partial"))


def _stalled(tmp_path: Path, name: str, size: int = 64 << 20) -> str:
    folder = tmp_path / name
    folder.mkdir()
    write_zip(folder / "x.dduf", [(spec.MODEL_INDEX, len(MODEL_INDEX), MODEL_INDEX), (WEIGHTS, size, None)])
    return str(folder)


def test_an_interrupted_fetch_keeps_only_what_arrived(tmp_path, private_cache):
    """64 MiB announced, 1 MiB sent, then a stall: the kept partial holds about what arrived, not 64 MiB."""
    with FileServer(_stalled(tmp_path, "www"), stall_after_total=1 << 20) as srv:
        with pytest.raises(DDUFIOError, match="sent nothing"):
            fetch_archive(srv.url("x.dduf"), STALL)
        srv.stop_stalling.set()
    (partial,) = private_cache.glob("*.dduf.partial")
    assert partial.stat().st_size == (tmp_path / "www" / "x.dduf").stat().st_size  # resumable
    if not sys.platform.startswith("linux"):
        pytest.skip("releasing preallocated blocks is Linux-only")
    assert partials.allocated(partial) < 8 << 20, partials.allocated(partial)


def test_kept_partials_fit_their_budget(tmp_path, private_cache, monkeypatch):
    monkeypatch.setattr(partials, "IDLE_S", 0.0)
    monkeypatch.setenv(partials.PARTIALS_ENV, "3M")
    kept = []
    for name in ("one", "two"):
        with FileServer(_stalled(tmp_path, name), stall_after_total=2 << 20) as srv:
            with pytest.raises(DDUFIOError):
                fetch_archive(srv.url("x.dduf"), STALL)
            srv.stop_stalling.set()
        kept.append(sorted(private_cache.glob("*.dduf.partial")))
        time.sleep(0.05)
    assert len(kept[0]) == 1 and len(kept[1]) == 1 and kept[0] != kept[1]  # the older one made room
    assert not [p for p in private_cache.glob("*.progress.json")
                if not p.with_name(p.name.replace(".progress.json", ".dduf.partial")).exists()]
    monkeypatch.setenv(partials.PARTIALS_ENV, "0")  # keep none
    with FileServer(_stalled(tmp_path, "three"), stall_after_total=1 << 20) as srv:
        with pytest.raises(DDUFIOError):
            fetch_archive(srv.url("x.dduf"), STALL)
        srv.stop_stalling.set()
    assert not list(private_cache.glob("*.dduf.partial"))
    monkeypatch.setenv(partials.PARTIALS_ENV, "lots")
    with pytest.raises(DDUFUsageError, match=partials.PARTIALS_ENV):
        partials.partials_budget()
