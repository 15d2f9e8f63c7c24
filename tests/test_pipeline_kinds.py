"""Pipeline kinds whose folder layout is not one folder per model_index.json component (docs/loading.md,
"Pipeline kinds"): lists of models (Multi-ControlNet SD and SDXL: text-to-image, img2img, inpaint;
Multi-Adapter), a guider component (config under ``guider_config.json``), a component model_index.json names
but ``save_pretrained`` does not write. Each: tiny seeded pipeline saved by diffusers, ``dduf pack``,
validation (dduf_plus and huggingface_hub's reader), ``load_dduf`` equal to ``from_pretrained(folder)`` tensor
for tensor and in a 2-step output, ``save_dduf`` of the loaded pipeline, ``dduf info``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import PIPELINES
from dduf_plus import load_dduf, validate
from dduf_plus.assignments import LoadNameError
from dduf_plus.cli import main
from dduf_plus.errors import DDUFLoadError, DDUFPackError, DDUFValidationError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing.pack import pack
from dduf_plus.packing.save import save_dduf

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SD = PIPELINES / "tiny-sd"


# --- tiny components ---------------------------------------------------------------------------------------
def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn from a seeded normal: ControlNet's zero convolutions would otherwise make the
    control branch contribute nothing, and a test comparing outputs could not fail on it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def sd_components() -> dict[str, Any]:
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(SD, dtype=torch.float32)
    return {name: getattr(pipe, name) for name in ("vae", "text_encoder", "tokenizer", "unet", "scheduler")}


def _sd_controlnet(seed: int) -> Any:
    return _randomize(diffusers.ControlNetModel(
        in_channels=4, block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        layers_per_block=2, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
        conditioning_embedding_out_channels=(16, 32)), seed)


def _sdxl_components(sd: dict[str, Any]) -> dict[str, Any]:
    """A tiny SDXL (diffusers' own dummy shapes): two CLIP text encoders, a text_time UNet."""
    torch.manual_seed(0)
    clip = dict(bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
                num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=sd["tokenizer"].vocab_size,
                hidden_act="gelu", projection_dim=32)
    unet = _randomize(diffusers.UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=8), 11)
    return {
        "vae": sd["vae"], "unet": unet, "scheduler": diffusers.EulerDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear",
            timestep_spacing="leading"),
        "text_encoder": _randomize(transformers.CLIPTextModel(transformers.CLIPTextConfig(**clip)), 12),
        "text_encoder_2": _randomize(transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**clip)), 13),
        "tokenizer": sd["tokenizer"], "tokenizer_2": sd["tokenizer"],
    }


def _sdxl_controlnet(seed: int) -> Any:
    return _randomize(diffusers.ControlNetModel(
        block_out_channels=(16, 32), layers_per_block=2, in_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), conditioning_embedding_out_channels=(16, 32),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=8), seed)


def _adapter(seed: int) -> Any:
    return _randomize(diffusers.T2IAdapter(in_channels=3, channels=[16, 32], num_res_blocks=1, downscale_factor=4,
                                           adapter_type="full_adapter_xl"), seed)


# --- inputs ------------------------------------------------------------------------------------------------
def _image(seed: int, size: int = 64) -> torch.Tensor:
    return torch.rand((1, 3, size, size), generator=torch.Generator().manual_seed(seed))


def _inputs(kind: str, controls: int) -> dict[str, Any]:
    args: dict[str, Any] = {"prompt": "a tiny test", "num_inference_steps": 2, "height": 64, "width": 64,
                            "output_type": "np", "guidance_scale": 6.0}
    if kind == "adapter":
        args["image"] = [_image(1 + i) for i in range(controls)]
        args["adapter_conditioning_scale"] = [1.0, 0.5][:controls]
        return args
    key = "control_image" if kind in ("img2img", "inpaint") else "image"
    args[key] = [_image(1 + i) for i in range(controls)]
    if kind in ("img2img", "inpaint"):
        args["image"], args["strength"] = _image(9), 1.0
    if kind == "inpaint":
        args["mask_image"] = torch.ones((1, 1, 64, 64)) * (torch.arange(64) < 32)
    return args


def _run(pipe: Any, args: dict[str, Any]) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(**args, generator=torch.Generator().manual_seed(0)).images


# --- checks ------------------------------------------------------------------------------------------------
def _same_component(a: Any, b: Any, name: str) -> None:
    assert type(a) is type(b), name
    if isinstance(a, torch.nn.Module):
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), f"{name}.{key}"
    elif hasattr(a, "config"):
        assert dict(a.config) == dict(b.config), name


