"""load_dduf(URL): the tiny-sd fixture packed with dduf_plus, served from 127.0.0.1 by tests/servers.FileServer.

Output equal to the local load; a second load is one request (none offline); an interrupted load resumes
and fetches only what was missing; misbehaving servers give a DDUFError within the timeout; requests run
concurrently and components are built while later bytes are still arriving; s3:// through moto's server."""

from __future__ import annotations

import re
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from servers import FileServer, TokenBucket, served_archive  # noqa: E402

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.errors import DDUFError, DDUFIntegrityError, DDUFIOError, DDUFNotFoundError  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.remote import fetch as fetch_module  # noqa: E402
from dduf_plus.remote import sink, transfer  # noqa: E402
from dduf_plus.remote.fetch import fetch_archive  # noqa: E402
from dduf_plus.storage import fd_io  # noqa: E402

SMALL = {"chunk_size": 64 << 10, "timeout": 1.0}  # many pieces from a 1.3 MB archive; stalls cut off fast


def run(pipe) -> np.ndarray:
    return pipe("a photo of a cat", num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def expected(packed) -> np.ndarray:
    """The local load's images: what every URL load must equal exactly."""
    return run(load_dduf(packed["tiny-sd"], torch_dtype=torch.float32))


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for name in ("unet", "vae", "text_encoder")
               for x, y in zip(getattr(a, name).state_dict().values(), getattr(b, name).state_dict().values(),
                               strict=True))


@pytest.fixture
def served(packed, tmp_path, monkeypatch) -> Path:
    """A folder holding tiny-sd.dduf, a private remote cache, online."""
    return served_archive(Path(packed["tiny-sd"]), tmp_path, monkeypatch)


def remote_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache" / "remote").glob("*") if p.is_file())


def test_url_load_equals_local_and_second_load_is_one_request(served, expected, tmp_path, monkeypatch):
    local = served / "tiny-sd.dduf"
    with FileServer(served, latency=0.005) as srv:
        pipe = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32, remote=SMALL)
        first = srv.body_bytes
        assert srv.gets > 10 and first < local.stat().st_size * 1.1  # ranged, nearly every byte once
        assert np.array_equal(run(pipe), expected)
        assert [n for n in remote_files(tmp_path) if n.endswith(".dduf")] and not [
            n for n in remote_files(tmp_path) if n.endswith((".partial", ".progress.json"))]
        srv.reset()
        again = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32)
        assert (srv.gets, srv.heads) == (1, 0)  # the tail only, to confirm the content key
        assert srv.body_bytes < 128 << 10
        assert same_weights(again, pipe)
        srv.reset()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32)
        assert srv.gets + srv.heads == 0  # offline: the URL's record finds the cached file
    with pytest.raises(DDUFNotFoundError, match="not in the remote cache"):
        load_dduf(srv.url("other.dduf"))


def test_interrupted_load_resumes_with_only_the_missing_bytes(served, packed, tmp_path):
    size = (served / "tiny-sd.dduf").stat().st_size
    with FileServer(served, stall_after_total=size // 2) as dying:
        with pytest.raises(DDUFIOError, match=r"sent nothing for 1 s"):
            load_dduf(dying.url("tiny-sd.dduf"), remote=SMALL)
        assert dying.stalls_outlasted == 0  # it gave up on the stalled link: no stall was held to its 60 s
        dying.stop_stalling.set()
    assert any(n.endswith(".progress.json") for n in remote_files(tmp_path))
    with FileServer(served) as srv:  # another port: another URL, the same content key
        pipe = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32, remote=SMALL)
        # About half was here: the rest, plus the size probe, the tail and pieces in flight when it died.
        assert srv.body_bytes < size * 0.5 + 16 * (64 << 10), (srv.body_bytes, size)
    assert same_weights(pipe, load_dduf(packed["tiny-sd"], torch_dtype=torch.float32))
    assert not any(n.endswith((".partial", ".progress.json")) for n in remote_files(tmp_path))


@pytest.mark.parametrize("mode, error, message", [
    ({"ranges": False}, DDUFIOError, "does not support range requests"),
    ({"lie_size": 1000}, DDUFIOError, "Content-Length|Content-Range"),  # the opening's suffix range: the total
    ({"stall_after": 1000}, DDUFIOError, "sent nothing for 1 s"),
    ({"close_after": 1000}, DDUFIOError, "connection closed after"),
])
def test_misbehaving_servers_fail_fast_and_clearly(served, mode, error, message):
    with FileServer(served, **mode) as srv:
        with pytest.raises(error, match=message) as info:
            load_dduf(srv.url("tiny-sd.dduf"), remote=SMALL)
        # fast: no stall held to its end, and no retry loop (the 1.3 MB archive in 64 KiB pieces: ~21 GETs)
        assert srv.stalls_outlasted == 0 and srv.gets + srv.heads <= 24, (srv.gets, srv.heads)
        assert srv.url("tiny-sd.dduf") in str(info.value)
        srv.stop_stalling.set()


