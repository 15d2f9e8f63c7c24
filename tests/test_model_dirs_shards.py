"""Sharded components found by content in app model folders (refs/model_dirs.py, packing/tensor_records.py):
FLUX.1's transformer and T5 are sharded in diffusers repos, while ComfyUI keeps each as ONE file
(``models/unet/flux1-dev.safetensors`` in BFL layout, ``models/text_encoders/t5xxl_fp16.safetensors``). A
reference to a sharded component records its tensors' digest (over every shard, hostile indexes refused at
pack), is matched by one file in any layout the layout reader knows, loads in place from it, and completes as
one file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_files import FLUX_TARGETS, SMALL_FLUX, diffusers_lora
from pipeline_states import assert_same_states, states
from safetensors.torch import load_file, save_file
from single_file_ckpt import _state, build_tiny_flux, flux_to_bfl

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFReferenceError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing import pack
from dduf_plus.refs import tensor_digest
from dduf_plus.refs.resolve import check_references

pytestmark = pytest.mark.usefixtures("app_cache")

SHARDED = ("transformer", "text_encoder_2")
T5_PREFIX = "text_encoders.t5xxl.transformer."
KW = {"num_inference_steps": 2, "output_type": "np", "height": 32, "width": 32, "guidance_scale": 3.5}



@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fp32 FLUX.1-shaped pipeline saved by diffusers with a small ``max_shard_size``: the transformer
    (8 shards) and T5 (2 shards) sharded, with their indexes, as diffusers repos hold them."""
    from diffusers import DiffusionPipeline

    root = tmp_path_factory.mktemp("flux")
    base = build_tiny_flux(root / "single", PIPELINES / "tiny-sd" / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer",
                           dtype=torch.float32, transformer_config=SMALL_FLUX)
    DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32).save_pretrained(root / "sharded",
                                                                                       max_shard_size="50KB")
    for name in SHARDED:
        assert len(list((root / "sharded" / name).glob("*-of-*.safetensors"))) > 1, name
    return root / "sharded"


@pytest.fixture
def base(sharded: Path, tmp_path: Path) -> Path:
    """A copy of the sharded BASE (hard links: a test that edits a file unlinks it first)."""
    return Path(shutil.copytree(sharded, tmp_path / "base", copy_function=os.link))


