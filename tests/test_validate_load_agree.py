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


# --- the hub review's mutations (tests/test_hub_validate.py): each validate refuses is refused by load_dduf with
# validate's codes; each it accepts loads ----------------------------------------------------------------------
def _hub_mutations(tmp_path) -> dict[str, bytes]:
    import struct

    from test_hub_validate import descriptor_archive

    from conftest import load_make_hostile

    mh = load_make_hostile()
    mi = json.dumps(mh.MODEL_INDEX).encode()
    good = mh.write_valid(tmp_path / "good.dduf").read_bytes()
    long_comment = bytearray(good)
    struct.pack_into("<H", long_comment, len(long_comment) - 2, 0xFFFF)
    bom_config = mh.base_entries()
    bom_config["unet/config.json"] = b"\xef\xbb\xbf" + bom_config["unet/config.json"]
    surrogate_config = mh.base_entries() | {"unet/config.json": b'{"_class_name": "UNet2DModel", "x": "\\udc80"}'}
    surrogate_vocab = mh.base_entries() | {"tokenizer/vocab.json": b'{"h": 0, "e": 1, "l\\ud800": 2}'}
    def named(name: bytes) -> bytes:
        raw = b'{"%s":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' % name
        raw += b" " * (-len(raw) % 8)
        weights = struct.pack("<Q", len(raw)) + raw + bytes(16)
        entries = mh.base_entries() | {"unet/diffusion_pytorch_model.safetensors": weights}
        return mh.write_valid(tmp_path / "named.dduf", entries).read_bytes()

    return {
        "tensor-name-nul": named(b"bias\\u0000x"),
        "tensor-name-surrogate": named(b"\\udc80"),
        "comment-longer-than-file": bytes(long_comment),
        "descriptor-lies": descriptor_archive("signed32", lie="crc"),
        "local-header-lies-under-descriptor": descriptor_archive("signed32", lie="local"),
        "config-with-bom": mh.write_valid(tmp_path / "bom.dduf", bom_config).read_bytes(),
        "model-index-utf16": mh.write_valid(tmp_path / "u16.dduf", model_index_bytes=mi.decode().encode("utf-16")).read_bytes(),
        "config-lone-surrogate": mh.write_valid(tmp_path / "sur.dduf", surrogate_config).read_bytes(),
        "tokenizer-lone-surrogate": mh.write_valid(tmp_path / "tok.dduf", surrogate_vocab).read_bytes(),
    }


HUB_MUTATIONS = ("tensor-name-nul", "tensor-name-surrogate", "comment-longer-than-file", "descriptor-lies", "local-header-lies-under-descriptor",
                 "config-with-bom", "model-index-utf16", "config-lone-surrogate", "tokenizer-lone-surrogate")


@pytest.mark.parametrize("case", HUB_MUTATIONS)
def test_hub_mutations_validate_refuses_are_refused_by_the_loader_with_its_codes(tmp_path, case: str) -> None:
    from dduf_plus import load_dduf
    from dduf_plus.format.findings import RULES

    path = tmp_path / f"{case}.dduf"
    path.write_bytes(_hub_mutations(tmp_path)[case])
    refused = {f.code for f in validate(path).errors}
    assert refused and refused <= set(RULES), refused  # every reason is a documented rule code
    with pytest.raises(DDUFError) as info:
        load_dduf(path)
    assert info.value.codes and set(info.value.codes) <= refused, (info.value.codes, refused)


def test_an_honest_data_descriptor_archive_validates_and_loads(packed, tmp_path) -> None:
    """A real pipeline whose next-to-last entry was streamed: bit 3, zero CRC-32 and sizes in its local header,
    a 16-byte signed descriptor after its data (what zipfile writes to an unseekable stream), the dduf_plus
    index after it."""
    import struct

    from conftest import load_make_hostile
    from dduf_plus import load_dduf
    from dduf_plus.format import spec

    mh = load_make_hostile()
    data = bytearray(packed["tiny-dit"].read_bytes())
    layout = mh.Layout(bytes(data))
    name = sorted(layout.local, key=layout.local.get)[-2]  # the entry before the index
    local, central, size = layout.local[name], layout.central[name], layout.size(name)
    end = layout.data_offset(name) + size
    assert end == layout.local[spec.INDEX_NAME]  # only the index and the directory move
    crc = struct.unpack_from("<I", data, central + 16)[0]
    struct.pack_into("<H", data, local + 6, struct.unpack_from("<H", data, local + 6)[0] | spec.FLAG_DATA_DESCRIPTOR)
    struct.pack_into("<III", data, local + 14, 0, 0, 0)
    struct.pack_into("<H", data, central + 8, struct.unpack_from("<H", data, central + 8)[0] | spec.FLAG_DATA_DESCRIPTOR)
    descriptor = struct.pack("<IIII", spec.SIG_DATA_DESCRIPTOR, crc, size, size)
    blob = bytearray(data[:end] + descriptor + data[end:])
    mh._fix_offsets(blob, end, len(descriptor))
    path = tmp_path / "streamed.dduf"
    path.write_bytes(blob)
    report = validate(path, verify=True)
    assert report.valid and not report.errors, report  # was: Z015 (the descriptor taken for 24 bytes)
    pipe = load_dduf(path)
    assert type(pipe).__name__ == "PixArtAlphaPipeline"
