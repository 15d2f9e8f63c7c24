"""Property: whatever bytes a valid archive is mutated into (bit flips, truncations, splices, overwrites of
its records), validate() returns a report or raises DDUFError, never anything else, never X000 (a caught
bug), and DDUFArchive either opens or raises DDUFError."""

from __future__ import annotations

import os
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import HOSTILE, load_make_hostile
from dduf_plus.errors import DDUFError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import ValidationReport, validate
from dduf_plus.storage.source import BytesSource

mh = load_make_hostile()
BASE = (HOSTILE / "valid.dduf").read_bytes()
LAYOUT = mh.Layout(BASE)
SCRATCH = mh.raw_zip(mh.plain_entries())  # no alignment padding: records are denser

# Where the interesting bytes are: end records, central directory, local headers, safetensors header.
HOT = sorted({*range(LAYOUT.cd_offset, len(BASE)),
              *(at + i for at in LAYOUT.local.values() for i in range(64)),
              *range(LAYOUT.data_offset("unet/diffusion_pytorch_model.safetensors"),
                     LAYOUT.data_offset("unet/diffusion_pytorch_model.safetensors") + 200)})

EXAMPLES = int(os.environ.get("DDUF_PROPERTY_EXAMPLES", "120"))  # raise it for a longer search
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])




def check(data: bytes, *, verify: bool = False, on_disk: bool = False) -> None:
    if on_disk:  # the mmap hashing path
        with tempfile.NamedTemporaryFile(suffix=".dduf", delete=False) as f:
            f.write(data)
        try:
            report = validate(f.name, verify=verify)
        finally:
            os.unlink(f.name)
    else:
        report = validate(BytesSource(data, "<mutant>"), verify=verify)
    assert isinstance(report, ValidationReport)
    assert "X000" not in report.codes, report
    assert report.valid == (not report.errors)
    try:
        DDUFArchive(BytesSource(data, "<mutant>")).close()
    except DDUFError:
        pass


base = st.sampled_from([BASE, SCRATCH])
positions = st.integers(min_value=0, max_value=len(BASE) - 1)


@SETTINGS
@given(data=base, flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7)), min_size=1, max_size=8),
       verify=st.booleans())
def test_bit_flips_anywhere(data, flips, verify):
    out = bytearray(data)
    for at, bit in flips:
        out[at % len(out)] ^= 1 << bit
    check(bytes(out), verify=verify)


@SETTINGS
@given(flips=st.lists(st.tuples(st.sampled_from(HOT), st.integers(0, 7)), min_size=1, max_size=6))
def test_bit_flips_in_records(flips):
    out = bytearray(BASE)
    for at, bit in flips:
        out[at] ^= 1 << bit
    check(bytes(out), verify=True)


@SETTINGS
@given(data=base, keep=st.integers(0, len(BASE)), tail=st.booleans())
def test_truncations(data, keep, tail):
    keep %= len(data) + 1
    check(data[:keep] if tail else data[len(data) - keep :])


@SETTINGS
@given(data=base, src=positions, dst=positions, length=st.integers(1, 512), insert=st.booleans())
def test_splices(data, src, dst, length, insert):
    src, dst = src % len(data), dst % len(data)
    piece = data[src : src + length]
    out = data[:dst] + piece + (data[dst:] if insert else data[dst + len(piece) :])
    check(out, verify=True)


@SETTINGS
@given(at=st.sampled_from(HOT), value=st.sampled_from([0, 1, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 32, 1 << 40, (1 << 64) - 1,
                                                       0x04034B50, 0x02014B50, 0x06064B50]),
       width=st.sampled_from([2, 4, 8]))
def test_integer_overwrites_in_records(at, value, width):
    value &= (1 << (8 * width)) - 1
    out = bytearray(BASE)
    out[at : at + width] = value.to_bytes(width, "little")[: len(out) - at]
    check(bytes(out))


@SETTINGS
@given(blob=st.binary(max_size=600), at=st.sampled_from(HOT))
def test_random_overwrites_in_records(blob, at):
    out = bytearray(BASE)
    out[at : at + len(blob)] = blob
    check(bytes(out[: len(BASE)]) if len(out) > len(BASE) else bytes(out))


# safetensors headers: JSON-shaped junk in the weights entry of a valid archive (then written by DDUFWriter)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                      st.text(max_size=8), st.sampled_from(["F16", "BF16", "F4", "F8_E4M3", "BOOL", "?"]))
json_value = st.recursive(json_leaf, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), children,
                                                    max_size=4)), max_leaves=16)


@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=6), json_value, max_size=4), data_len=st.integers(0, 64))
def test_forged_safetensors_headers(tmp_path, header, data_len):
    import json

    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + bytes(data_len)
    path = mh.write_valid(tmp_path / "x.dduf", mh.base_entries() | {"unet/diffusion_pytorch_model.safetensors": blob})
    check(path.read_bytes(), verify=True, on_disk=True)


@pytest.mark.parametrize("seed", range(3))
def test_mmap_path_on_mutants(seed):
    import random

    rng = random.Random(seed)
    for _ in range(20):
        out = bytearray(BASE)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        check(bytes(out), verify=True, on_disk=True)