@pytest.fixture(scope="module")
def real_width(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1's real transformer width (3072: diffusers' BFL converter assumes it; one block of each kind, bf16,
    about 1 GB) saved in 3 shards, as the diffusers repo holds it."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("flux-real")
    base = build_tiny_flux(root / "base", PIPELINES / "tiny-sd" / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    model = FluxTransformer2DModel.from_pretrained(base / "transformer", torch_dtype=torch.bfloat16)
    shutil.rmtree(base / "transformer")
    model.save_pretrained(base / "transformer", max_shard_size="400MB")
    del model
    assert len(list((base / "transformer").glob("*-of-00003.safetensors"))) == 3
    return base



def _t5(base: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in _state(base, "text_encoder_2").items()}


def _app_folder(base: Path, root: Path, *, transformer: str = "diffusers", t5_prefix: str = "") -> Path:
    """ComfyUI's folders holding the sharded components as ONE file each, from the same weights: the
    transformer in BFL layout (``"bfl"``), under ``model.diffusion_model.`` (``"comfy"``) or in diffusers' names
    (``"diffusers"``), T5 with bare transformers keys or under ``t5_prefix``; BASE's copies deleted."""
    models = root / "models"
    (models / "unet").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    state = _state(base, "transformer")  # every shard's tensors
    if transformer != "diffusers":
        state = flux_to_bfl(state, "model.diffusion_model." if transformer == "comfy" else "")
    save_file(state, models / "unet" / "flux1-dev.safetensors")
    del state
    save_file(_t5(base, t5_prefix), models / "text_encoders" / "t5xxl_fp16.safetensors")
    for name in SHARDED:
        shutil.rmtree(base / name)
    return models


def _image(pipe: Any) -> Any:
    return pipe("a cat", generator=torch.Generator().manual_seed(0), **KW).images


def _partial(base: Path, out: Path) -> Path:
    pack(base, out, exclude=list(SHARDED), refs={n: str(base) for n in SHARDED}, quiet=True, fsync=False)
    return out


def _refs(archive: Path) -> dict[str, Any]:
    with DDUFArchive(archive) as a:
        return dict(a.references)


def _weights_in_cache() -> list[Path]:
    """Weights files written into dduf_plus' cache (not the view folders' links)."""
    return sorted(p for p in Path(os.environ["DDUF_PLUS_CACHE"]).rglob("*.safetensors") if not p.is_symlink())


# --- pack: the digest of every shard ---------------------------------------------------------------------------
def test_a_sharded_reference_records_its_tensors_digest_from_every_base_kind(base: Path, tmp_path: Path,
                                                                             hf_env: Path, hashed: list[str]) -> None:
    """From a folder, a Hugging Face cache snapshot and a .dduf BASE: the same digest, the one a single file of
    the same tensors has (layout-independent across shards); packing again hashes nothing."""
    from hfcache import cached

    want = {}
    for name in SHARDED:  # each component's tensors in ONE file
        single = tmp_path / f"{name}.safetensors"
        save_file(_state(base, name), single)
        want[name] = tensor_digest.tensors_digest([(single, _header(single))])
    base_dduf = pack(base, tmp_path / "base.dduf", quiet=True, fsync=False)[0].path
    cached(hf_env, base, "org/flux-sharded")
    records = {}
    for kind, spec in (("folder", str(base)), ("dduf", str(base_dduf)), ("hub", "org/flux-sharded")):
        out = tmp_path / f"{kind}.dduf"
        pack(base, out, exclude=list(SHARDED), refs={n: spec for n in SHARDED}, quiet=True, fsync=False)
        records[kind] = {n: r.get(tensor_digest.RECORD_KEY) for n, r in _refs(out).items()}
    for kind, recs in records.items():
        assert all(isinstance(recs[n], dict) for n in SHARDED), kind
        assert recs == records["folder"], kind
    assert {n: records["folder"][n]["sha256"] for n in SHARDED} == want
    hashed.clear()
    _partial(base, tmp_path / "again.dduf")
    assert hashed == []  # each shard set's digest is remembered by every shard's stat


def test_a_hub_base_elsewhere_records_from_the_identical_local_shards(base: Path, tmp_path: Path,
                                                                      hf_env: Path) -> None:
    """BASE's bytes elsewhere (a Hub repo compared by file hashes): the local copy's shards and index, as files
    or as entries of an archive, give the same digest; one shard with other bytes gives none."""
    from dduf_plus.format.pack import FileRegion
    from dduf_plus.packing import tensor_records
    from dduf_plus.packing.reference_source import hash_local_files
    from dduf_plus.refs.spec import parse_spec

    sub = base / "text_encoder_2"
    local: dict[str, Any] = {f.name: f for f in sub.iterdir()}
    files = hash_local_files(local)
    spec = parse_spec("org/not-cached")
    want = tensor_records.reference_tensors(spec, "text_encoder_2", files, None, local)[tensor_digest.RECORD_KEY]
    single = tmp_path / "t5.safetensors"
    save_file(_t5(base), single)
    assert want["sha256"] == tensor_digest.tensors_digest([(single, _header(single))])
    archive = pack(base, tmp_path / "in.dduf", quiet=True, fsync=False)[0].path
    with DDUFArchive(archive) as a:
        regions = {f: FileRegion(archive, a.entry(f"text_encoder_2/{f}").offset, a.entry(f"text_encoder_2/{f}").length,
                                 f"text_encoder_2/{f}") for f in local}
    got = tensor_records.reference_tensors(spec, "text_encoder_2", hash_local_files(regions), None, regions)
    assert got[tensor_digest.RECORD_KEY] == want
    shard = next(f for f in files if f.endswith("-of-00002.safetensors"))
    other = {**files, shard: {**files[shard], "sha256": "0" * 64}}
    assert tensor_records.reference_tensors(spec, "text_encoder_2", other, None, local) == {}


def _header(path: Path) -> Any:
    from dduf_plus.format.safetensors_header import read_file_header

    return read_file_header(path, path.name, DDUFError)


def _edit_index(folder: Path, edit: Any) -> None:
    index = next(folder.glob("*.index.json"))
    value = json.loads(index.read_text())
    edit(value["weight_map"])
    index.unlink()  # a hard link to the module's BASE
    index.write_text(json.dumps(value))


def _missing_shard(folder: Path) -> None:
    _edit_index(folder, lambda m: m.update({next(iter(m)): "diffusion_pytorch_model-00009-of-00009.safetensors"}))


def _escaping(folder: Path) -> None:
    _edit_index(folder, lambda m: m.update({next(iter(m)): "../vae/diffusion_pytorch_model.safetensors"}))


def _in_two_shards(folder: Path) -> None:
    shards = sorted(folder.glob("*-of-*.safetensors"))
    first, last = load_file(shards[0]), load_file(shards[-1])
    name = next(iter(first))
    shards[-1].unlink()
    save_file({**last, name: first[name]}, shards[-1], metadata={"format": "pt"})


def _not_json(folder: Path) -> None:
    index = next(folder.glob("*.index.json"))
    index.unlink()
    index.write_text('{"weight_map": ')


@pytest.mark.parametrize("hostile", [_missing_shard, _escaping, _in_two_shards, _not_json])
def test_a_hostile_shard_index_is_refused_at_pack(base: Path, tmp_path: Path, hostile: Any) -> None:
    """A BASE whose shard index names a missing shard or a path outside the folder, whose shards hold a tensor
    twice, or that is not JSON: a DDUFError naming the component and the rule, never a traceback or a record."""
    hostile(base / "transformer")
    with pytest.raises(DDUFError) as err:
        _partial(base, tmp_path / "t.dduf")
    assert "transformer" in str(err.value)
    # a tensor in two shards is already refused by the comparison with BASE; the index rules by their code
    assert err.value.code in ("D011", "D007") or "also in another weight file" in str(err.value)
    assert not (tmp_path / "t.dduf").exists()


def test_the_shard_index_rules() -> None:
    """Every way an index and its shards may disagree (archive and cache BASEs are checked by these alone)."""
    from dduf_plus.errors import DDUFPackError
    from dduf_plus.format.safetensors_header import SafetensorsHeader, TensorInfo

    def header(*names: str) -> SafetensorsHeader:
        return SafetensorsHeader(8, {n: TensorInfo(n, "float32", (1,), 0, 4) for n in names}, None)

    shards = {"m-00001-of-00002.safetensors": header("a", "b"), "m-00002-of-00002.safetensors": header("c")}
    good = {"a": "m-00001-of-00002.safetensors", "b": "m-00001-of-00002.safetensors", "c": "m-00002-of-00002.safetensors"}
    tensor_digest.check_shard_index("vae", "m.safetensors.index.json", json.dumps({"weight_map": good}).encode(), shards)
    bad = {"in two shards": (good, {**shards, "m-00002-of-00002.safetensors": header("c", "a")}),
           "in another shard than it says": ({**good, "c": "m-00001-of-00002.safetensors"}, shards),
           "no shard holds": ({**good, "d": "m-00002-of-00002.safetensors"}, shards),
           "a shard it does not name": ({k: "m-00001-of-00002.safetensors" for k in "ab"}, shards),
           "not a dict": ([], shards)}
    for what, (weight_map, headers) in bad.items():
        with pytest.raises(DDUFPackError) as err:
            tensor_digest.check_shard_index("vae", "m.safetensors.index.json",
                                         json.dumps({"weight_map": weight_map}).encode(), headers)
        assert err.value.code == "D011" and str(err.value).startswith("vae: shard index"), what
    with pytest.raises(DDUFPackError) as err:
        tensor_digest.check_shard_index("vae", "m.safetensors.index.json", b"[" * 100_000, shards)
    assert err.value.code == "D013"


# --- resolve and load: one app file for the shards ---------------------------------------------------------------
def test_a_flux_lora_archive_loads_its_sharded_base_from_comfyui_files(base: Path, tmp_path: Path,
                                                                      hashed: list[str]) -> None:
    """``dduf pack LORA --base BASE`` on a sharded Flux: with BASE's transformer and T5 only as one file each in
    ComfyUI's folders, the archive loads with the adapter applied, as diffusers gives it from
    BASE; the second load hashes nothing."""
    pytest.importorskip("peft")
    from diffusers import DiffusionPipeline

    from dduf_plus import load_dduf
    from dduf_plus.packing.lora import pack_lora

    lora = diffusers_lora(base, tmp_path / "l", {"transformer": FLUX_TARGETS}, dtype=torch.bfloat16)
    archive = tmp_path / "lora.dduf"
    pack_lora([f"flux_style={lora}"], archive, base=str(base), quiet=True)
    assert all(isinstance(_refs(archive)[n].get(tensor_digest.RECORD_KEY), dict) for n in SHARDED)
    theirs = DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32)
    theirs.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="flux_style")
    want = _image(theirs)
    assert abs(want - _image(DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32))).max() > 1e-4
    assert (_image(load_dduf(archive)) == want).all()
    models = _app_folder(base, tmp_path)
    # the same tensors at other addresses (views of the app's files): CPU kernels may round differently (~1e-6)
    assert abs(_image(load_dduf(archive, model_dirs=[models])) - want).max() < 1e-5
    assert _weights_in_cache() == []  # read in place: nothing copied
    hashed.clear()
    assert abs(_image(load_dduf(archive, model_dirs=[models])) - want).max() < 1e-5
    assert hashed == []