def _same_pipeline(loaded: Any, reference: Any) -> None:
    assert type(loaded) is type(reference)
    for name, component in reference.components.items():
        _same_component(getattr(loaded, name), component, name)


def _realign(pipe: Any) -> None:
    """Every parameter and buffer copied to fresh (64-byte aligned) memory. Both loaders hand out views of
    the safetensors bytes where their file or entry puts them, and some CPU kernels round differently when a
    weight is not 16-byte aligned (bench/bench_alignment.py, docs/loading.md "Bit-exactness")."""
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.clone()


def _same_output(loaded: Any, reference: Any, args: dict[str, Any]) -> None:
    """The 2-step output: within 1e-5 as loaded (weights where each loader maps them), and bit-identical once
    both pipelines' weights sit at aligned addresses (the weights themselves are: _same_pipeline)."""
    np.testing.assert_allclose(_run(loaded, args), _run(reference, args), rtol=0, atol=1e-5)
    _realign(loaded)
    _realign(reference)
    np.testing.assert_array_equal(_run(loaded, args), _run(reference, args))


def _roundtrip(folder: Path, tmp_path: Path, args: dict[str, Any], pipeline_class: Any = None) -> tuple[Any, Path]:
    """Pack, validate (ours and huggingface_hub's reader), load equal to from_pretrained(folder) and the same
    2-step output; then save_dduf of the loaded pipeline loads equal again. Returns (loaded, archive)."""
    from huggingface_hub import read_dduf_file

    archive = tmp_path / f"{folder.name}.dduf"
    pack(folder, archive, quiet=True)
    report = validate(archive)
    assert report.valid, report.errors
    read_dduf_file(archive)  # every folder named in model_index.json, each with one of the four configs
    reference = (pipeline_class or diffusers.DiffusionPipeline).from_pretrained(folder)
    loaded = load_dduf(archive)
    _same_pipeline(loaded, reference)
    _same_output(loaded, reference, args)
    saved = tmp_path / f"{folder.name}-saved.dduf"
    save_dduf(loaded, saved, quiet=True)
    assert validate(saved).valid
    read_dduf_file(saved)
    _same_pipeline(load_dduf(saved), reference)
    return loaded, archive


# --- lists of models ---------------------------------------------------------------------------------------
SD_CONTROLNET = {"txt2img": "StableDiffusionControlNetPipeline", "img2img": "StableDiffusionControlNetImg2ImgPipeline",
                 "inpaint": "StableDiffusionControlNetInpaintPipeline"}
SDXL_CONTROLNET = {"txt2img": "StableDiffusionXLControlNetPipeline",
                   "img2img": "StableDiffusionXLControlNetImg2ImgPipeline",
                   "inpaint": "StableDiffusionXLControlNetInpaintPipeline"}


def _save(pipe: Any, folder: Path) -> Path:
    pipe.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", sorted(SD_CONTROLNET))
def test_multi_controlnet_sd(kind: str, sd_components: dict[str, Any], tmp_path: Path) -> None:
    cls = getattr(diffusers, SD_CONTROLNET[kind])
    pipe = cls(**sd_components, controlnet=[_sd_controlnet(1), _sd_controlnet(2)], safety_checker=None,
               feature_extractor=None, requires_safety_checker=False)
    folder = _save(pipe, tmp_path / f"sd-{kind}")
    assert (folder / "controlnet_1").is_dir() and "controlnet_1" not in json.loads((folder / "model_index.json").read_text())
    loaded, archive = _roundtrip(folder, tmp_path, _inputs(kind, 2))
    assert type(loaded.controlnet).__name__ == "MultiControlNetModel" and len(loaded.controlnet.nets) == 2
    with DDUFArchive(archive) as opened:
        assert opened.model_index["controlnet_1"] == ["diffusers", "ControlNetModel"]
        assert opened.model_index["controlnet"] == ["diffusers", "MultiControlNetModel"]


# SDXL img2img and inpaint share every list code path with text-to-image (~60 s each on 2 busy cores): run with
# DDUF_SLOW_TESTS=1.
_SLOW = pytest.mark.skipif(not os.environ.get("DDUF_SLOW_TESTS"), reason="set DDUF_SLOW_TESTS=1 (~60 s each)")


@pytest.mark.parametrize("kind", ["txt2img", pytest.param("img2img", marks=[pytest.mark.slow, _SLOW]),
                                  pytest.param("inpaint", marks=[pytest.mark.slow, _SLOW])])