def test_a_changed_size_is_refused(served, tmp_path):
    with FileServer(served) as srv:
        url = srv.url("tiny-sd.dduf")
        reader = fetch_module.open_reader(url, fetch_module.RemoteOptions(), size=10)
        with pytest.raises(DDUFIOError, match="now reports a size"):
            reader.read_at(0, 5)
        reader.close()


def test_tampered_entry_is_an_integrity_error(served):
    local = served / "tiny-sd.dduf"
    with DDUFArchive(local) as archive:
        name = "unet/diffusion_pytorch_model-00002-of-00002.safetensors"
        entry = archive.entry(name)
        at = entry.offset + entry.length - 100  # inside the tensor data, not the header
    data = bytearray(local.read_bytes())
    data[at] ^= 0xFF
    (served / "bad.dduf").write_bytes(bytes(data))
    with FileServer(served) as srv:
        with pytest.raises(DDUFIntegrityError, match=r"unet/diffusion_pytorch_model-00002-of-00002.safetensors.*sha256"):
            load_dduf(srv.url("bad.dduf"), remote=SMALL)


def test_requests_overlap_and_construction_overlaps_fetching(served, expected, monkeypatch):
    """A model is built while later pieces are still on their way: the server holds every range in the second
    UNet shard (the middle of the archive) until the first component is built. Events, not times: a loader that
    waited for the whole archive would build nothing until the holds gave up (60 s), and fail here."""
    built: list[str] = []
    first_built = threading.Event()
    holds = {"held": 0, "gave_up": 0}
    original = fetch_module.RemoteFetch.wait_component

    def recording(self, component):
        original(self, component)
        built.append(component)
        first_built.set()

    size = (served / "tiny-sd.dduf").stat().st_size

    def hold_the_middle(method: str, path: str, headers) -> None:
        match = re.fullmatch(r"bytes=(\d+)-\d*", headers.get("Range", ""))
        if match and 0.55 * size <= int(match[1]) < 0.75 * size:
            holds["held"] += 1
            holds["gave_up"] += not first_built.wait(60)

    monkeypatch.setattr(fetch_module.RemoteFetch, "wait_component", recording)
    with FileServer(served, on_request=hold_the_middle) as srv:
        srv.bucket = TokenBucket(size / 6, burst=32 << 10)  # bodies take a while: several are sent at once
        load_dduf(srv.url("tiny-sd.dduf"), remote={"chunk_size": 64 << 10, "concurrency": 8})
        assert srv.max_in_flight >= 4  # several range requests at once
    assert holds["held"] >= 1 and holds["gave_up"] == 0, holds
    assert len(built) >= 4, built


def test_fetch_archive_is_torch_free_and_complete(served, tmp_path):
    with FileServer(served) as srv:
        path = fetch_archive(srv.url("tiny-sd.dduf"), {"concurrency": 4, "chunk_size": 128 << 10})
    assert path.read_bytes() == (served / "tiny-sd.dduf").read_bytes()
    assert path.parent == tmp_path / "cache" / "remote"


def test_bad_options_are_usage_errors(served):
    with pytest.raises(DDUFError, match="concurrency"):
        fetch_archive("http://127.0.0.1:9/x.dduf", {"concurrency": 0})
    with pytest.raises(DDUFError, match="unknown options"):
        fetch_archive("http://127.0.0.1:9/x.dduf", {"threads": 4})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_through_moto_server(served, expected, monkeypatch):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (it comes with moto)")

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._port}"
        for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="bucket")
        s3.upload_file(str(served / "tiny-sd.dduf"), "bucket", "x.dduf")
        options = {"storage_options": {"client_kwargs": {"endpoint_url": endpoint}}, "chunk_size": 256 << 10}
        pipe = load_dduf("s3://bucket/x.dduf", torch_dtype=torch.float32, remote=options)
        assert np.array_equal(run(pipe), expected)
    finally:
        server.stop()