@pytest.mark.parametrize("t5_prefix", ["", T5_PREFIX])
def test_a_base_partial_loads_its_sharded_parts_from_one_file_each(base: Path, tmp_path: Path, t5_prefix: str) -> None:
    """A ``--base`` partial referencing the sharded transformer and T5: found as one file each (T5 bare or under
    the prefix SD3's full files use), equal tensor for tensor and the same 2-step image as from BASE."""
    from dduf_plus import load_dduf

    archive = _partial(base, tmp_path / "ft.dduf")
    pipe = load_dduf(archive)
    expected, image = states(pipe, SHARDED), _image(pipe)
    models = _app_folder(base, tmp_path, t5_prefix=t5_prefix)
    pipe = load_dduf(archive, model_dirs=[models])
    assert_same_states(pipe, expected)
    assert abs(_image(pipe) - image).max() < 1e-5  # equal tensors at other addresses: rounding only
    rows = {r["component"]: r for r in check_references(_refs(archive), model_dirs=[models])}
    assert "flux1-dev.safetensors" in rows["transformer"]["found"]
    assert "t5xxl_fp16.safetensors" in rows["text_encoder_2"]["found"]


def test_a_single_file_with_one_tensor_changed_is_refused(base: Path, tmp_path: Path) -> None:
    from dduf_plus import load_dduf

    archive = _partial(base, tmp_path / "ft.dduf")
    models = _app_folder(base, tmp_path)
    t5 = load_file(models / "text_encoders" / "t5xxl_fp16.safetensors")
    name = sorted(t5)[3]
    t5[name] = t5[name] + 1
    (models / "text_encoders" / "t5xxl_fp16.safetensors").unlink()
    save_file(t5, models / "text_encoders" / "t5xxl_fp16.safetensors")
    with pytest.raises(DDUFReferenceError) as err:
        load_dduf(archive, model_dirs=[models])
    message = str(err.value)
    assert "text_encoder_2" in message and "t5xxl_fp16.safetensors" in message and "bytes differ" in message


