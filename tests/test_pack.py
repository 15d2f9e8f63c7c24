"""The writer: byte-faithful, aligned, deterministic, atomic; refuses what DDUF forbids."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from conftest import FIXTURE_NAMES, PIPELINES
from dduf_plus.errors import DDUFPackError
from dduf_plus.format import spec
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import pack_folder, plan_folder
from dduf_plus.format.writer import DDUFWriter
from dduf_plus.format.zipfmt import parse_extra


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_entries_are_byte_identical_to_sources(packed, name):
    with DDUFArchive(packed[name]) as archive:
        for entry in archive.entries.values():
            if entry.name == spec.INDEX_NAME:
                continue
            source = PIPELINES / name / entry.name
            assert bytes(archive.view(entry.name)) == source.read_bytes(), entry.name
            assert entry.sha256 == sha256(source), entry.name


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tensor_data_is_page_aligned_and_other_entries_64(packed, name):
    with DDUFArchive(packed[name]) as archive:
        assert archive.headers, "fixture has safetensors entries"
        for entry in archive.entries.values():
            header = archive.headers.get(entry.name)
            if header is not None:
                assert (entry.offset + header.data_start) % 4096 == 0, entry.name
            else:
                assert entry.offset % 64 == 0, entry.name
        assert not [f for f in archive.findings if f.severity == "error"]
        assert not [f for f in archive.findings if f.code in ("S008", "S009", "Z018", "I003")]


def test_layout_order_timestamps_zip64(packed):
    path = packed["tiny-sd"]
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert infos[0].filename == "model_index.json"
        assert infos[-1].filename == spec.INDEX_NAME
        middle = [i.filename for i in infos[1:-1]]
        assert middle == sorted(middle)
        for info in infos:
            assert info.compress_type == zipfile.ZIP_STORED
            assert info.date_time == (1980, 1, 1, 0, 0, 0)
            assert spec.EXTRA_ZIP64 in parse_extra(info.extra)  # central record
        assert zf.testzip() is None
    raw = path.read_bytes()
    # local headers carry a ZIP64 extra too, and the archive ends with ZIP64 end records
    for info in infos:
        nlen, xlen = struct.unpack_from("<HH", raw, info.header_offset + 26)
        local_extra = raw[info.header_offset + 30 + nlen : info.header_offset + 30 + nlen + xlen]
        assert spec.EXTRA_ZIP64 in parse_extra(local_extra)
    assert raw[-22:-18] == struct.pack("<I", spec.SIG_EOCD)
    assert raw[-42:-38] == struct.pack("<I", spec.SIG_EOCD64_LOCATOR)


def test_deterministic_bytes(tmp_path):
    a = pack_folder(PIPELINES / "tiny-sd", tmp_path / "a.dduf", quiet=True).path
    b = pack_folder(PIPELINES / "tiny-sd", tmp_path / "b.dduf", quiet=True).path
    assert a.read_bytes() == b.read_bytes()


def test_index_records_files_tensors_and_summaries(packed):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        index = archive.stored_index
        assert index["format"] == spec.INDEX_FORMAT and index["format_version"] == 1
        unet = index["components"]["unet"]
        assert (unet["library"], unet["class"]) == ("diffusers", "UNet2DConditionModel")
        assert unet["summary"]["dtype"] == "float16"
        assert set(unet["summary"]["dtypes"]) == {"float16"}
        assert unet["summary"]["parameters"] > 0
        assert index["components"]["text_encoder"]["summary"]["dtype"] == "float32"
        assert index["components"]["safety_checker"] == {"library": None, "class": None}
        rec = index["files"]["unet/diffusion_pytorch_model-00001-of-00002.safetensors"]
        entry = archive.entry("unet/diffusion_pytorch_model-00001-of-00002.safetensors")
        assert rec["offset"] == entry.offset and rec["size"] == entry.length
        some_name, tensor = next(iter(rec["tensors"].items()))
        assert tensor["offset"] >= rec["tensor_data_offset"]
        assert bytes(archive.mmap[tensor["offset"] : tensor["offset"] + tensor["nbytes"]]) == bytes(
            archive.tensors("unet")[some_name].contiguous().view(-1).view(__import__("torch").uint8).numpy()
        )


def test_variant_selection(tmp_path):
    default = pack_folder(PIPELINES / "tiny-sd", tmp_path / "d.dduf", quiet=True)
    fp16 = pack_folder(PIPELINES / "tiny-sd", tmp_path / "v.dduf", variant="fp16", quiet=True)
    with DDUFArchive(default.path) as a:
        assert "vae/diffusion_pytorch_model.safetensors" in a and "vae/diffusion_pytorch_model.fp16.safetensors" not in a
    with DDUFArchive(fp16.path) as a:
        assert "vae/diffusion_pytorch_model.fp16.safetensors" in a and "vae/diffusion_pytorch_model.safetensors" not in a
        assert a.stored_index["components"]["vae"]["summary"]["dtype"] == "float16"
        # components without the variant keep their default weights
        assert "unet/diffusion_pytorch_model-00001-of-00002.safetensors" in a
    assert any(s.path == "vae/diffusion_pytorch_model.fp16.safetensors" for s in default.skipped)


def test_reports_skipped_files(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(PIPELINES / "tiny-sd", src)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / "unet" / "preview.png").write_bytes(b"\x89PNG")
    (src / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    (src / "stray").mkdir()
    (src / "stray" / "x.json").write_text("{}")
    skipped = {s.path: s.reason for s in plan_folder(src).skipped}
    assert "README.md" in skipped and ".gitattributes" in skipped
    assert "unet/preview.png" in skipped and "pickle" in skipped["unet/diffusion_pytorch_model.bin"]
    assert "stray/" in skipped


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src"
    shutil.copytree(PIPELINES / "tiny-sd", path)
    return path


def test_refuses_subfolder(src, tmp_path):
    (src / "unet" / "nested").mkdir()
    with pytest.raises(DDUFPackError, match=r"unet/nested.*sub-folders"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)


def test_refuses_pickle_only_weights(src, tmp_path):
    for f in (src / "vae").glob("*.safetensors"):
        f.unlink()
    (src / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(DDUFPackError, match=r"vae/diffusion_pytorch_model.bin.*pickle"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)


def test_refuses_non_utf8_name(src, tmp_path):
    os.close(os.open(os.fsencode(src / "unet") + b"/bad\xff.json", os.O_CREAT | os.O_WRONLY))
    with pytest.raises(DDUFPackError, match="not valid UTF-8"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)


def test_refuses_missing_config_and_component(src, tmp_path):
    (src / "vae" / "config.json").unlink()
    with pytest.raises(DDUFPackError, match=r"vae.*no config file"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)
    shutil.rmtree(src / "vae")
    with pytest.raises(DDUFPackError, match=r"'vae' is named in model_index.json"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)


def test_refuses_broken_safetensors_and_bad_model_index(src, tmp_path):
    (src / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(DDUFPackError, match=r"diffusion_pytorch_model.safetensors.*S001"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)
    (src / "model_index.json").write_text("[1, 2")
    with pytest.raises(DDUFPackError, match="model_index.json: not valid JSON"):
        pack_folder(src, tmp_path / "o.dduf", quiet=True)
    with pytest.raises(DDUFPackError, match="no model_index.json"):
        pack_folder(tmp_path, tmp_path / "o.dduf", quiet=True)


def test_writer_refuses_forbidden_names(tmp_path):
    with DDUFWriter(tmp_path / "w.dduf") as w:
        for bad in ("../x.json", "/abs.json", "a\\b.json", "a/b/c.json", "unet/model.bin", "nul\x00.json", "a//b.json"):
            with pytest.raises(DDUFPackError):
                w.add_bytes(bad, b"{}")
        w.add_bytes("model_index.json", b"{}")
        with pytest.raises(DDUFPackError, match="duplicate"):
            w.add_bytes("model_index.json", b"{}")


def test_interrupted_pack_leaves_nothing(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.dduf"
    target.write_bytes(b"previous archive")
    calls = {"n": 0}
    original = DDUFWriter.add_file

    def failing(self, name, source):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, name, source)

    monkeypatch.setattr(DDUFWriter, "add_file", failing)
    with pytest.raises(KeyboardInterrupt):
        pack_folder(src, target, quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.dduf"]
    assert target.read_bytes() == b"previous archive"


def test_large_entry_streams_through_copy(tmp_path):
    """An entry bigger than one copy chunk keeps its CRC-32, sha256 and alignment right."""
    import dduf_plus.format.writer as writer_mod

    payload = os.urandom(3 * 1024 * 1024 + 17)
    header = json.dumps({"x": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    header += b" " * (-len(header) % 8)
    st = tmp_path / "big.safetensors"
    st.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    old = writer_mod.CHUNK
    writer_mod.CHUNK = 1 << 20
    try:
        with DDUFWriter(tmp_path / "big.dduf") as w:
            w.add_bytes("model_index.json", b'{"unet": ["diffusers", "X"]}')
            w.add_bytes("unet/config.json", b"{}")
            w.add_file("unet/big.safetensors", st)
            rec = w.records[-1]
    finally:
        writer_mod.CHUNK = old
    assert rec.sha256 == sha256(st)
    with zipfile.ZipFile(tmp_path / "big.dduf") as zf:
        assert zf.testzip() is None
        assert zf.read("unet/big.safetensors") == st.read_bytes()
    assert (rec.data_offset + 8 + len(header)) % 4096 == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_hash_ahead_gives_identical_bytes_and_closes_every_descriptor(src, tmp_path):
    """Hashing largest-first on descriptors opened up front changes nothing in the output, leaks nothing."""
    plan = plan_folder(src)
    files = [(s.name, s.path) for s in sorted(plan.sources, key=lambda s: s.name) if s.path is not None]
    outputs = []
    for ahead in (False, True):
        before = _open_fds()
        with DDUFWriter(tmp_path / f"w{ahead}.dduf") as w:
            if ahead:
                w.hash_ahead(files)
                assert _open_fds() > before  # the sources are held open from here on
            for name, path in files:
                w.add_file(name, path)
            records = w.records
        assert _open_fds() == before
        outputs.append((tmp_path / f"w{ahead}.dduf").read_bytes())
        assert [r.sha256 for r in records] == [sha256(path) for _, path in files]
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_abort_after_hash_ahead_closes_descriptors_and_leaves_nothing(src, tmp_path):
    plan = plan_folder(src)
    files = [(s.name, s.path) for s in plan.sources if s.path is not None]
    before = _open_fds()
    with pytest.raises(RuntimeError):
        with DDUFWriter(tmp_path / "out" / "w.dduf") as w:
            w.hash_ahead(files)
            w.add_file(*files[0])
            raise RuntimeError("interrupted")
    assert _open_fds() == before
    assert list((tmp_path / "out").iterdir()) == []


def test_hash_ahead_names_an_unreadable_source(tmp_path):
    with DDUFWriter(tmp_path / "w.dduf") as w:
        with pytest.raises(DDUFPackError, match="unet/missing.safetensors.*cannot read"):
            w.hash_ahead([("unet/missing.safetensors", tmp_path / "nope.safetensors")])
        w.add_bytes("model_index.json", b"{}")


def test_source_shrinking_while_hashed_is_refused_and_leaves_nothing(tmp_path):
    """A file truncated between hash_ahead and the end: a DDUFPackError, no archive, no temp file."""
    st = tmp_path / "src" / "w.safetensors"
    st.parent.mkdir()
    header = b'{"x":{"dtype":"U8","shape":[8192],"data_offsets":[0,8192]}}'
    header += b" " * (-len(header) % 8)
    st.write_bytes(struct.pack("<Q", len(header)) + header + os.urandom(8192))
    out = tmp_path / "out"
    with pytest.raises(DDUFPackError, match="shrank"):
        with DDUFWriter(out / "w.dduf") as w:
            w.add_bytes("model_index.json", b"{}")
            w.hash_ahead([("unet/w.safetensors", st)])
            w._ahead["unet/w.safetensors"][2].result()  # let the hash finish, then shrink the file
            os.truncate(st, 100)
            w.add_file("unet/w.safetensors", st)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_is_optional_and_the_output_identical(src, tmp_path, monkeypatch, fsync):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    reference = pack_folder(src, tmp_path / "ref.dduf", quiet=True)  # default: fsync
    assert calls, "the default pack must fsync before its rename"
    calls.clear()
    result = pack_folder(src, tmp_path / "x.dduf", quiet=True, fsync=fsync)
    assert bool(calls) is fsync
    assert result.path.read_bytes() == reference.path.read_bytes()


def test_many_files_keep_the_descriptor_count_bounded(tmp_path, monkeypatch):
    """Only the largest files are opened ahead: a folder with many files never holds all of them open."""
    import dduf_plus.format.pack as pack_mod

    src = tmp_path / "src"
    shutil.copytree(PIPELINES / "tiny-sd", src)
    monkeypatch.setattr(pack_mod, "HASH_AHEAD_FILES", 2)
    seen: list[int] = []
    real = DDUFWriter.hash_ahead
    monkeypatch.setattr(DDUFWriter, "hash_ahead", lambda self, files: (seen.append(len(files)), real(self, files))[1])
    reference = pack_folder(PIPELINES / "tiny-sd", tmp_path / "ref.dduf", quiet=True)
    out = pack_folder(src, tmp_path / "x.dduf", quiet=True)
    assert seen == [2, 2]
    assert out.path.read_bytes() == reference.path.read_bytes()
