"""LoRA archives: ``dduf pack LORA.safetensors --base BASE`` and ``save_dduf(pipe_with_adapters, base=BASE)`` store
the adapters and reference every component of BASE; ``load_dduf`` gives what diffusers gives for
``from_pretrained(BASE)`` + ``load_lora_weights(LORA)`` (same seed, 2 steps), per family and layout; adapters are
checked against BASE from headers; every reader accepts the archive."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_files import (
    FLUX_TARGETS,
    SMALL_FLUX,
    TE_TARGETS,
    UNET_TARGETS,
    diffusers_lora,
    fp32_copy,
    kohya_lora,
)
from safetensors.torch import save_file
from single_file_ckpt import build_tiny_flux, build_tiny_sd3, build_tiny_sdxl

from conftest import PIPELINES, npm_available, npm_check
from dduf_plus import load_dduf, save_dduf
from dduf_plus.errors import DDUFLoadError, DDUFPackError, DDUFValidationError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import validate
from dduf_plus.packing.lora import pack_lora, parse_lora_arg

pytest.importorskip("peft", reason="LoRA loading needs peft (the lora extra)")

TINY_SD = PIPELINES / "tiny-sd"
DDUF = [sys.executable, "-m", "dduf_plus.cli"]
KW = {"num_inference_steps": 2, "output_type": "np", "height": 32, "width": 32}


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora-sd")
    base = fp32_copy(TINY_SD, out / "sd")
    style = diffusers_lora(base, out / "style", {"unet": UNET_TARGETS, "text_encoder": TE_TARGETS})
    ink = kohya_lora(style, out / "ink.safetensors", {"unet": "lora_unet_", "text_encoder": "lora_te_"},
                     metadata={"ss_base_model_version": "sd_v1", "modelspec.title": "Ink",
                               "modelspec.trigger_phrase": "inkdrawing, lineart"})
    other = diffusers_lora(base, out / "other", {"unet": ["to_q", "to_v"]}, rank=2, alpha=1, seed=7)
    return {"base": base, "style": style, "ink": ink, "other": other, "dir": out}


def _theirs(base: Path, *loras: tuple[Path, str], **kwargs: Any) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32)
    for file, name in loras:
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
    return pipe


def _image(pipe: Any, **extra: Any) -> Any:
    return pipe("a cat", generator=torch.Generator().manual_seed(0), **KW, **extra).images


def _assert_same(ours: Any, theirs: Any, base: Path, **extra: Any) -> None:
    """Same images as diffusers, and not the base's: an adapter that changed nothing proves nothing."""
    x, y = _image(ours, **extra), _image(theirs, **extra)
    assert (x == y).all(), float(abs(x - y).max())
    plain = _image(_theirs(base), **extra)
    assert abs(x - plain).max() > 1e-4


def _pack(loras: list[Any], out: Path, base: Path) -> Path:
    pack_lora(loras, out, base=str(base), quiet=True)
    return out


def _assert_partial_of(archive: Path, base: Path) -> None:
    """Every model component of BASE referenced, none stored; only _lora/ and model_index.json inside."""
    with DDUFArchive(archive) as a:
        stored = {n.split("/")[0] for n in a.entries if "/" in n}
        refs = set(a.references)
        real = {n for n, c in a.components.items() if c.library is not None}
    assert stored == {"_lora"} and refs == real


# --- per family and layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_sd_lora_loads_as_diffusers_loads_it(sd: dict[str, Path], tmp_path: Path, layout: str) -> None:
    lora = sd["style"] if layout == "diffusers" else sd["ink"]
    archive = _pack([lora], tmp_path / "l.dduf", sd["base"])
    _assert_partial_of(archive, sd["base"])
    assert archive.stat().st_size <= lora.stat().st_size + 64 * 1024
    assert validate(archive).valid
    name = parse_lora_arg(lora).name
    _assert_same(load_dduf(archive), _theirs(sd["base"], (lora, name)), sd["base"])


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora-sdxl")
    base = build_tiny_sdxl(out / "sdxl", TINY_SD / "tokenizer")
    lora = diffusers_lora(base, out / "l", {"unet": UNET_TARGETS, "text_encoder": TE_TARGETS,
                                           "text_encoder_2": TE_TARGETS})
    kohya = kohya_lora(lora, out / "k.safetensors", {"unet": "lora_unet_", "text_encoder": "lora_te1_",
                                                     "text_encoder_2": "lora_te2_"},
                       metadata={"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"})
    return {"base": base, "diffusers": lora, "kohya": kohya}


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_sdxl_lora_loads_as_diffusers_loads_it(sdxl: dict[str, Path], tmp_path: Path, layout: str) -> None:
    lora = sdxl[layout]
    archive = _pack([lora], tmp_path / "l.dduf", sdxl["base"])
    _assert_partial_of(archive, sdxl["base"])
    with DDUFArchive(archive) as a:
        config = a.read_json("_lora/config.json")["adapters"][0]
    assert set(config["targets"]) == {"unet", "text_encoder", "text_encoder_2"}
    _assert_same(load_dduf(archive), _theirs(sdxl["base"], (lora, parse_lora_arg(lora).name)), sdxl["base"])


