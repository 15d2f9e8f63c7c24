"""Single-file SD3 / SD3.5 checkpoints in (MMDiT ``model.diffusion_model.joint_blocks.*``, ``first_stage_model.*``,
``text_encoders.{clip_l,clip_g,t5xxl}.*``), in fp16, bf16 and plain fp8; scaled fp8 refused.

A tiny SD3.5-shaped pipeline is built per session (tests/single_file_ckpt.py: 38 MMDiT blocks, as diffusers
detects SD3.5 large by its 38th block) and written back in Stability's layout; the archive must load equal,
tensor for tensor and image for image, to diffusers' own ``StableDiffusion3Pipeline.from_single_file(CKPT,
config=BASE, torch_dtype=<the checkpoint's dtype>)``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from single_file_ckpt import (
    _config,
    _state,
    build_tiny_sd3,
    checkpoint_from_pipeline,
    sd3_checkpoint_from_pipeline,
    sd3_transformer_to_original,
    vae_to_ldm,
)

from conftest import PIPELINES
from dduf_plus.errors import DDUFPackError
from dduf_plus.packing.single_file import (
    describe_checkpoint,
    detect_architecture,
    pack_single_file,
    quick_architecture,
    read_checkpoint_header,
)

TINY_SD = PIPELINES / "tiny-sd"
CLASS = "StableDiffusion3Pipeline"
ENCODERS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(state, path)
    return path


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models on a shared 2-core runner: one intra-op thread is ~15x faster than two (a 38-block forward
    took 1-3 s of CPU with two threads under contention, 0.07 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def sd3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny SD3.5 base (fp32 files and fp16 variant files) and four checkpoints, the transformer changed in
    three: every component in fp16 (Stability's "incl. clips and t5" files), the transformer alone in bf16, and
    the transformer alone in plain fp8 (float8_e4m3fn storage, no scales); and BASE's own weights in bf16 (a
    dtype BASE has no files of: every component converted and stored)."""
    out = tmp_path_factory.mktemp("single-file-sd3")
    base = build_tiny_sd3(out / "tiny-sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    only = ("transformer",)
    return {
        "base": base,
        "fp16": _save(sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, dtype=torch.float16),
                      out / "sd35-fp16.safetensors"),
        "bf16": _save(sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, dtype=torch.bfloat16,
                                                   components=only), out / "sd35-bf16.safetensors"),
        "bf16_full": _save(sd3_checkpoint_from_pipeline(base, dtype=torch.bfloat16), out / "sd35-bf16-full.safetensors"),
        "fp8": _save(sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, dtype=torch.float8_e4m3fn,
                                                  components=only), out / "sd35-fp8.safetensors"),
    }


