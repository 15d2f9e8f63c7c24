"""The part maps the model-folder search remembers (refs/part_memo.py): a component found by a layout reader in a
file of another layout (here the UNet, VAE and CLIP parts of one full SD 1.5 checkpoint) is found by a second
process from its signed map, without running a reader (so without importing diffusers' single-file converter)
and without hashing, and gives the same match. A map is untrusted: a broken signature, a signed map whose ranges
were changed, one for another file or reference, an oversized or malformed one, are ignored and the readers run;
a changed file never uses an old map."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from single_file_ckpt import checkpoint_from_pipeline

from conftest import PIPELINES
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.safetensors_header import TensorInfo
from dduf_plus.packing import pack
from dduf_plus.refs import model_dirs, part_memo
from dduf_plus.refs.cache import dduf_cache_dir, stat_key, verified_hashes

pytestmark = pytest.mark.usefixtures("app_cache")

PARTS = ("unet", "vae", "text_encoder")
CONVERTER = "diffusers.loaders.single_file_utils"  # what the layout reader imports (diffusers' converter)


@pytest.fixture(scope="module")
def sd15(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An fp32 tiny SD 1.5 partial archive referencing its UNet, VAE and text encoder, and ONE full original
    checkpoint of them in models/checkpoints (BASE's copies deleted)."""
    from diffusers import DiffusionPipeline

    root = tmp_path_factory.mktemp("memo")
    base = root / "base"
    DiffusionPipeline.from_pretrained(PIPELINES / "tiny-sd", torch_dtype=torch.float32).save_pretrained(base)
    archive = root / "sd15.dduf"
    pack(base, archive, exclude=list(PARTS), refs={n: str(base) for n in PARTS}, quiet=True, fsync=False)
    models = root / "models"
    (models / "checkpoints").mkdir(parents=True)
    full = models / "checkpoints" / "sd15-pruned.safetensors"
    save_file(checkpoint_from_pipeline(base, "v1"), full)
    with DDUFArchive(archive) as a:
        refs = {n: dict(a.references[n]) for n in PARTS}
    return {"root": root, "archive": archive, "models": models, "full": full, "refs": refs}



@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every layout reader run, and every part hashed, in order."""
    seen: list[str] = []
    readers, digest = list(model_dirs._READERS), model_dirs.part_digest

    def counting(reader: Any) -> Any:
        def run(*args: Any) -> Iterator[Any]:
            seen.append("reader")
            yield from reader(*args)
        return run

    def hashing(path: Path, part: Any) -> str:
        seen.append(f"hashed {part.layout}")
        return digest(path, part)

    monkeypatch.setattr(model_dirs, "_READERS", [counting(r) for r in readers])
    monkeypatch.setattr(model_dirs, "part_digest", hashing)
    return seen


def _find(sd15: dict[str, Any], name: str) -> model_dirs.Match:
    found = model_dirs.find_component(name, sd15["refs"][name], [sd15["models"]])
    assert isinstance(found, model_dirs.Match) and found.in_place is not None, found
    return found


def _maps() -> list[Path]:
    return sorted((dduf_cache_dir() / part_memo.FOLDER).glob("*.json"))


def _map_of(sd15: dict[str, Any], name: str) -> Path:
    path = part_memo.map_path(sd15["full"], stat_key(sd15["full"]), sd15["refs"][name]["tensors"])
    assert path.is_file()  # kept once the part matched
    return path


_SECOND = textwrap.dedent("""
    import pickle, sys
    from pathlib import Path
    from dduf_plus.packing.model_dir_layouts import install
    from dduf_plus.refs import model_dirs

    refs, models, out = pickle.loads(Path(sys.argv[1]).read_bytes()), Path(sys.argv[2]), Path(sys.argv[3])
    install()
    hashed = []
    digest = model_dirs.part_digest
    model_dirs.part_digest = lambda path, part: hashed.append(part.layout) or digest(path, part)
    found = {n: model_dirs.find_component(n, ref, [models]) for n, ref in refs.items()}
    out.write_bytes(pickle.dumps({"found": found, "hashed": hashed,
                                  "imported": sorted(m for m in sys.modules if "single_file" in m)}))