def test_sd3_lora_loads_as_diffusers_loads_it(tmp_path: Path) -> None:
    base = build_tiny_sd3(tmp_path / "sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer", num_layers=2)
    lora = diffusers_lora(base, tmp_path / "l", {"transformer": ["to_q", "to_k", "to_v", "add_q_proj"]})
    archive = _pack([lora], tmp_path / "l.dduf", base)
    _assert_partial_of(archive, base)
    _assert_same(load_dduf(archive), _theirs(base, (lora, "pytorch_lora_weights")), base)


def test_flux_lora_loads_as_diffusers_loads_it(tmp_path: Path) -> None:
    base = build_tiny_flux(tmp_path / "flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer",
                           dtype=torch.float32, transformer_config=SMALL_FLUX)
    lora = diffusers_lora(base, tmp_path / "l", {"transformer": FLUX_TARGETS}, dtype=torch.bfloat16)
    archive = _pack([f"flux_style={lora}"], tmp_path / "l.dduf", base)
    _assert_partial_of(archive, base)
    _assert_same(load_dduf(archive), _theirs(base, (lora, "flux_style")), base, guidance_scale=3.5)


@pytest.mark.parametrize("base_kind", ["hub", "dduf"])
def test_base_from_the_hf_cache_or_an_archive(sd: dict[str, Path], hf_env: Path, tmp_path: Path,
                                              base_kind: str) -> None:
    """BASE as a Hub repo id (its snapshot in the Hugging Face cache; offline) or as a .dduf: the references name
    it, the load resolves it from there, and equals diffusers with the same adapter on the same base."""
    from hfcache import cached

    from dduf_plus.packing.pack import pack

    if base_kind == "hub":
        cached(hf_env, sd["base"], "org/tiny-sd-fp32")
        spec = "org/tiny-sd-fp32"
    else:
        spec = str(pack(sd["base"], tmp_path / "base.dduf", quiet=True)[0].path)
    archive = tmp_path / "l.dduf"
    pack_lora([f"ink={sd['ink']}"], archive, base=spec, quiet=True)
    with DDUFArchive(archive) as a:
        sources = {r["pretrained_model_name_or_path"] for r in a.references.values()}
    assert sources == {spec}
    x = _image(load_dduf(archive))
    assert (x == _image(_theirs(sd["base"], (sd["ink"], "ink")))).all()