def test_sd3_reverse_mapping_round_trips_through_diffusers(sd3: dict[str, Path]) -> None:
    """The fixture's MMDiT and VAE keys are the ones diffusers' forward conversion maps back exactly."""
    from diffusers.loaders import single_file_utils as sfu

    state = _state(sd3["base"], "transformer")
    back = sfu.convert_sd3_transformer_checkpoint_to_diffusers(sd3_transformer_to_original(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert any(".attn2." in k for k in state) and any(".norm_added_q." in k for k in state)  # 3.5's branches ran
    vae, config = _state(sd3["base"], "vae"), _config(sd3["base"], "vae")
    back = sfu.convert_ldm_vae_checkpoint(vae_to_ldm(vae, config), config)
    assert back.keys() == vae.keys() and all(torch.equal(back[k], vae[k]) for k in vae)


def _given(base: Path) -> dict[str, Any]:
    """BASE's own components, for from_single_file of a transformer-only file (diffusers refuses to build a
    pipeline whose encoders are not in the file unless they are given)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    kw = {"torch_dtype": torch.float32}
    return {"vae": AutoencoderKL.from_pretrained(base, subfolder="vae", **kw),
            "text_encoder": CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder", **kw),
            "text_encoder_2": CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder_2", **kw),
            "text_encoder_3": T5EncoderModel.from_pretrained(base, subfolder="text_encoder_3", **kw)}


def _theirs(ckpt: Path, base: Path, dtype: torch.dtype, **given: Any) -> Any:
    import diffusers

    pipe = diffusers.StableDiffusion3Pipeline.from_single_file(str(ckpt), config=str(base), torch_dtype=dtype,
                                                               local_files_only=True, **given)
    if pipe.text_encoder_3.encoder.embed_tokens.weight.is_meta:
        # diffusers 0.42.1 + transformers 5, a file holding text_encoders.t5xxl.*: T5's tied embed_tokens is left
        # on the meta device (only shared.weight is loaded) and the model in training mode (dropout on: a random
        # prompt embedding); tie and eval() it as from_pretrained does
        pipe.text_encoder_3.tie_weights()
        pipe.text_encoder_3.eval()
    return pipe


def _assert_same(ours: Any, theirs: Any, stored: dict[str, torch.dtype]) -> None:
    """Every component tensor for tensor (names, dtypes, values); ``stored``: the dtype each converted component
    must have (the checkpoint's)."""
    checked = 0
    for name, component in ours.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        mine, other = component.state_dict(), getattr(theirs, name).state_dict()
        assert mine.keys() == other.keys(), name
        for k in mine:
            assert mine[k].dtype == other[k].dtype and torch.equal(mine[k], other[k]), (name, k, mine[k].dtype)
        if name in stored:
            assert {t.dtype for t in mine.values()} <= {stored[name], torch.float32}, name  # T5's wo: fp32
            assert any(t.dtype == stored[name] for t in mine.values()), name
        checked += 1
    assert checked == 5


def _stored(archive: Path) -> list[str]:
    """The components whose weights the archive holds."""
    import zipfile

    with zipfile.ZipFile(archive) as z:
        return sorted({n.split("/")[0] for n in z.namelist() if n.endswith(".safetensors")})


def _image(pipe: Any, steps: int = 2) -> Any:
    return pipe("a red fox", num_inference_steps=steps, height=32, width=32, output_type="np", max_sequence_length=16,
                generator=torch.Generator().manual_seed(0)).images


def test_sd3_full_fp16_checkpoint_equals_from_single_file(sd3: dict[str, Path], tmp_path: Path) -> None:
    from dduf_plus import load_dduf

    out = tmp_path / "sd35.dduf"
    result, partial = pack_single_file(sd3["fp16"], out, base=str(sd3["base"]), quiet=True)
    report = "\n".join(partial.report)
    assert "detected SD3.5 large (sd35_large)" in report and "not " not in partial.report[0]
    assert "transformer: converted" in report
    # the unchanged VAE, CLIP-L (its identity projection added as diffusers does), CLIP-G and T5 are BASE's fp16
    # variant files: referenced as such; only the transformer is stored
    refs = partial.references
    assert set(refs) == {*ENCODERS, "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"}
    assert all(refs[n]["variant"] == "fp16" for n in ENCODERS), refs
    assert _stored(result.path) == ["transformer"]
    ours = load_dduf(out)
    theirs = _theirs(sd3["fp16"], sd3["base"], torch.float16)
    _assert_same(ours, theirs, dict.fromkeys(["transformer", *ENCODERS], torch.float16))
    a, b = _image(ours, steps=1), _image(theirs, steps=1)  # fp16 on CPU: slow kernels
    assert a.shape == (1, 32, 32, 3) and (a == b).all()


def test_sd3_transformer_only_bf16_checkpoint(sd3: dict[str, Path], tmp_path: Path) -> None:
    from dduf_plus import load_dduf

    out = tmp_path / "bf16.dduf"
    _result, partial = pack_single_file(sd3["bf16"], out, base=str(sd3["base"]), quiet=True)
    assert "it holds transformer, not text_encoder, text_encoder_2, text_encoder_3, vae" in partial.report[0]
    assert set(partial.references) == {*ENCODERS, "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"}
    assert all(partial.references[n].get("variant") is None for n in ENCODERS)
    ours = load_dduf(out)
    theirs = _theirs(sd3["bf16"], sd3["base"], torch.bfloat16, **_given(sd3["base"]))
    _assert_same(ours, theirs, {"transformer": torch.bfloat16})
    # a bf16 transformer behind fp32 encoders: diffusers' pipeline does not bridge the dtypes, so both run in fp32
    _upcast_transformers(ours, theirs)
    assert (_image(ours) == _image(theirs)).all()


def _upcast_transformers(*pipes: Any) -> None:
    """Each pipeline's transformer replaced by an fp32 copy of its tensors (neither pipeline runs a bf16
    transformer behind fp32 encoders, or fp8 weights on CPU, as it is; dduf_plus's fp8 layerwise casting
    leaves pos_embed and the norms in storage dtype, diffusers' default skip list)."""
    from diffusers import SD3Transformer2DModel

    for pipe in pipes:
        copy = SD3Transformer2DModel.from_config(pipe.transformer.config)
        copy.load_state_dict({k: v.float() for k, v in pipe.transformer.state_dict().items()})
        pipe.transformer = copy.eval()


def test_sd3_full_bf16_checkpoint_stores_every_converted_component(sd3: dict[str, Path], tmp_path: Path) -> None:
    """Every component differs from BASE's files (dtype): the converted VAE, CLIP-L (with the identity projection
    diffusers adds), CLIP-G and T5 are stored, and load equal to diffusers' conversion of them."""
    from dduf_plus import load_dduf

    out = tmp_path / "bf16-full.dduf"
    result, partial = pack_single_file(sd3["bf16_full"], out, base=str(sd3["base"]), quiet=True)
    assert _stored(result.path) == sorted(["transformer", *ENCODERS])
    assert set(partial.references) == {"tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"}
    assert "is bfloat16 here, float32 in BASE" in "\n".join(partial.report)
    ours = load_dduf(out)
    theirs = _theirs(sd3["bf16_full"], sd3["base"], torch.bfloat16)
    _assert_same(ours, theirs, dict.fromkeys(["transformer", *ENCODERS], torch.bfloat16))
    assert torch.equal(ours.text_encoder.text_projection.weight, torch.eye(32, dtype=torch.bfloat16))
    a, b = _image(ours, steps=1), _image(theirs, steps=1)
    assert (a == b).all()


def test_sd3_plain_fp8_checkpoint(sd3: dict[str, Path], tmp_path: Path) -> None:
    """float8_e4m3fn storage without scales is packed as stored: the archive's transformer is fp8, equal to
    from_single_file(torch_dtype=float8_e4m3fn)'s; both upcast give the same image."""
    from dduf_plus import load_dduf

    out = tmp_path / "fp8.dduf"
    result, partial = pack_single_file(sd3["fp8"], out, base=str(sd3["base"]), quiet=True)
    assert "transformer: converted" in "\n".join(partial.report)
    assert _stored(result.path) == ["transformer"]
    ours = load_dduf(out)
    theirs = _theirs(sd3["fp8"], sd3["base"], torch.float8_e4m3fn, **_given(sd3["base"]))
    _assert_same(ours, theirs, {"transformer": torch.float8_e4m3fn})
    _upcast_transformers(ours, theirs)
    assert (_image(ours) == _image(theirs)).all()


def _refused(ckpt: Path, base: Path, out: Path, *words: str) -> str:
    with pytest.raises(DDUFPackError) as e:
        pack_single_file(ckpt, out, base=str(base), quiet=True)
    text = str(e.value)
    assert all(w in text for w in words), text
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(out.name)]
    return text


def test_scaled_fp8_checkpoint_is_refused(sd3: dict[str, Path], tmp_path: Path) -> None:
    """ComfyUI's "fp8 scaled" files (``scaled_fp8`` marker, a ``.scale_weight`` per weight): diffusers loads them
    unscaled (a wrong model), so dduf pack refuses them, naming the rule; plain fp8 of the same tensors packs."""
    from safetensors.torch import load_file

    state = load_file(sd3["fp8"])
    scales = {k.removesuffix(".weight") + ".scale_weight": torch.ones(()) for k in state if k.endswith("qkv.weight")}
    for extra, name in (({"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn), **scales}, "scaled.safetensors"),
                        (scales, "scales-only.safetensors")):
        ckpt = _save({**state, **extra}, tmp_path / name)
        _refused(ckpt, sd3["base"], tmp_path / "s.dduf", "scaled-fp8", "scale_weight", "rule:")


def test_family_mismatch_with_base_is_refused(sd3: dict[str, Path], tmp_path: Path) -> None:
    _refused(sd3["bf16"], TINY_SD, tmp_path / "x.dduf", "SD3.5 large checkpoint", "StableDiffusionPipeline",
             "StableDiffusion3Pipeline")
    sd1 = _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",)),
                tmp_path / "sd1.safetensors")
    _refused(sd1, sd3["base"], tmp_path / "y.dduf", "SD 1.x checkpoint", "StableDiffusion3Pipeline",
             "SD3.5 large")


def test_sd3_shapes_that_do_not_fit_base_are_refused(sd3: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(sd3["bf16"])
    key = "model.diffusion_model.context_embedder.weight"
    wide = _save({**state, key: torch.zeros(16, 48, dtype=torch.bfloat16)}, tmp_path / "wide.safetensors")
    _refused(wide, sd3["base"], tmp_path / "w.dduf", "context_embedder.weight", "[16, 48]", "[16, 64]")


def _marker_file(tmp_path: Path, name: str, tensors: dict[str, tuple[int, ...]]) -> Path:
    return _save({k: torch.zeros(shape, dtype=torch.float16) for k, shape in tensors.items()}, tmp_path / name)


def test_quick_detection_agrees_with_diffusers_on_sd3(sd3: dict[str, Path], tmp_path: Path) -> None:
    """dduf info's torch-free detection names what diffusers' infer_diffusers_model_type names, on the fixtures
    and on header-only files with diffusers' SD3 / SD3.5 medium markers (1536-wide blocks, 192x192 or 384x384
    position grid: out of reach of a tiny model) and ones diffusers cannot place."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    bias = "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"
    grid = "model.diffusion_model.pos_embed"
    files = {name: sd3[name] for name in ("fp16", "bf16", "fp8")}
    files["sd3"] = _marker_file(tmp_path, "sd3.safetensors", {bias: (9216,), grid: (1, 36864, 1)})
    files["sd35_medium"] = _marker_file(tmp_path, "m.safetensors", {bias: (9216,), grid: (1, 147456, 1)})
    files["bare"] = _marker_file(tmp_path, "bare.safetensors", {"joint_blocks.37.x_block.mlp.fc1.weight": (2,)})
    expected = {"fp16": "sd35_large", "bf16": "sd35_large", "fp8": "sd35_large", "sd3": "sd3",
                "sd35_medium": "sd35_medium", "bare": None}
    for name, path in files.items():
        header = read_checkpoint_header(path)
        assert quick_architecture(header) == expected[name], name
        if expected[name]:
            assert detect_architecture(header) == expected[name], name
    assert infer_diffusers_model_type({k: torch.empty(0) for k in ("joint_blocks.37.x_block.mlp.fc1.weight",)}) \
        == "sd35_large"
    # 1536 wide but a grid diffusers does not know (it fails on an unbound name) / a 2-block MMDiT (diffusers
    # falls back to "v1" and would convert it as a UNet): one clear error each, and dduf info says unknown
    odd = _marker_file(tmp_path, "odd.safetensors", {bias: (9216,), grid: (1, 64, 1)})
    small = sd3_transformer_to_original({k: v for k, v in _state(sd3["base"], "transformer").items()
                                         if not k.startswith("transformer_blocks.") or int(k.split(".")[1]) < 2})
    small_path = _save(small, tmp_path / "small.safetensors")
    for path, words in ((odd, "cannot tell its architecture"), (small_path, "transformer layout")):
        header = read_checkpoint_header(path)
        assert quick_architecture(header) is None
        with pytest.raises(DDUFPackError, match=words):
            detect_architecture(header)
        _refused(path, sd3["base"], tmp_path / "o.dduf", words)
        assert describe_checkpoint(path)["architecture"] is None
    _refused(files["bare"], sd3["base"], tmp_path / "b.dduf", "none of its keys", "model.diffusion_model.")


def test_info_lists_sd3_components(sd3: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus.cli import main

    info = describe_checkpoint(sd3["fp16"])
    assert info["architecture"] == "sd35_large" and info["pipeline"] == CLASS
    assert set(info["components"]) == {"transformer", *ENCODERS} and info["absent"] == []
    assert all(c["dtype"] == "float16" for c in info["components"].values())
    assert info["components"]["text_encoder_3"]["prefix"] == "text_encoders.t5xxl.transformer."
    assert info["other_tensors"] == 0
    fp8 = describe_checkpoint(sd3["fp8"])
    assert fp8["components"]["transformer"]["dtype"] == "float8_e4m3fn"
    assert fp8["absent"] == ["text_encoder", "text_encoder_2", "text_encoder_3", "vae"]
    assert main(["info", str(sd3["fp16"])]) == 0
    text = capsys.readouterr().out
    assert "SD3.5 large (sd35_large)" in text and "text_encoders.clip_g.transformer." in text
    assert main(["info", str(sd3["bf16"]), "--base", str(sd3["base"]), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["pack_plan"]
    assert list(plan["stored"]) == ["transformer"]
    assert plan["referenced"]["text_encoder_3"] is None and "tokenizer_3" in plan["referenced"]