""")


def _second_process(sd15: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The three searches in a fresh process (the same dduf_plus cache): what it found, hashed and imported."""
    (tmp_path / "refs.pkl").write_bytes(pickle.dumps(sd15["refs"]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", _SECOND, str(tmp_path / "refs.pkl"), str(sd15["models"]),
                    str(tmp_path / "out.pkl")], check=True, env=env, cwd=tmp_path, timeout=600)
    result: dict[str, Any] = pickle.loads((tmp_path / "out.pkl").read_bytes())
    return result


def test_a_second_process_runs_no_layout_reader(sd15: dict[str, Any], tmp_path: Path) -> None:
    first = {n: _find(sd15, n) for n in PARTS}
    assert CONVERTER in sys.modules  # the first search converted the parts' headers
    assert len(_maps()) == 3
    second = _second_process(sd15, tmp_path)
    assert second["found"] == first  # the same Match, the same InPlace (file, stat, part's ranges, digest)
    assert CONVERTER not in second["imported"] and "dduf_plus.packing.single_file_convert" not in second["imported"]
    assert second["hashed"] == []
    verified = json.loads((dduf_cache_dir() / "verified.json").read_text())
    assert all(len(v) == 6 for v in verified["entries"].values())  # the hash memory holds digests (stat key, sha256), no maps


def test_a_first_search_without_a_map_is_unchanged(sd15: dict[str, Any], reads: list[str]) -> None:
    """A process that finds no map (the first, or a cache from before maps) runs the readers, keeps one; the next
    search runs none and hashes nothing."""
    _find(sd15, "unet")
    assert reads[0] == "reader" and "hashed LDM UNet under model.diffusion_model." in reads
    reads.clear()
    found = _find(sd15, "unet")
    assert reads == [] and found.in_place is not None and found.in_place.part.layout.startswith("LDM UNet")


def _resign(path: Path, edit: Any) -> None:
    """Change a map and sign it again with the cache's own secret: a forged signature, for the digest memo to
    catch."""
    signer = verified_hashes().signer
    record = signer.read(path, part_memo.MAX_MAP_BYTES)
    assert record is not None
    record.pop("v")
    edit(record)
    assert signer.write(path, record)


def _swap_ranges(record: dict[str, Any]) -> None:
    """Two tensors of the same dtype and shape exchange their ranges: still inside the file and of the layout
    the reference records, so only the digest memo (keyed by the exact ranges) tells."""
    rows = record["tensors"]
    by_kind: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_kind.setdefault(json.dumps(row[1:3]), []).append(i)
    i, j = next(v for v in by_kind.values() if len(v) > 1)[:2]
    rows[i][3], rows[j][3] = rows[j][3], rows[i][3]


@pytest.mark.parametrize("tamper", ["bytes", "swapped", "elsewhere", "other kind"])
def test_a_tampered_map_is_ignored_and_the_readers_run(sd15: dict[str, Any], reads: list[str], tamper: str) -> None:
    first = _find(sd15, "unet")
    path = _map_of(sd15, "unet")
    if tamper == "bytes":  # its signature broken
        raw = path.read_bytes()
        start = json.loads(raw)["data_start"]
        path.write_bytes(raw.replace(f'"data_start":{start}'.encode(), f'"data_start":{start + 8}'.encode(), 1))
    elif tamper == "swapped":
        _resign(path, _swap_ranges)
    elif tamper == "elsewhere":  # a valid map of another part put in this one's place
        _find(sd15, "vae")
        path.write_bytes(_map_of(sd15, "vae").read_bytes())
    else:  # the hash memory's own signed file in its place
        path.write_bytes((dduf_cache_dir() / "verified.json").read_bytes())
    assert part_memo.recall(sd15["full"], stat_key(sd15["full"]), sd15["refs"]["unet"]["tensors"]) is None or \
        tamper == "swapped"
    reads.clear()
    again = _find(sd15, "unet")
    assert reads == ["reader"]  # the readers ran (the part's digest still remembered: nothing hashed)
    assert again == first