def test_multi_controlnet_sdxl(kind: str, sd_components: dict[str, Any], tmp_path: Path) -> None:
    cls = getattr(diffusers, SDXL_CONTROLNET[kind])
    pipe = cls(**_sdxl_components(sd_components), controlnet=[_sdxl_controlnet(3), _sdxl_controlnet(4)])
    folder = _save(pipe, tmp_path / f"sdxl-{kind}")
    loaded, _archive = _roundtrip(folder, tmp_path, _inputs(kind, 2))
    assert len(loaded.controlnet.nets) == 2


def test_multi_adapter(sd_components: dict[str, Any], tmp_path: Path) -> None:
    pipe = diffusers.StableDiffusionAdapterPipeline(
        **sd_components, adapter=diffusers.MultiAdapter([_adapter(5), _adapter(6)]), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = _save(pipe, tmp_path / "adapter")
    loaded, archive = _roundtrip(folder, tmp_path, _inputs("adapter", 2))
    assert type(loaded.adapter).__name__ == "MultiAdapter" and len(loaded.adapter.adapters) == 2
    with DDUFArchive(archive) as opened:
        assert opened.model_index["adapter_1"] == ["diffusers", "T2IAdapter"]
    for source in (archive, folder):  # every part takes the list's dtype; a key naming a part is never ignored
        halves = load_dduf(source, torch_dtype={"adapter": torch.float16})
        assert [a.dtype for a in halves.adapter.adapters] == [torch.float16, torch.float16] and halves.unet.dtype == torch.float32
        for kwargs in ({"torch_dtype": {"adapter_1": "float16"}}, {"device_map": {"adapter_1": "cpu"}}):
            with pytest.raises(LoadNameError, match=r"key adapter_1: a part of list component 'adapter' \(MultiAdapter\).*give 'adapter'"):
                load_dduf(source, **kwargs)


def test_info_lists_the_parts(sd_components: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pipe = diffusers.StableDiffusionControlNetPipeline(
        **sd_components, controlnet=[_sd_controlnet(1), _sd_controlnet(2), _sd_controlnet(7)], safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = _save(pipe, tmp_path / "three")
    archive = tmp_path / "three.dduf"
    assert main(["pack", str(folder), "-o", str(archive), "--quiet"]) == 0
    capsys.readouterr()
    for source in (archive, folder):
        assert main(["info", str(source), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)["components"]
        assert info["controlnet"]["parts"] == ["controlnet", "controlnet_1", "controlnet_2"]
        assert info["controlnet_2"]["part_of"] == "controlnet" and info["controlnet_2"]["class"] == "ControlNetModel"
    assert main(["info", str(archive)]) == 0
    text = capsys.readouterr().out
    assert "list of 3: controlnet, controlnet_1, controlnet_2" in text and "part of controlnet" in text
    assert len(load_dduf(archive).controlnet.nets) == 3
    assert len(load_dduf(folder).controlnet.nets) == 3  # a folder loads as the archive packed from it
    assert main(["unpack", str(archive), "-o", str(tmp_path / "unpacked"), "--quiet"]) == 0  # diffusers' folders
    assert len(diffusers.DiffusionPipeline.from_pretrained(tmp_path / "unpacked").controlnet.nets) == 3


def _codes(archive: Path) -> list[str]:
    """The rule codes ``dduf validate`` reports (an archive that does not even open: the opening's codes)."""
    try:
        return list(validate(archive).codes)
    except DDUFValidationError as e:
        return [f.code for f in e.findings]


def _rewrite_model_index(archive: Path, out: Path, change: dict[str, Any]) -> Path:
    """The archive with model_index.json changed (written unchecked: the loader's own refusal is tested)."""
    from dduf_plus.format.pack import EntrySource, write_archive

    with DDUFArchive(archive) as opened:
        model_index = {**opened.model_index, **change}
        sources = [EntrySource(name, data=bytes(opened.read_bytes(name))) for name in opened.entries
                   if name not in ("model_index.json", "dduf_plus.index.json")]
    raw = json.dumps(model_index, indent=2, sort_keys=True).encode()
    write_archive(out, model_index, raw, sources, quiet=True, check=False)
    return out


def test_misnamed_list_part_is_refused(sd_components: dict[str, Any], tmp_path: Path) -> None:
    """D018: a further part named with another class is refused by validate and by the loader alike."""
    pipe = diffusers.StableDiffusionControlNetPipeline(
        **sd_components, controlnet=[_sd_controlnet(1), _sd_controlnet(2)], safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    archive = tmp_path / "cn.dduf"
    pack(_save(pipe, tmp_path / "cn"), archive, quiet=True)
    bad = _rewrite_model_index(archive, tmp_path / "bad.dduf", {"controlnet_1": ["diffusers", "UNet2DConditionModel"]})
    assert "D018" in _codes(bad)
    with pytest.raises(DDUFValidationError) as caught:
        load_dduf(bad)
    assert "D018" in str(caught.value)


# --- guider, and a component model_index.json names that save_pretrained did not write -------------------------
class TinyGuidedPipeline(diffusers.DiffusionPipeline):
    """The smallest pipeline with a guider component (none of diffusers' guider pipelines, HunyuanImage 2.1,
    HunyuanVideo 1.5, MotifVideo, ACE-Step, builds offline without Hub tokenizers) and, like LongCat audio's
    ``scheduler``, an argument with a default that save_pretrained does not write."""

    def __init__(self, unet: Any, guider: Any, scheduler: Any = None):
        super().__init__()
        if not isinstance(scheduler, diffusers.DDIMScheduler):
            scheduler = diffusers.DDIMScheduler(num_train_timesteps=100)
        self.register_modules(unet=unet, guider=guider, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, num_inference_steps: int = 2, generator: Any = None) -> Any:
        latents = torch.randn((1, 4, 8, 8), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.scheduler.timesteps:
            eps = self.unet(latents, t).sample
            eps = eps * self.guider.guidance_scale - latents * self.guider.guidance_rescale  # uses its config
            latents = self.scheduler.step(eps, t, latents).prev_sample
        return latents


def _guided_pipeline() -> Any:
    unet = _randomize(diffusers.UNet2DModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                            block_out_channels=(16, 32), norm_num_groups=8,
                                            down_block_types=("DownBlock2D", "DownBlock2D"),
                                            up_block_types=("UpBlock2D", "UpBlock2D")), 21)
    return TinyGuidedPipeline(unet=unet, guider=diffusers.ClassifierFreeGuidance(guidance_scale=3.5, guidance_rescale=0.25))


@pytest.fixture
def guided_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(diffusers, "TinyGuidedPipeline", TinyGuidedPipeline, raising=False)  # load_dduf finds it
    folder = tmp_path / "guided"
    _guided_pipeline().save_pretrained(folder)
    return folder


def test_guider_component(guided_folder: Path, tmp_path: Path) -> None:
    from huggingface_hub import read_dduf_file

    assert sorted(p.name for p in (guided_folder / "guider").iterdir()) == ["guider_config.json"]
    archive = tmp_path / "guided.dduf"
    pack(guided_folder, archive, quiet=True)
    entries = read_dduf_file(archive)  # refused without a config.json in guider/
    assert entries["guider/config.json"].read_text() == (guided_folder / "guider" / "guider_config.json").read_text()
    reference = TinyGuidedPipeline.from_pretrained(guided_folder)
    for source in (archive, guided_folder):
        loaded = load_dduf(source)
        assert dict(loaded.guider.config) == dict(reference.guider.config) and loaded.guider.guidance_scale == 3.5
        _same_pipeline(loaded, reference)
        out = loaded(generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, reference(generator=torch.Generator().manual_seed(0)))
    assert main(["unpack", str(archive), "-o", str(tmp_path / "unpacked"), "--quiet"]) == 0
    assert dict(TinyGuidedPipeline.from_pretrained(tmp_path / "unpacked").guider.config) == dict(reference.guider.config)
    saved = tmp_path / "guided-saved.dduf"
    save_dduf(loaded, saved, quiet=True)
    assert validate(saved).valid and "guider/config.json" in read_dduf_file(saved)
    _same_pipeline(load_dduf(saved), reference)


def test_guider_config_copy_must_match(guided_folder: Path, tmp_path: Path) -> None:
    """D019: a config.json that is not the guider_config.json diffusers reads (two readers, two configs)."""
    from dduf_plus.format.pack import EntrySource, write_archive

    archive = tmp_path / "guided.dduf"
    pack(guided_folder, archive, quiet=True)
    with DDUFArchive(archive) as opened:
        model_index, raw = opened.model_index, bytes(opened.read_bytes("model_index.json"))
        sources = [EntrySource(name, data=b'{"guidance_scale": 1.0}' if name == "guider/config.json"
                               else bytes(opened.read_bytes(name)))
                   for name in opened.entries if name not in ("model_index.json", "dduf_plus.index.json")]
    bad = tmp_path / "bad.dduf"
    write_archive(bad, model_index, raw, sources, quiet=True, check=False)
    assert "D019" in _codes(bad)
    with pytest.raises(DDUFValidationError, match="D019"):
        load_dduf(bad)
    (guided_folder / "guider" / "config.json").write_text('{"guidance_scale": 1.0}')
    with pytest.raises(DDUFPackError, match="D019"):
        pack(guided_folder, tmp_path / "refused.dduf", quiet=True)


def _loads_without_the_scheduler_folder(archive: Path, folder: Path) -> None:
    """Valid, D008 said for the scheduler save_pretrained did not write, and loads as diffusers loads ``folder``."""
    report = validate(archive)
    assert report.valid and [f.entry for f in report.warnings if f.code == "D008"] == ["scheduler"]
    reference = TinyGuidedPipeline.from_pretrained(folder)
    loaded = load_dduf(archive)
    _same_pipeline(loaded, reference)
    assert torch.equal(loaded(generator=torch.Generator().manual_seed(0)),
                       reference(generator=torch.Generator().manual_seed(0)))


def test_component_not_saved(guided_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``scheduler`` is named in model_index.json but save_pretrained wrote no folder: diffusers loads the
    folder (the pipeline makes its default), so pack stores the rest and says why; a missing required
    component is still refused."""
    assert json.loads((guided_folder / "model_index.json").read_text())["scheduler"] == ["diffusers", "DDIMScheduler"]
    assert not (guided_folder / "scheduler").exists()
    archive = tmp_path / "guided.dduf"
    assert main(["pack", str(guided_folder), "-o", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "scheduler/" in out and "from_pretrained passes model_index.json's value" in out
    _loads_without_the_scheduler_folder(archive, guided_folder)
    for item in (guided_folder / "unet").iterdir():
        item.unlink()
    (guided_folder / "unet").rmdir()
    with pytest.raises(DDUFPackError, match="'unet' is named in model_index.json"):
        pack(guided_folder, tmp_path / "no-unet.dduf", quiet=True)


def test_component_not_saved_with_base(guided_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``pack --base``: a fine-tune of that pipeline keeps the changed UNet, references the guider, and neither
    stores nor references the scheduler save_pretrained did not write; it loads as the fine-tune's folder does."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    _guided_pipeline().save_pretrained(base)
    weights = guided_folder / "unet" / "diffusion_pytorch_model.safetensors"
    tuned = load_file(weights)
    first = sorted(tuned)[0]
    tuned[first] = tuned[first] + 1  # the fine-tune: one tensor changed
    save_file(tuned, weights, metadata={"format": "pt"})
    archive = tmp_path / "tuned.dduf"
    assert main(["pack", str(guided_folder), "-o", str(archive), "--base", str(base)]) == 0
    out = capsys.readouterr().out
    assert "skipped scheduler/: named in model_index.json, not saved" in out and "skipped guider/: referenced" in out
    with DDUFArchive(archive) as opened:
        assert {n.partition("/")[0] for n in opened.entries if "/" in n} == {"unet"}
        assert sorted(opened.references) == ["guider"]
    _loads_without_the_scheduler_folder(archive, guided_folder)


def test_single_controlnet_is_unchanged(sd_components: dict[str, Any], tmp_path: Path) -> None:
    """A one-ControlNet pipeline is a plain component: no part keys added, model_index.json kept byte for byte."""
    pipe = diffusers.StableDiffusionControlNetPipeline(
        **sd_components, controlnet=_sd_controlnet(1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    folder = _save(pipe, tmp_path / "one")
    archive = tmp_path / "one.dduf"
    pack(folder, archive, quiet=True)
    with DDUFArchive(archive) as opened:
        assert bytes(opened.read_bytes("model_index.json")) == (folder / "model_index.json").read_bytes()
    assert type(load_dduf(archive).controlnet).__name__ == "ControlNetModel"


def test_list_class_with_one_stored_part_error(sd_components: dict[str, Any], tmp_path: Path) -> None:
    """A MultiAdapter needs two adapters: an archive holding one part says so, naming the component."""
    pipe = diffusers.StableDiffusionAdapterPipeline(
        **sd_components, adapter=diffusers.MultiAdapter([_adapter(5), _adapter(6)]), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = _save(pipe, tmp_path / "adapter")
    for item in (folder / "adapter_1").iterdir():
        item.unlink()
    (folder / "adapter_1").rmdir()
    archive = tmp_path / "one-adapter.dduf"
    pack(folder, archive, quiet=True)
    with pytest.raises(DDUFLoadError, match="'adapter' .MultiAdapter. from its 1 part"):
        load_dduf(archive)
