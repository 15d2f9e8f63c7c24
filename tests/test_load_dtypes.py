"""The torch_dtype rule: "auto" keeps each saved dtype, class declarations win, explicit requests convert."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

from dduf_plus.errors import DDUFLoadError  # noqa: E402
from dduf_plus.loading.dtypes import (  # noqa: E402
    AUTO,
    parse_dtype,
    plan_dtypes,
    requested_for,
    resolve_request,
)

PIPELINES = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines"


def meta(**tensors: tuple[str, int]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """{name: (dtype name, nbytes)} -> the metadata plan_dtypes reads (dots spelled as "__")."""
    return {k.replace("__", "."): (d, (n,), n) for k, (d, n) in tensors.items()}


class KeepNorm:  # a diffusers-style class declaration
    _keep_in_fp32_modules = ["norm"]


class T5Like:  # transformers-style: wo is fp32 only when loading in fp16
    _keep_in_fp32_modules = ["wo"]
    _keep_in_fp32_modules_strict = None


def test_parse_dtype_spellings():
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("fp32") is torch.float32
    assert parse_dtype(torch.bfloat16) is torch.bfloat16
    assert parse_dtype("auto") == AUTO
    for bad in ("int8", "nope", 3):
        with pytest.raises(DDUFLoadError):
            parse_dtype(bad)


def test_request_merging():
    assert resolve_request(AUTO, None) == AUTO
    assert resolve_request(AUTO, torch.float16) is torch.float16  # dtype= alias
    assert resolve_request("bfloat16", None) is torch.bfloat16
    request = resolve_request({"unet": "fp16", "default": "float32"}, None)
    assert requested_for(request, "unet") is torch.float16 and requested_for(request, "vae") is torch.float32
    assert requested_for({"unet": torch.float16}, "vae") == AUTO  # no "default": auto, not fp32
    with pytest.raises(DDUFLoadError, match="disagree"):
        resolve_request(torch.float16, torch.bfloat16)


def test_auto_single_dtype_converts_nothing():
    plan = plan_dtypes(AUTO, meta(a=("float16", 100), b=("float16", 10), step=("int64", 8)), model_cls=None, library="diffusers")
    assert plan.dtype is torch.float16 and plan.converted == 0
    assert plan.target("step", torch.int64) is None


def test_auto_mixed_follows_the_class_then_the_majority():
    # fp16 model whose keep-in-fp32 norms were saved fp32: fp16, nothing converted
    m = meta(conv__weight=("float16", 100), norm__weight=("float32", 400))
    plan = plan_dtypes(AUTO, m, model_cls=KeepNorm, library="diffusers")
    assert plan.dtype is torch.float16 and plan.converted == 0
    # without the declaration the bytes decide (fp32 holds most), and the fp16 tensor is converted
    plan = plan_dtypes(AUTO, m, model_cls=None, library="diffusers")
    assert plan.dtype is torch.float32 and plan.converted == 1
    assert plan.target("conv.weight", torch.float16) is torch.float32
    # a tie goes to the wider dtype
    assert plan_dtypes(AUTO, meta(a=("bfloat16", 8), b=("float32", 8)), model_cls=None, library="diffusers").dtype is torch.float32


def test_keep_fp32_matching_follows_each_library():
    # diffusers: a module name anywhere in the path, for any dtype
    plan = plan_dtypes(torch.bfloat16, meta(blocks__0__norm__weight=("float32", 4)), model_cls=KeepNorm, library="diffusers")
    assert plan.target("blocks.0.norm.weight", torch.float32) is None  # stays fp32
    assert plan.target("blocks.0.normal.weight", torch.float32) is torch.bfloat16
    # transformers: _keep_in_fp32_modules only applies to fp16, as transformers decides
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    m = {wo: ("float32", (4,), 16)}
    assert plan_dtypes(torch.float16, m, model_cls=T5Like, library="transformers").target(wo, torch.float32) is None
    assert plan_dtypes(torch.bfloat16, m, model_cls=T5Like, library="transformers").target(wo, torch.float32) is torch.bfloat16


def test_fp8_storage_is_kept_with_its_compute_dtype():
    m = meta(linear__weight=("float8_e4m3fn", 1000), norm__weight=("bfloat16", 10))
    declared = {"storage_dtype": "float8_e4m3fn", "compute_dtype": "bfloat16"}
    plan = plan_dtypes(AUTO, m, model_cls=None, library="diffusers", declared=declared)
    assert plan.storage_dtype is torch.float8_e4m3fn and plan.dtype is torch.bfloat16
    assert plan.target("linear.weight", torch.float8_e4m3fn) is None and plan.converted == 0
    # undeclared fp8 tensors are still storage; an explicit request picks the compute dtype
    plan = plan_dtypes(torch.float16, m, model_cls=None, library="diffusers")
    assert plan.storage_dtype is torch.float8_e4m3fn and plan.dtype is torch.float16
    with pytest.raises(DDUFLoadError, match="storage"):
        plan_dtypes(torch.float8_e4m3fn, m, model_cls=None, library="diffusers")


@pytest.fixture(scope="module")
def sd_archive(tmp_path_factory) -> Path:
    from dduf_plus.format.pack import pack_folder

    return pack_folder(PIPELINES / "tiny-sd", tmp_path_factory.mktemp("dt") / "sd.dduf", quiet=True).path


def test_explicit_dtype_converts_every_component(sd_archive):
    from dduf_plus import load_dduf

    pipe = load_dduf(sd_archive, torch_dtype=torch.bfloat16)
    for name in ("unet", "text_encoder", "vae"):
        module = getattr(pipe, name)
        assert module.dtype is torch.bfloat16
        assert {p.dtype for p in module.parameters() if p.is_floating_point()} == {torch.bfloat16}


def test_auto_fp32_request_on_fp16_unet_matches_diffusers(sd_archive):
    """Explicit fp32 on an fp16-saved unet: upcast tensor by tensor, same values as diffusers' upcast."""
    import diffusers

    from dduf_plus import load_dduf

    ours = load_dduf(sd_archive, torch_dtype=torch.float32).unet
    theirs = diffusers.UNet2DConditionModel.from_pretrained(PIPELINES / "tiny-sd" / "unet", dtype=torch.float32)
    a, b = ours.state_dict(), theirs.state_dict()
    assert all(a[k].dtype is torch.float32 and torch.equal(a[k], b[k]) for k in b)