@pytest.mark.parametrize("layout", ["bfl", "comfy"])
def test_the_bfl_flux_file_stands_for_the_sharded_transformer(real_width: Path, tmp_path: Path, layout: str,
                                                              hashed: list[str]) -> None:
    """FLUX.1's transformer in 3 shards (the diffusers repo) found as ComfyUI's ONE file in BFL layout (bare in
    ``models/unet``, or under ``model.diffusion_model.``): loaded in place, equal tensor for tensor; the second
    load hashes nothing; ``complete`` writes the part once as one diffusers-named file."""
    from dduf_plus import load_dduf

    base = Path(shutil.copytree(real_width, tmp_path / "base", copy_function=os.link))
    archive = tmp_path / "ft.dduf"
    pack(base, archive, exclude=["transformer"], refs={"transformer": str(base)}, quiet=True, fsync=False)
    expected = {"transformer": {k: v.clone() for k, v in _state(base, "transformer").items()}}
    models = tmp_path / "models" / "unet"
    models.mkdir(parents=True)
    save_file(flux_to_bfl(_state(base, "transformer"), "model.diffusion_model." if layout == "comfy" else ""),
              models / "flux1-dev.safetensors")
    shutil.rmtree(base / "transformer")
    assert_same_states(load_dduf(archive, model_dirs=[models.parent]), expected)
    assert _weights_in_cache() == []
    hashed.clear()
    assert_same_states(load_dduf(archive, model_dirs=[models.parent]), expected)
    assert hashed == []
    if layout == "bfl":  # complete: the BFL part written once as a diffusers-named file (hashed as written)
        from dduf_plus.packing.complete import complete_archive

        complete_archive(archive, tmp_path / "whole.dduf", model_dirs=[models.parent], quiet=True)
        assert len(_weights_in_cache()) == 1 and hashed == []
        with DDUFArchive(tmp_path / "whole.dduf") as a:
            assert [n for n in a.entries if n.startswith("transformer/")] == [
                "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"]
        assert_same_states(load_dduf(tmp_path / "whole.dduf"), expected)


