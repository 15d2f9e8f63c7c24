"""Single-file checkpoints in: ``pack(CKPT.safetensors, OUT, base=BASE)`` and ``dduf info CKPT``.

Tiny checkpoints in the original LDM / SGM layout are made here from diffusers pipelines (tests/single_file_ckpt.py),
no downloads; the archive must load equal, tensor for tensor and image for image, to diffusers' own
``from_single_file(CKPT, config=BASE, torch_dtype=<the checkpoint's dtype>)``."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from single_file_ckpt import (
    build_tiny_sd2,
    build_tiny_sdxl,
    build_tiny_sdxl_refiner,
    checkpoint_from_pipeline,
    clip_to_ldm,
    open_clip_to_ldm,
    unet_to_ldm,
    vae_to_ldm,
)

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFPackError
from dduf_plus.packing.single_file import describe_checkpoint, pack_single_file

TINY_SD = PIPELINES / "tiny-sd"


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(state, path)
    return path


@pytest.fixture(scope="session")
def sf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny SDXL base (fp32 and fp16 variant files; a copy without the variant) and three checkpoints:
    SD 1.x fine-tune (fp32, UNet changed), SD 1.x unet-only, SDXL fine-tune (fp16, every component, UNet changed)."""
    out = tmp_path_factory.mktemp("single-file")
    sdxl = build_tiny_sdxl(out / "tiny-sdxl", TINY_SD / "tokenizer")
    return {
        "sdxl_base": sdxl,
        "sd1": _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, dtype=torch.float32), out / "sd1.safetensors"),
        "sd1_unet": _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",)),
                          out / "sd1-unet.safetensors"),
        "sdxl": _save(checkpoint_from_pipeline(sdxl, "xl_base", unet_delta=0.01, dtype=torch.float16),
                      out / "sdxl.safetensors"),
        "sdxl_base_fp32_only": shutil.copytree(sdxl, out / "tiny-sdxl-fp32", ignore=shutil.ignore_patterns("*.fp16.*")),
    }