def test_a_changed_file_never_uses_its_old_map(sd15: dict[str, Any], reads: list[str]) -> None:
    full: Path = sd15["full"]
    first = _find(sd15, "vae")
    old = _map_of(sd15, "vae")
    before = os.stat(full)
    try:
        os.utime(full, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        assert part_memo.recall(full, stat_key(full), sd15["refs"]["vae"]["tensors"]) is None
        reads.clear()
        found = _find(sd15, "vae")
        assert reads == ["reader", "hashed LDM VAE under first_stage_model."]  # read and hashed again
        assert found.in_place is not None and first.in_place is not None and found.in_place.key == stat_key(full)
        assert found.in_place.part == first.in_place.part and found.in_place.digest == first.in_place.digest
        assert _map_of(sd15, "vae") != old
    finally:
        os.utime(full, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_an_oversized_or_malformed_map_is_ignored(sd15: dict[str, Any], reads: list[str]) -> None:
    full, rec = sd15["full"], sd15["refs"]["text_encoder"]["tensors"]
    _find(sd15, "text_encoder")
    path = _map_of(sd15, "text_encoder")
    good = path.read_bytes()
    assert part_memo.recall(full, stat_key(full), rec) is not None
    signer = verified_hashes().signer
    pad = {"pad": "x" * part_memo.MAX_MAP_BYTES}
    _resign(path, lambda r: r.update(pad))  # signed, but over the read budget
    assert path.stat().st_size > part_memo.MAX_MAP_BYTES
    assert part_memo.recall(full, stat_key(full), rec) is None
    path.write_bytes(b"[" * 200_000)  # nested past the interpreter's depth
    assert part_memo.recall(full, stat_key(full), rec) is None
    for bad in (lambda r: r["tensors"][0].__setitem__(2, ["4"]), lambda r: r["tensors"][0][3][0].__setitem__(0, True),
                lambda r: r["tensors"][0][3][0].__setitem__(0, -8), lambda r: r["tensors"][0].__setitem__(1, "int4"),
                lambda r: r["tensors"].append(r["tensors"][0]), lambda r: r.update(tensors=[]),
                lambda r: r["tensors"][0].__setitem__(3, [[0, 1]] * 65), lambda r: r.update(data_start="8"),
                lambda r: r.update(layout="LDM UNet\n[fake log line]")):
        path.write_bytes(good)
        _resign(path, bad)
        assert signer.read(path, part_memo.MAX_MAP_BYTES) is not None  # signed: refused for what it says
        assert part_memo.recall(full, stat_key(full), rec) is None
    reads.clear()
    _find(sd15, "text_encoder")
    assert reads == ["reader"]


def test_the_maps_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(part_memo, "MAX_MAPS", 2)
    file = tmp_path / "f.safetensors"
    file.write_bytes(b"x" * 64)
    part = ("L", 8, {"w": (TensorInfo("w", "float32", (2,), 0, 8), ((0, 8),), 0)})
    for i in range(4):
        rec = {"layout": f"{i:064x}", "count": 1, "bytes": 8}
        part_memo.keep(file, stat_key(file), rec, part)
        os.utime(part_memo.map_path(file, stat_key(file), rec), ns=(i * 10**9, i * 10**9))
    assert len(_maps()) == 2
    kept = part_memo.recall(file, stat_key(file), {"layout": f"{3:064x}", "count": 1, "bytes": 8})
    assert kept == part_memo.PartMap("L", 8, {"w": (TensorInfo("w", "float32", (2,), 0, 8), ((0, 8),), 0)})