# --- complete and export ---------------------------------------------------------------------------------------
def test_complete_writes_one_file_in_place_of_the_shards(base: Path, tmp_path: Path, hashed: list[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """``dduf complete --model-dir``: each sharded component is written as ONE file in diffusers' names (its
    shards cannot be cut again as they were; the index is not recorded), said, equal to BASE's tensors; the
    files in diffusers' names are written as they are (nothing hashed again)."""
    from dduf_plus import load_dduf
    from dduf_plus.cli import main

    archive = _partial(base, tmp_path / "ft.dduf")
    expected = states(load_dduf(archive), SHARDED)
    models = _app_folder(base, tmp_path)
    load_dduf(archive, model_dirs=[models])
    hashed.clear()
    out = tmp_path / "whole.dduf"
    with caplog.at_level("WARNING"):
        assert main(["complete", str(archive), "-o", str(out), "--model-dir", str(models), "-q"]) == 0
    assert "in place of its" in caplog.text
    assert _weights_in_cache() == [] and hashed == []  # diffusers-named files: no copy, nothing hashed
    with DDUFArchive(out) as a:
        assert not a.references
        names = {n for n in a.entries if n.split("/")[0] in SHARDED}
    assert names == {"transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
                     "text_encoder_2/config.json", "text_encoder_2/model.safetensors"}
    assert_same_states(load_dduf(out), expected)


def test_export_reads_the_sharded_parts_from_the_app_files(base: Path, tmp_path: Path) -> None:
    from dduf_plus.cli import main

    archive = _partial(base, tmp_path / "ft.dduf")
    models = _app_folder(base, tmp_path)
    want = {k: v.clone() for k, v in load_file(models / "text_encoders" / "t5xxl_fp16.safetensors").items()}
    out = tmp_path / "flux.safetensors"
    assert main(["export", str(archive), "-o", str(out), "--model-dir", str(models), "-q"]) == 0
    got = load_file(out)
    t5 = {k.removeprefix(T5_PREFIX): v for k, v in got.items() if k.startswith(T5_PREFIX)}
    assert t5.keys() <= want.keys() and len(t5) >= len(want) - 1
    assert all(torch.equal(t5[k], want[k]) for k in t5)
    assert any(k.startswith("double_blocks.") or k.startswith("model.diffusion_model.double_blocks.") for k in got)


# --- a folder of shards in a model folder (ComfyUI's models/diffusers keeps whole diffusers pipelines) ----------
def _diffusers_folder(base: Path, root: Path) -> Path:
    """``models/diffusers/flux`` holding BASE's sharded components as diffusers folders: the transformer re-saved
    cut into other shards (other names, another index), T5 as BASE has it; BASE's copies deleted."""
    from diffusers import FluxTransformer2DModel

    pipeline = root / "models" / "diffusers" / "flux"
    model = FluxTransformer2DModel.from_pretrained(base / "transformer", torch_dtype=torch.float32)
    model.save_pretrained(pipeline / "transformer", max_shard_size="80KB")
    shutil.copytree(base / "text_encoder_2", pipeline / "text_encoder_2", copy_function=os.link)
    before = sorted(p.name for p in (base / "transformer").glob("*.safetensors"))
    assert sorted(p.name for p in (pipeline / "transformer").glob("*.safetensors")) != before  # cut otherwise
    for name in SHARDED:
        shutil.rmtree(base / name)
    return root / "models"


def test_a_folder_of_shards_in_a_model_folder_is_found_however_cut(base: Path, tmp_path: Path,
                                                                    hashed: list[str]) -> None:
    """Each sharded component found as the folder of shards it is in an app's ``models/diffusers`` pipeline (the
    transformer cut into other shards than BASE's): loaded from those files, nothing copied, equal tensor for
    tensor; the second load hashes nothing; ``dduf complete`` writes the folder's shards and index; a shard with
    one tensor changed is refused and said; a shard replaced between the search and the load is refused."""
    from dduf_plus import load_dduf
    from dduf_plus.cli import main
    from dduf_plus.loading.files import resolve_component
    from dduf_plus.packing import complete

    archive = _partial(base, tmp_path / "ft.dduf")
    expected = states(load_dduf(archive), SHARDED)
    models = _diffusers_folder(base, tmp_path)
    hashed.clear()
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
    assert _weights_in_cache() == []
    shards = sorted(p.name for n in SHARDED for p in (models / "diffusers" / "flux" / n).glob("*-of-*.safetensors"))
    assert sorted(hashed) == shards  # each shard hashed once (a folder's shards: one digest)
    rows = {r["component"]: r for r in check_references(_refs(archive), model_dirs=[models])}
    for name in SHARDED:
        assert rows[name]["how"] == "model folder" and f"flux{os.sep}{name} (shards)" in rows[name]["found"], rows
    hashed.clear()
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
    assert hashed == []  # remembered
    out = tmp_path / "whole.dduf"  # complete: the shards and their index, as the folder cuts them
    assert main(["complete", str(archive), "-o", str(out), "--model-dir", str(models), "-q"]) == 0
    with DDUFArchive(out) as a:
        assert not a.references and not a.findings
        assert sorted(n.split("/")[1] for n in a.entries if n.startswith("transformer/") and "-of-" in n) == sorted(
            p.name for p in (models / "diffusers" / "flux" / "transformer").glob("*-of-*.safetensors"))
    assert_same_states(load_dduf(out), expected)
    out.unlink()
    with pytest.MonkeyPatch.context() as m:  # the shards copied must still be the ones verified
        m.setattr(complete, "check_shard_folder", lambda folder, rec: "changed")
        with pytest.raises(DDUFReferenceError, match="changed after its tensors were verified"):
            complete.complete_archive(archive, out, quiet=True, model_dirs=[models])
    assert not out.exists()
    t5 = models / "diffusers" / "flux" / "text_encoder_2"
    shard = sorted(t5.glob("*-of-*.safetensors"))[0]
    state = load_file(shard)
    first = sorted(state)[0]
    state[first] = state[first] + 1
    shard.unlink()
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(DDUFReferenceError) as err:
        load_dduf(archive, model_dirs=[models])
    assert "text_encoder_2" in str(err.value) and "bytes differ" in str(err.value)
    files = resolve_component("transformer", _refs(archive)["transformer"], model_dirs=[models])
    shard = sorted((models / "diffusers" / "flux" / "transformer").glob("*-of-*.safetensors"))[0]
    shutil.copy(shard, shard.with_suffix(".new"))
    os.replace(shard.with_suffix(".new"), shard)  # another file in its place (here: the same bytes)
    with pytest.raises(DDUFReferenceError, match="changed since its tensors were verified"):
        files.tensors(files.weight_files())  # between the search and the load: refused, never read unverified


def _escaping_map(index: dict[str, Any]) -> Any:
    first = sorted(index["weight_map"])[0]
    return {"weight_map": {**index["weight_map"], first: "../../escape.safetensors"}}


@pytest.mark.parametrize("hostile", [_escaping_map, lambda index: {"weight_map": "not a map"},
                                     lambda index: "[" * 100_000], ids=["escaping", "not-a-map", "not-json"])
def test_a_hostile_shard_folder_is_a_candidate_less(base: Path, tmp_path: Path, hostile: Any) -> None:
    """A folder of shards whose index escapes, is not a map, or is not JSON: rejected with a reason, never read
    further, never a crash; a FIFO in the index's place is refused without blocking."""
    from dduf_plus.refs.shard_dirs import check_shard_folder

    folder = tmp_path / "models" / "diffusers" / "x" / "transformer"
    shutil.copytree(base / "transformer", folder)
    idx = next(folder.glob("*.index.json"))
    index = hostile(json.loads(idx.read_text()))
    idx.write_text(index if isinstance(index, str) else json.dumps(index))
    rec = _refs(_partial(base, tmp_path / "ft.dduf"))["transformer"][tensor_digest.RECORD_KEY]
    why = check_shard_folder(folder, rec)
    assert isinstance(why, str) and why.startswith(idx.name), why
    idx.unlink()
    os.mkfifo(idx)
    why = check_shard_folder(folder, rec)
    assert isinstance(why, str) and "not a regular file" in why, why


def test_a_shard_set_past_the_recorded_count_stops_reading(base: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder whose index has the recorded entry count but whose first shard holds more tensors than that:
    told apart after that one header (never every header of a hostile set)."""
    from dduf_plus.refs import shard_dirs

    folder = tmp_path / "models" / "diffusers" / "x" / "transformer"
    shutil.copytree(base / "transformer", folder)
    rec = _refs(_partial(base, tmp_path / "ft.dduf"))["transformer"][tensor_digest.RECORD_KEY]
    first = sorted(folder.glob("*-of-*.safetensors"))[0]
    first.unlink()
    save_file({f"t{i}": torch.zeros(1) for i in range(rec["count"] + 1)}, first)
    read: list[str] = []
    real = shard_dirs.read_file_header
    monkeypatch.setattr(shard_dirs, "read_file_header", lambda p, *a: (read.append(p.name), real(p, *a))[1])
    assert shard_dirs.check_shard_folder(folder, rec) == ""
    assert read == [first.name]