def test_archive_without_index_is_crc_checked(served, packed, tmp_path):
    """huggingface_hub's writer records no dduf_plus index: the fetch checks every entry's CRC-32 instead."""
    from huggingface_hub import export_folder_as_dduf

    plain = served / "hub.dduf"
    export_folder_as_dduf(plain, Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd")
    with FileServer(served) as srv:
        path = fetch_archive(srv.url("hub.dduf"), SMALL)
        assert path.read_bytes() == plain.read_bytes()
        with DDUFArchive(plain) as archive:
            entry = archive.entry("vae/diffusion_pytorch_model.safetensors")
        data = bytearray(plain.read_bytes())
        data[entry.offset + entry.length - 10] ^= 0xFF
        (served / "hub-bad.dduf").write_bytes(bytes(data))
        # (Without an index the key is bound to the URL: hub-bad.dduf never reuses hub.dduf's file, same tail or not.)
        with pytest.raises(DDUFIntegrityError, match=r"vae/diffusion_pytorch_model.safetensors.*CRC-32"):
            fetch_archive(srv.url("hub-bad.dduf"), SMALL)


# --- where the bytes land: memory written behind the load, or memory only (cache=False) ------------------------------
def _tampered(served: Path) -> str:
    """bad.dduf: tiny-sd with one byte of UNet tensor data flipped (its index sha256 no longer matches)."""
    local = served / "tiny-sd.dduf"
    with DDUFArchive(local) as archive:
        entry = archive.entry("unet/diffusion_pytorch_model-00002-of-00002.safetensors")
    data = bytearray(local.read_bytes())
    data[entry.offset + entry.length - 100] ^= 0xFF
    (served / "bad.dduf").write_bytes(bytes(data))
    return "bad.dduf"


def test_cache_false_keeps_nothing_and_verifies_every_byte(served, packed, tmp_path):
    """Before: no ``cache`` option (an unknown option was a usage error) and every load wrote the cache."""
    with FileServer(served) as srv:
        pipe = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32, remote={**SMALL, "cache": False})
        # no cache file, progress or URL record (tokenizer files are materialised in cache/files/ as for any load)
        assert not (tmp_path / "cache" / "remote").exists()
        srv.reset()
        load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32, remote={**SMALL, "cache": False})
        assert srv.body_bytes >= (served / "tiny-sd.dduf").stat().st_size  # nothing was kept: fetched again
        with pytest.raises(DDUFIntegrityError, match=r"unet/diffusion_pytorch_model-00002.*sha256"):
            load_dduf(srv.url(_tampered(served)), remote={**SMALL, "cache": False})
        with pytest.raises(DDUFError, match="cache=False keeps nothing"):
            fetch_archive(srv.url("tiny-sd.dduf"), {"cache": False})
    assert same_weights(pipe, load_dduf(packed["tiny-sd"], torch_dtype=torch.float32))
    assert not (tmp_path / "cache" / "remote").exists()


def test_write_behind_load_does_not_wait_for_the_disk(served, packed, tmp_path, monkeypatch):
    """A disk slower than the link: the load returns from memory while the cache file is still being written;
    the file completes behind it, and the next load uses it (one request)."""
    monkeypatch.setattr(sink, "WRITE_BEHIND_MIN", 0)  # tiny-sd is served from memory too
    for module in (sink, transfer):  # wherever pytest's tmp_path lives
        monkeypatch.setattr(module, "in_ram", lambda folder: False)
    slow_disk, copy = __import__("threading").Event(), fd_io.copy_range

    def slow_copy(src, dst, start, end):
        slow_disk.wait(10)  # the disk has not written anything yet
        copy(src, dst, start, end)

    monkeypatch.setattr(transfer, "copy_range", slow_copy)
    with FileServer(served) as srv:
        pipe = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32, remote={**SMALL, "memory_max": 1 << 30})
        assert any(n.endswith(".partial") for n in remote_files(tmp_path))  # nothing written yet: loaded anyway
        assert same_weights(pipe, load_dduf(packed["tiny-sd"], torch_dtype=torch.float32))
        slow_disk.set()
        fetch_module.wait_cache_writes()
        files = remote_files(tmp_path)
        assert [n for n in files if n.endswith(".dduf")] and not [n for n in files if n.endswith((".partial", ".progress.json"))]
        cached = next((tmp_path / "cache" / "remote").glob("*.dduf"))
        assert cached.read_bytes() == (served / "tiny-sd.dduf").read_bytes()
        srv.reset()
        again = load_dduf(srv.url("tiny-sd.dduf"), torch_dtype=torch.float32)
        assert srv.gets == 1 and same_weights(again, pipe)
        # Integrity as before: a tampered entry is refused, and no cache file claims it. (Its tail is the
        # original's, so its content key too: another cache, or the verified original would be used.)
        other = tmp_path / "other"
        with pytest.raises(DDUFIntegrityError, match=r"unet/diffusion_pytorch_model-00002.*sha256"):
            load_dduf(srv.url(_tampered(served)), remote={**SMALL, "cache_dir": str(other), "memory_max": 1 << 30})
        fetch_module.wait_cache_writes()
    assert not list(other.glob("*.dduf"))


def test_a_mismatching_entry_reaches_the_caller_as_a_public_integrity_error() -> None:
    """The fetch's private mismatch kind (it only decides what a resume keeps) is never what a caller catches
    or what an error line names."""
    from dduf_plus.errors import DDUFIntegrityError
    from dduf_plus.remote import entries

    raised = entries.public_error(entries.EntryMismatch("u: entry 'unet/x' does not match its sha256"))
    assert type(raised) is DDUFIntegrityError and "unet/x" in str(raised)