# --- names, weights, several adapters, fusing ------------------------------------------------------------
@pytest.fixture(scope="module")
def two(sd: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two") / "two.dduf"
    return _pack([f"style={sd['style']}@0.7", f"ink={sd['ink']}@0.4"], out, sd["base"])


def test_several_adapters_each_with_its_weight(sd: dict[str, Path], two: Path) -> None:
    theirs = _theirs(sd["base"], (sd["style"], "style"), (sd["ink"], "ink"))
    theirs.set_adapters(["style", "ink"], adapter_weights=[0.7, 0.4])
    ours = load_dduf(two)
    assert ours.get_active_adapters() == ["style", "ink"]
    _assert_same(ours, theirs, sd["base"])


def test_weights_overridden_and_adapters_chosen(sd: dict[str, Path], two: Path) -> None:
    theirs = _theirs(sd["base"], (sd["style"], "style"), (sd["ink"], "ink"))
    theirs.set_adapters(["style", "ink"], adapter_weights=[0.2, 1.0])
    ours = load_dduf(two, adapter_weights={"style": 0.2, "ink": 1.0})
    assert (_image(ours) == _image(theirs)).all()
    only = load_dduf(two, adapters=["ink"])
    assert only.get_list_adapters()["unet"] == ["ink"]
    theirs_ink = _theirs(sd["base"], (sd["ink"], "ink"))
    theirs_ink.set_adapters(["ink"], adapter_weights=[0.4])
    assert (_image(only) == _image(theirs_ink)).all()
    none = load_dduf(two, adapters=False)
    assert not hasattr(none.unet, "peft_config")
    assert (_image(none) == _image(_theirs(sd["base"]))).all()
    with pytest.raises(DDUFLoadError, match="'inq'.*style, ink"):
        load_dduf(two, adapters=["inq"])
    with pytest.raises(DDUFLoadError, match="adapter_weights names 'styel'"):
        load_dduf(two, adapter_weights={"styel": 1.0})


def test_fused_equals_diffusers_fused(sd: dict[str, Path], two: Path) -> None:
    theirs = _theirs(sd["base"], (sd["style"], "style"), (sd["ink"], "ink"))
    theirs.set_adapters(["style", "ink"], adapter_weights=[0.7, 0.4])
    theirs.fuse_lora(adapter_names=["style", "ink"])
    theirs.unload_lora_weights()
    ours = load_dduf(two, fuse_lora=True)
    assert not any("lora" in k for k in ours.unet.state_dict())
    x, y = _image(ours), _image(theirs)
    assert (x == y).all(), float(abs(x - y).max())


def test_save_dduf_writes_the_pipelines_adapters(sd: dict[str, Path], tmp_path: Path) -> None:
    pipe = _theirs(sd["base"], (sd["style"], "style"), (sd["ink"], "ink"))
    pipe.set_adapters(["style", "ink"], adapter_weights=[0.7, 0.4])
    with pytest.raises(DDUFPackError, match="LoRA adapters.*base="):
        save_dduf(pipe, tmp_path / "no-base.dduf")
    out = save_dduf(pipe, tmp_path / "saved.dduf", base=str(sd["base"]), quiet=True).path
    _assert_partial_of(out, sd["base"])
    assert validate(out).valid
    ours = load_dduf(out)
    assert ours.get_active_adapters() == ["style", "ink"]
    _assert_same(ours, pipe, sd["base"])


# --- every reader accepts it -----------------------------------------------------------------------------
def test_every_reader_accepts_a_lora_archive(two: Path) -> None:
    from huggingface_hub import read_dduf_file

    entries = read_dduf_file(two)
    assert "_lora/config.json" in entries and "_lora/style.safetensors" in entries
    with zipfile.ZipFile(two) as zf:
        assert zf.testzip() is None
    if shutil.which("unzip"):
        assert subprocess.run(["unzip", "-tq", str(two)], capture_output=True).returncode == 0
    if npm_available():
        result = npm_check(two)
        assert result is not None and result.returncode == 0, result.stderr
        assert "_lora/style.safetensors" in json.loads(result.stdout)


def test_the_adapter_file_is_stored_byte_for_byte_and_aligned(sd: dict[str, Path], two: Path) -> None:
    with DDUFArchive(two) as a:
        assert bytes(a.view("_lora/ink.safetensors")) == sd["ink"].read_bytes()
        e, header = a.entry("_lora/ink.safetensors"), a.headers["_lora/ink.safetensors"]
        assert (e.offset + header.data_start) % 4096 == 0


def test_info_shows_adapters_targets_and_trainer_metadata(two: Path) -> None:
    from dduf_plus.format.describe import describe

    adapters = {a["name"]: a for a in describe(two)["adapters"]}
    assert adapters["ink"]["weight"] == 0.4 and adapters["ink"]["layout"] == "kohya"
    assert adapters["ink"]["targets"]["unet"]["ranks"] == [4]
    assert adapters["ink"]["metadata"]["modelspec.title"] == "Ink"
    assert adapters["ink"]["trigger_words"] == ["inkdrawing", "lineart"]
    out = subprocess.run([*DDUF, "info", str(two)], capture_output=True, text=True)
    assert "adapter ink (kohya" in out.stdout and "trigger words: inkdrawing, lineart" in out.stdout


def test_cli_packs_a_lora_with_more_adapters(sd: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cli.dduf"
    result = subprocess.run([*DDUF, "pack", f"ink={sd['ink']}@0.5", "--lora", str(sd["other"]),
                             "--base", str(sd["base"]), "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "adapter ink (kohya" in result.stderr and "wrote " in result.stdout  # the report once, on stderr
    with DDUFArchive(out) as a:
        config = a.read_json("_lora/config.json")["adapters"]
    assert [(c["name"], c["weight"]) for c in config] == [("ink", 0.5), ("pytorch_lora_weights", 1.0)]
    bad = subprocess.run([*DDUF, "pack", str(sd["ink"]), "-o", str(tmp_path / "x.dduf")], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "--base" in bad.stderr


# --- hostile adapters: checked against BASE before anything is written ----------------------------------
def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file(tensors, path, metadata=metadata)
    return path


def test_pack_refuses_adapters_that_do_not_fit_base(sd: dict[str, Path], sdxl: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "x.dduf"
    cases = {
        "A005": sdxl["kohya"],  # lora_te2_ against SD 1.5
        "A006": _write(tmp_path / "wide.safetensors", {  # in-features 64, the base's to_q takes 32
            "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 64),
            "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.ones(32, 4)}),
        "A003": _write(tmp_path / "rank.safetensors", {"lora_unet_mid.lora_down.weight": torch.ones(4, 8),
                                                        "lora_unet_mid.lora_up.weight": torch.ones(8, 2)}),
        "A004": _write(tmp_path / "alpha.safetensors", {"lora_unet_mid.lora_down.weight": torch.ones(4, 8),
                                                         "lora_unet_mid.lora_up.weight": torch.ones(8, 4),
                                                         "lora_unet_mid.alpha": torch.tensor(float("inf"))}),
    }
    for code, lora in cases.items():
        with pytest.raises(DDUFPackError, match=code):
            pack_lora([lora], out, base=str(sd["base"]), quiet=True)
        assert not out.exists()
    missing = _write(tmp_path / "nomod.safetensors", {"unet.no_such.lora_A.weight": torch.ones(4, 8),
                                                      "unet.no_such.lora_B.weight": torch.ones(8, 4)})
    with pytest.raises(DDUFPackError, match="A006 module 'unet.no_such' is not in BASE"):
        pack_lora([missing], out, base=str(sd["base"]), quiet=True)
    with pytest.raises(DDUFPackError, match="two adapters are named 'ink'"):
        pack_lora([sd["ink"], f"ink={sd['style']}"], out, base=str(sd["base"]), quiet=True)


def test_metadata_naming_another_family_is_said(sd: dict[str, Path], sdxl: dict[str, Path], tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    xl = tmp_path / "xl.safetensors"
    shutil.copyfile(sd["style"], xl)
    tagged = _write(tmp_path / "tagged.safetensors", dict(_tensors(sd["ink"])),
                    {"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"})
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        pack_lora([tagged], tmp_path / "t.dduf", base=str(sd["base"]), quiet=True)
    assert any("A007" in r.getMessage() and "sdxl" in r.getMessage() for r in caplog.records)
    assert "A007" in validate(tmp_path / "t.dduf").codes


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_loader_refuses_a_forged_adapter_with_the_rule(two: Path, tmp_path: Path) -> None:
    """An archive whose adapter's alpha was made NaN after packing: validate and load_dduf say A004."""
    forged = tmp_path / "forged.dduf"
    data = bytearray(two.read_bytes())
    with DDUFArchive(two) as a:
        header = a.headers["_lora/ink.safetensors"]
        name = next(k for k in header.tensors if k.endswith(".alpha"))
        info = header.tensors[name]
        at = a.entry("_lora/ink.safetensors").offset + header.data_start + info.begin
    data[at: at + 4] = struct.pack("<f", float("nan"))
    forged.write_bytes(bytes(data))
    assert "A004" in validate(forged).codes
    with pytest.raises(DDUFValidationError, match="A004"):  # refused before anything is built
        load_dduf(forged, verify=False)


def test_info_describes_a_lora_file_and_checks_it_against_a_base(sd: dict[str, Path], sdxl: dict[str, Path]) -> None:
    out = subprocess.run([*DDUF, "info", str(sd["ink"])], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "LoRA adapter (168 tensors" in out.stdout and "ss_base_model_version: sd_v1" in out.stdout
    fits = subprocess.run([*DDUF, "info", str(sd["ink"]), "--base", str(sd["base"])], capture_output=True, text=True)
    assert fits.returncode == 0 and "fits --base" in fits.stdout, fits.stderr
    wrong = subprocess.run([*DDUF, "info", str(sd["ink"]), "--base", str(sdxl["base"])], capture_output=True, text=True)
    assert wrong.returncode == 1 and "A006" in wrong.stderr


def test_serve_page_shows_adapters(two: Path) -> None:
    from dduf_plus.format.describe import describe
    from dduf_plus.serve.page import render_result

    html = render_result({"files": [validate(two).as_dict()], "info": describe(two)})
    assert "<caption>LoRA adapters</caption>" in html
    assert "ink" in html and "unet: 48 modules, rank 4" in html and "trigger words: inkdrawing, lineart" in html
    script = (Path(__file__).resolve().parent.parent / "dduf_plus" / "serve" / "static" / "app.js").read_text()
    assert "LoRA adapters" in script and "adapterTargets" in script  # the page's own rendering says the same


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_an_adapter_exports_in_kohya_layout_that_diffusers_reads_alike(sd: dict[str, Path], sdxl: dict[str, Path],
                                                                      tmp_path: Path, family: str) -> None:
    """The off-ramp: a diffusers-layout adapter written as lora_unet_/lora_te*_ with .alpha (A1111, ComfyUI,
    Forge read it); diffusers' load of it gives the same images as of the original file."""
    from dduf_plus.format.lora_export import export_adapter

    fixture = sd if family == "sd" else sdxl
    lora = fixture["style"] if family == "sd" else fixture["diffusers"]
    archive = _pack([f"a={lora}"], tmp_path / "l.dduf", fixture["base"])
    out = tmp_path / "exported.safetensors"
    with DDUFArchive(archive) as a:
        export_adapter(a, None, out)
    keys = set(_tensors(out))
    assert all(k.startswith(("lora_unet_", "lora_te")) for k in keys)
    assert any(k.startswith("lora_te1_text_model_" if family == "sdxl" else "lora_te_text_model_") for k in keys)
    assert sum(k.endswith(".alpha") for k in keys) * 3 == len(keys)
    x = _image(_theirs(fixture["base"], (out, "a")))
    assert (x == _image(_theirs(fixture["base"], (lora, "a")))).all()


@pytest.mark.parametrize("which", ["style", "ink"])  # renamed to kohya / copied as stored (already kohya)
def test_an_adapter_export_never_writes_through_a_planted_link(sd: dict[str, Path], tmp_path: Path,
                                                               which: str) -> None:
    """Failed on 0.12.0: it wrote through a fixed temporary name ``.OUT.tmp``, so a link planted there made the
    export overwrite the link's target (here a victim file). Now the temporary file is created exclusively; a
    failed export leaves no file."""
    from dduf_plus.format.lora_export import export_adapter

    archive = _pack([f"a={sd[which]}"], tmp_path / "l.dduf", sd["base"])
    victim, out = tmp_path / "victim.txt", tmp_path / "exported.safetensors"
    victim.write_text("keep")
    (tmp_path / ".exported.safetensors.tmp").symlink_to(victim)
    with DDUFArchive(archive) as a:
        export_adapter(a, None, out)
        assert victim.read_text() == "keep" and set(_tensors(out))
        before = sorted(p.name for p in tmp_path.iterdir())
        real = a.read_bytes
        a.read_bytes = lambda *args: (_ for _ in ()).throw(OSError("disk gone"))  # type: ignore[method-assign]
        with pytest.raises(OSError, match="disk gone"):
            export_adapter(a, None, tmp_path / "second.safetensors")
        a.read_bytes = real  # type: ignore[method-assign]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli_exports_an_adapter(two: Path, sd: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ink.safetensors"
    done = subprocess.run([*DDUF, "export", str(two), "--adapter", "ink", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == sd["ink"].read_bytes()  # a kohya adapter is written as stored
    several = subprocess.run([*DDUF, "export", str(two), "-o", str(tmp_path / "x.safetensors")], capture_output=True,
                             text=True)
    assert several.returncode == 1 and "name one with --adapter" in several.stderr