@pytest.fixture(scope="session")
def sf_more(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD 2.x and SDXL refiner bases, and a checkpoint of each: SD 2.x fp32 with the UNet changed,
    refiner fp16 (every weight stored against the fp32 base)."""
    out = tmp_path_factory.mktemp("single-file-more")
    sd2 = build_tiny_sd2(out / "tiny-sd2", TINY_SD / "tokenizer")
    refiner = build_tiny_sdxl_refiner(out / "tiny-sdxl-refiner", TINY_SD / "tokenizer")
    return {
        "sd2_base": sd2, "refiner_base": refiner,
        "sd2": _save(checkpoint_from_pipeline(sd2, "v2", unet_delta=0.01), out / "sd2.safetensors"),
        "refiner": _save(checkpoint_from_pipeline(refiner, "xl_refiner", dtype=torch.float16),
                         out / "refiner.safetensors"),
    }


def _state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((folder / name).glob("*.safetensors")):
        if f.name.count(".") == 1:
            out.update(load_file(f))
    return out


def _config(folder: Path, name: str) -> dict:
    return json.loads((folder / name / "config.json").read_text())


def test_reverse_mapping_round_trips_through_diffusers(sf: dict[str, Path]) -> None:
    """The fixtures' original-layout keys are the ones diffusers' forward conversion maps back exactly."""
    from diffusers.loaders import single_file_utils as sfu

    for folder in (TINY_SD, sf["sdxl_base"]):
        for name, to_ldm, convert in (("unet", unet_to_ldm, sfu.convert_ldm_unet_checkpoint),
                                      ("vae", vae_to_ldm, sfu.convert_ldm_vae_checkpoint)):
            state, config = _state(folder, name), _config(folder, name)
            back = convert(to_ldm(state, config), config)
            assert back.keys() == state.keys(), (folder.name, name, set(back) ^ set(state))
            assert all(torch.equal(back[k], state[k]) for k in state)
    clip = _state(TINY_SD, "text_encoder")
    back = sfu.convert_ldm_clip_checkpoint(clip_to_ldm(clip, "cond_stage_model.transformer."))
    assert {k.removeprefix("text_model.") for k in back} == set(clip) | {"embeddings.position_ids"}
    big = _state(sf["sdxl_base"], "text_encoder_2")
    model = type("M", (), {"config": type("C", (), {"hidden_size": 24})})()
    back = sfu.convert_open_clip_checkpoint(model, open_clip_to_ldm(big, "conditioner.embedders.1.model."),
                                            prefix="conditioner.embedders.1.model.")
    assert back.keys() == big.keys() and all(torch.equal(back[k], big[k]) for k in big)


def _assert_equal_pipelines(archive: Path, ckpt: Path, base: Path, cls_name: str, dtype: torch.dtype,
                            call: dict | None = None) -> None:
    """Every component tensor for tensor (names, dtypes, values) and one inference step, image for image."""
    import diffusers

    from dduf_plus import load_dduf

    ours = load_dduf(archive)
    theirs = getattr(diffusers, cls_name).from_single_file(str(ckpt), config=str(base), torch_dtype=dtype,
                                                           local_files_only=True)
    checked = 0
    for name, component in ours.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        mine, other = component.state_dict(), getattr(theirs, name).state_dict()
        assert mine.keys() == other.keys(), name
        for k in mine:
            assert mine[k].dtype == other[k].dtype == dtype and torch.equal(mine[k], other[k]), (name, k)
        checked += 1
    assert checked >= 3
    kwargs = call or {"prompt": "a red fox", "num_inference_steps": 1, "height": 32, "width": 32, "output_type": "np"}
    a = ours(generator=torch.Generator().manual_seed(0), **kwargs).images
    b = theirs(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert a.shape == b.shape and (a == b).all()


def test_sd1_checkpoint_packs_partial_and_equals_from_single_file(sf: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sd1.dduf"
    result, partial = pack_single_file(sf["sd1"], out, base=str(TINY_SD), quiet=True)
    report = "\n".join(partial.report)
    assert "detected SD 1.x (v1)" in report
    assert "unet: converted" in report and "stored" in report
    # fp32 checkpoint: vae and text encoder are BASE's tensors (BASE's fp32 files) -> references
    assert set(partial.references) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    assert "embeddings.position_ids" in report  # dropped, as from_single_file drops it
    assert result.bytes_written < sf["sd1"].stat().st_size
    _assert_equal_pipelines(out, sf["sd1"], TINY_SD, "StableDiffusionPipeline", torch.float32)


def test_sdxl_checkpoint_equals_from_single_file(sf: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sdxl.dduf"
    _result, partial = pack_single_file(sf["sdxl"], out, base=str(sf["sdxl_base"]), quiet=True)
    assert "detected SDXL base (xl_base)" in partial.report[0]
    # fp16: the encoders and the VAE are BASE's fp16 variant files, referenced as such; the UNet is stored
    refs = partial.references
    assert set(refs) == {"vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"}
    for name in ("vae", "text_encoder", "text_encoder_2"):
        assert refs[name]["variant"] == "fp16" and any(".fp16." in f for f in refs[name]["files"]), refs[name]
        assert not any(f.endswith(".safetensors") and ".fp16." not in f for f in refs[name]["files"])
    assert "identical to BASE's fp16 variant" in "\n".join(partial.report)
    _assert_equal_pipelines(out, sf["sdxl"], sf["sdxl_base"], "StableDiffusionXLPipeline", torch.float16)


def test_output_is_deterministic_and_fp32_base_stores_fp16_weights(sf: dict[str, Path], tmp_path: Path) -> None:
    base = str(sf["sdxl_base_fp32_only"])
    a, partial = pack_single_file(sf["sdxl"], tmp_path / "a.dduf", base=base, quiet=True, fsync=False)
    b, _ = pack_single_file(sf["sdxl"], tmp_path / "b.dduf", base=base, quiet=True, fsync=False)
    assert a.path.read_bytes() == b.path.read_bytes()
    # fp16 against a base with fp32 files only: every weight differs (dtype); tokenizers, scheduler referenced
    assert set(partial.references) == {"tokenizer", "tokenizer_2", "scheduler"}
    assert "is float16 here, float32 in BASE" in "\n".join(partial.report)


def test_unet_only_checkpoint_references_the_rest(sf: dict[str, Path], tmp_path: Path) -> None:
    from dduf_plus import load_dduf

    out = tmp_path / "unet.dduf"
    _result, partial = pack_single_file(sf["sd1_unet"], out, base=str(TINY_SD), quiet=True)
    assert "not text_encoder, vae" in partial.report[0]
    assert set(partial.references) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    pipe = load_dduf(out)
    unet = _state(TINY_SD, "unet")
    assert all(torch.equal(pipe.unet.state_dict()[k], v + 0.01) for k, v in unet.items())


def _refused(ckpt: Path, base: Path, out: Path, *words: str) -> str:
    with pytest.raises(DDUFPackError) as e:
        pack_single_file(ckpt, out, base=str(base), quiet=True)
    text = str(e.value)
    assert all(w in text for w in words), text
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(out.name)]
    return text


def test_family_mismatch_with_base_is_refused(sf: dict[str, Path], tmp_path: Path) -> None:
    _refused(sf["sdxl"], TINY_SD, tmp_path / "x.dduf", "SDXL base checkpoint", "StableDiffusionPipeline",
             "SD 1.x")
    _refused(sf["sd1"], sf["sdxl_base"], tmp_path / "y.dduf", "SD 1.x checkpoint", "StableDiffusionXLPipeline")


def test_shapes_that_do_not_fit_base_are_refused(tmp_path: Path) -> None:
    state = checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01)
    key = "model.diffusion_model.input_blocks.0.0.weight"
    wide = dict(state, **{key: torch.zeros(24, *state[key].shape[1:], dtype=state[key].dtype)})
    _refused(_save(wide, tmp_path / "wide.safetensors"), TINY_SD, tmp_path / "w.dduf", "conv_in.weight", "[24,")
    short = {k: v for k, v in state.items() if k != "first_stage_model.decoder.conv_in.bias"}
    _refused(_save(short, tmp_path / "short.safetensors"), TINY_SD, tmp_path / "s.dduf", "vae",
             "decoder.conv_in.bias", "not in the checkpoint")


def test_scaled_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    """Scaled fp8 (diffusers loads it unscaled) is refused; plain fp8 packs (tests/test_single_file_sd3.py)."""
    state = checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",))
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in state.items()}
    fp8["model.diffusion_model.out.2.scale_weight"] = torch.ones(())
    _refused(_save(fp8, tmp_path / "fp8.safetensors"), TINY_SD, tmp_path / "f.dduf", "scaled-fp8",
             "out.2.scale_weight")


def test_checkpoint_identical_to_base_is_refused(tmp_path: Path) -> None:
    same = checkpoint_from_pipeline(TINY_SD, "v1")  # BASE's own tensors and dtypes
    _refused(_save(same, tmp_path / "same.safetensors"), TINY_SD, tmp_path / "s.dduf", "identical to --base")


def test_unknown_and_unsupported_architectures(tmp_path: Path) -> None:
    unknown = _save({"foo.weight": torch.zeros(2)}, tmp_path / "foo.safetensors")
    _refused(unknown, TINY_SD, tmp_path / "u.dduf", "unknown architecture", "foo")
    # FLUX.2 (diffusers' flux-2-dev): detected by diffusers, not converted (FLUX.1: tests/test_single_file_flux.py)
    flux = _save({"single_stream_modulation.lin.weight": torch.zeros(2)}, tmp_path / "flux.safetensors")
    _refused(flux, TINY_SD, tmp_path / "f.dduf", "'flux", "does not convert yet")
    for path in (unknown, flux):
        info = describe_checkpoint(path)
        assert info["architecture"] is None and "unknown architecture" in info["problem"]


def test_quick_detection_agrees_with_diffusers(sf: dict[str, Path], tmp_path: Path) -> None:
    """dduf info's torch-free detection names what diffusers' infer_diffusers_model_type names."""
    from dduf_plus.packing.single_file import detect_architecture, quick_architecture, read_checkpoint_header

    for name in ("sd1", "sd1_unet", "sdxl"):
        header = read_checkpoint_header(sf[name])
        assert quick_architecture(header) == detect_architecture(header) in ("v1", "xl_base")
    v2 = _save({"model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight": torch.zeros(4, 1024)},
               tmp_path / "v2.safetensors")
    inpaint = _save({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 9, 1, 1)},
                    tmp_path / "inpaint.safetensors")
    assert quick_architecture(read_checkpoint_header(v2)) == detect_architecture(read_checkpoint_header(v2)) == "v2"
    assert quick_architecture(read_checkpoint_header(inpaint)) is None
    assert detect_architecture(read_checkpoint_header(inpaint)) == "inpainting"


def test_info_on_a_checkpoint_imports_no_torch(sf: dict[str, Path]) -> None:
    import subprocess
    import sys

    code = ("import sys; from dduf_plus.cli import main; rc = main(['info', sys.argv[1], '--json']); "
            "assert rc == 0; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code, str(sf["sdxl"])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["architecture"] == "xl_base"


def test_truncated_and_hostile_files_are_refused(sf: dict[str, Path], tmp_path: Path) -> None:
    data = sf["sd1"].read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    _refused(cut, TINY_SD, tmp_path / "c.dduf", "not a valid safetensors file")
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(huge, TINY_SD, tmp_path / "h.dduf", "header length")
    deep = tmp_path / "deep.safetensors"
    raw = b"[" * 5000 + b"]" * 5000
    deep.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _refused(deep, TINY_SD, tmp_path / "d.dduf", "not a valid safetensors file")


def test_no_base_is_refused(sf: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DDUFError, match="--base"):
        pack_single_file(sf["sd1"], tmp_path / "n.dduf", base=None)


def test_describe_checkpoint(sf: dict[str, Path]) -> None:
    info = describe_checkpoint(sf["sdxl"])
    assert info["architecture"] == "xl_base" and info["pipeline"] == "StableDiffusionXLPipeline"
    assert set(info["components"]) == {"unet", "vae", "text_encoder", "text_encoder_2"}
    te = info["components"]["text_encoder"]
    assert te["dtype"] == "float16" and te["dtypes"]["int64"] == 77 * 8  # position_ids
    assert sum(c["bytes"] for c in info["components"].values()) + 8 < sf["sdxl"].stat().st_size


def test_pack_entry_point_and_cli(sf: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus import pack
    from dduf_plus.cli import main

    result, partial = pack(sf["sd1"], tmp_path / "api.dduf", base=str(TINY_SD), quiet=True)
    assert result.path.is_file() and "vae" in partial.references
    out = tmp_path / "cli.dduf"
    assert main(["pack", str(sf["sd1"]), "--base", str(TINY_SD), "-o", str(out), "-q"]) == 0
    assert out.read_bytes() == result.path.read_bytes()
    assert main(["pack", str(sf["sd1"]), "-o", str(tmp_path / "nobase.dduf")]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["info", str(sf["sdxl"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["architecture"] == "xl_base" and "text_encoder_2" in shown["components"]
    assert main(["info", str(sf["sdxl"])]) == 0
    text = capsys.readouterr().out
    assert "SDXL base" in text and "text_encoder_2" in text and os.path.basename(sf["sdxl"]) in text


def test_hub_repo_as_base_offline_from_the_cache(sf: dict[str, Path], tmp_path: Path, hf_env: Path) -> None:
    """BASE as ``org/repo``: configs and tensors from the cached snapshot, references to the repo at its commit."""
    from hfcache import REPO, cached

    from dduf_plus import load_dduf

    snapshot = cached(hf_env)
    out = tmp_path / "hub.dduf"
    _result, partial = pack_single_file(sf["sd1"], out, base=REPO, quiet=True)
    for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
        ref = partial.references[name]
        assert ref["pretrained_model_name_or_path"] == REPO and ref["revision"] == snapshot.name, ref
    pipe = load_dduf(out)
    vae = _state(TINY_SD, "vae")
    assert all(torch.equal(pipe.vae.state_dict()[k], v) for k, v in vae.items())
    with pytest.raises(DDUFError, match="org/absent"):
        pack_single_file(sf["sd1"], tmp_path / "absent.dduf", base="org/absent", quiet=True)


def test_sd2_checkpoint_equals_from_single_file(sf_more: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sd2.dduf"
    _result, partial = pack_single_file(sf_more["sd2"], out, base=str(sf_more["sd2_base"]), quiet=True)
    report = "\n".join(partial.report)
    assert "detected SD 2.x (v2)" in report  # (its text_projection: ignored by diffusers' SD 2 converter itself)
    # the OpenCLIP encoder's q/k/v, split out of in_proj, are BASE's bytes: referenced
    assert set(partial.references) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    _assert_equal_pipelines(out, sf_more["sd2"], sf_more["sd2_base"], "StableDiffusionPipeline", torch.float32)


def test_sdxl_refiner_checkpoint_equals_from_single_file(sf_more: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "refiner.dduf"
    _result, partial = pack_single_file(sf_more["refiner"], out, base=str(sf_more["refiner_base"]), quiet=True)
    assert "detected SDXL refiner (xl_refiner)" in partial.report[0]
    assert set(partial.references) == {"tokenizer_2", "scheduler"}
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    call = {"prompt": "a red fox", "image": image, "num_inference_steps": 2, "strength": 0.5, "output_type": "np"}
    _assert_equal_pipelines(out, sf_more["refiner"], sf_more["refiner_base"], "StableDiffusionXLImg2ImgPipeline",
                            torch.float16, call)
    with pytest.raises(DDUFPackError, match="SDXL refiner checkpoint"):
        pack_single_file(sf_more["refiner"], tmp_path / "x.dduf", base=str(TINY_SD), quiet=True)


def test_info_with_base_says_what_a_pack_would_store(sf: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus.cli import main

    assert main(["info", str(sf["sdxl"]), "--base", str(sf["sdxl_base"]), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["pack_plan"]
    assert list(plan["stored"]) == ["unet"] and plan["stored"]["unet"] > 0
    assert plan["referenced"] == {"scheduler": None, "text_encoder": "fp16", "text_encoder_2": "fp16",
                                  "tokenizer": None, "tokenizer_2": None, "vae": "fp16"}
    assert main(["info", str(sf["sdxl"]), "--base", str(sf["sdxl_base"])]) == 0
    text = capsys.readouterr().out
    assert "would store: unet" in text and "vae (fp16 variant)" in text
    assert not list(tmp_path.iterdir())
    assert main(["info", str(TINY_SD), "--base", str(TINY_SD)]) == 2


def test_keys_diffusers_cannot_map_are_one_clear_error(sf: dict[str, Path], tmp_path: Path) -> None:
    """diffusers' converter raising on a crafted file (a KeyError deep in convert_ldm_unet_checkpoint) is a
    DDUFPackError naming the component, not a traceback."""
    from safetensors.torch import load_file

    state = load_file(sf["sdxl"])
    del state["model.diffusion_model.label_emb.0.0.weight"]
    _refused(_save(state, tmp_path / "nolabel.safetensors"), sf["sdxl_base"], tmp_path / "n.dduf",
             "unet cannot be converted to diffusers' layout", "KeyError")


def test_dduf_archive_as_base(sf: dict[str, Path], tmp_path: Path, packed: dict[str, Path]) -> None:
    """BASE as a local .dduf: configs and tensors read from the archive, references to it."""
    from dduf_plus import load_dduf

    base = packed["tiny-sd"]
    out = tmp_path / "on-archive.dduf"
    _result, partial = pack_single_file(sf["sd1"], out, base=str(base), quiet=True)
    assert set(partial.references) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    assert all(r["pretrained_model_name_or_path"] == str(base) for r in partial.references.values())
    pipe = load_dduf(out)
    unet = _state(TINY_SD, "unet")
    assert all(torch.equal(pipe.unet.state_dict()[k], (v + 0.01).float()) for k, v in unet.items())
    assert all(torch.equal(pipe.vae.state_dict()[k], v) for k, v in _state(TINY_SD, "vae").items())
    with pytest.raises(DDUFPackError, match="SD 1.x checkpoint"):
        pack_single_file(sf["sd1"], tmp_path / "x.dduf", base=str(packed["tiny-dit"]), quiet=True)


def test_inspect_dtypes_answers_for_a_single_file_like_the_folder(sf: dict[str, Path]) -> None:
    """inspect_dtypes(CKPT) names the components the file holds by diffusers' names, with the same dtype,
    parameter count and bytes as the same weights saved as a folder (the SDXL base's fp16 variant: the
    checkpoint is that pipeline in fp16, its UNet nudged)."""
    from dduf_plus import inspect_dtypes

    mine = inspect_dtypes(sf["sdxl"])
    folder = inspect_dtypes(sf["sdxl_base"], variant="fp16")
    assert set(mine) == {"unet", "vae", "text_encoder", "text_encoder_2"}
    for name in ("unet", "vae"):
        assert mine[name] == folder[name], name
    for name in ("text_encoder", "text_encoder_2"):  # the layout keeps buffers transformers drops (position_ids)
        assert mine[name]["dtype"] == folder[name]["dtype"] == "float16", name
    with pytest.raises(DDUFError, match="unknown architecture|not an"):
        inspect_dtypes(_save({"foo.weight": torch.zeros(2)}, sf["sdxl"].parent / "odd.safetensors"))
