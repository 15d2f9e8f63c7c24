"""Components quantized by SDNQ through diffusers (SDNQConfig, quant_method "sdnq"): pack (byte-faithful, the index
records backend, scheme and roles), validate (--strict --verify clean; hostile configs and layouts refused by code,
by validate and by load_dduf alike), load (the modules, state and outputs of diffusers' from_pretrained of the
folder, every tensor a view of the archive; the stored float32 scales kept where diffusers' bf16 reload rounds
them) and a clear error when sdnq is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")  # sdnq would torch.compile its quantizer: minutes on CPU
if importlib.util.find_spec("sdnq") is None:  # a reason without "could not import": .ci/run fails on those
    pytest.skip("sdnq is not installed here (pip install -e '.[quant]')", allow_module_level=True)

import torch  # noqa: E402

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.errors import DDUFError, DDUFLoadError  # noqa: E402
from dduf_plus.format import quant_sdnq  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.loading.files import ArchiveComponentFiles  # noqa: E402
from dduf_plus.packing.pack import pack  # noqa: E402

pack_module = importlib.import_module("dduf_plus.packing.pack")

TINY_SD = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"
WEIGHTS = "diffusion_pytorch_model.safetensors"
BLOCK = "mid_block.attentions.0.transformer_blocks.0"
LAYER = f"{BLOCK}.attn1.to_q"  # an nn.Linear [32, 32] SDNQ quantizes
WIDE = f"{BLOCK}.ff.net.2"  # an nn.Linear [32, 128]


def _quantized_folder(root: Path, weights_dtype: str, dtype: torch.dtype, **options: Any) -> Path:
    """tiny-sd whose unet diffusers quantized with SDNQ and saved (save_pretrained). SDNQ skips layers under 16,384
    weights by default: the tiny unet's are smaller, so the thresholds are lowered (the layout is the same)."""
    from diffusers import SDNQConfig, UNet2DConditionModel

    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    config = SDNQConfig(weights_dtype=weights_dtype, minimum_allowed_numel=256, minimum_allowed_channel_size=16,
                        **options)
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", quantization_config=config, torch_dtype=dtype)
    unet.save_pretrained(root / "unet")
    return root


OPTIONS = {"matmul": {"use_quantized_matmul": True},  # int8 weights stored transposed, scales [1, N]
           "conv": {"quant_conv": True}}  # convolutions quantized too: scales [O, 1, kh, kw]


@pytest.fixture(scope="module", params=["int8", "uint4", "float8_e4m3fn", "int8+matmul", "uint4+conv"])
def sdnq_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    scheme, _, option = request.param.partition("+")
    return _quantized_folder(tmp_path_factory.mktemp(f"sdnq-{scheme}{option}") / "tiny-sd", scheme, torch.float32,
                             **OPTIONS.get(option, {}))


@pytest.fixture(scope="module")
def uint4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _quantized_folder(tmp_path_factory.mktemp("sdnq-hostile") / "tiny-sd", "uint4", torch.float32)


def _views(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Where the archive's tensor views point, recorded as load_dduf asks for them."""
    views: set[int] = set()
    real = ArchiveComponentFiles.tensors

    def recording(self: ArchiveComponentFiles, filenames: Any) -> Any:
        out = real(self, filenames)
        views.update(t.data_ptr() for t in out.values())
        return out

    monkeypatch.setattr(ArchiveComponentFiles, "tensors", recording)
    return views


def _aligned(unet: torch.nn.Module) -> torch.nn.Module:
    """The model with every tensor moved to a fresh allocation. CPU GEMMs (MKL) round differently depending on
    their operands' alignment, and the archive's views sit at other offsets than diffusers' mmap of the folder
    (a skipped nn.Linear gave 7e-7 apart on identical weights): equal math is compared over equal placement."""
    with torch.no_grad():
        for tensor in [*unet.parameters(), *unet.buffers()]:
            tensor.data = tensor.data.clone()
    return unet


def _run(unet: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=gen, dtype=dtype)
    text = torch.randn(1, 77, unet.config.cross_attention_dim, generator=gen, dtype=dtype)
    with torch.no_grad():
        return unet(sample, 1, encoder_hidden_states=text).sample


def test_pack_records_validates_and_loads_as_diffusers(sdnq_folder: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import UNet2DConditionModel

    from dduf_plus.cli.info import quantization_tag
    from dduf_plus.inspection import inspect_dtypes

    archive = tmp_path / "sdnq.dduf"
    pack(sdnq_folder, archive, quiet=True)
    report = validate(archive, verify=True, strict=True)
    assert report.valid and not report.codes, str(report)
    qc = json.loads((sdnq_folder / "unet" / "config.json").read_text())["quantization_config"]
    scheme = qc["weights_dtype"]
    with DDUFArchive(archive) as opened:
        assert opened.read_bytes(f"unet/{WEIGHTS}") == (sdnq_folder / "unet" / WEIGHTS).read_bytes()
        record = opened.stored_index["components"]["unet"]["quantization"]
    assert (record["backend"], record["scheme"], record["skipped"]) == ("sdnq", scheme, len(qc["modules_to_not_convert"]))
    roles = {"weight": ".weight", "scale": ".scale"} | ({"zero_point": ".zero_point"} if scheme == "uint4" else {})
    assert record["roles"] == roles and record["quantized"] > 10
    assert quantization_tag({"quantization": record, "files": {}}) == f"quantized: sdnq {scheme}"
    assert inspect_dtypes(archive)["unet"]["quantization"] == record

    views = _views(monkeypatch)
    ours = load_dduf(archive).unet
    ref = UNet2DConditionModel.from_pretrained(sdnq_folder / "unet")
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    for key, x in a.items():
        assert type(x) is type(b[key]) and x.dtype == b[key].dtype and torch.equal(x, b[key]), key
        assert x.data_ptr() in views or not x.numel(), key  # every tensor views the archive: nothing copied
    layers = {n: m for n, m in ours.named_modules() if hasattr(m, "sdnq_dequantizer")}
    assert len(layers) == record["quantized"]
    for name, layer in layers.items():
        twin = ref.get_submodule(name)
        assert type(layer) is type(twin) and vars(layer.sdnq_dequantizer) == vars(twin.sdnq_dequantizer), name
    assert ours.is_quantized and ours.hf_quantizer is not None
    # as placed: close (int8 matmul quantizes activations, so a GEMM's last bit can move a rounding step)
    tolerance = 2e-3 if qc.get("use_quantized_matmul") else 1e-5
    torch.testing.assert_close(_run(ours, torch.float32), _run(ref, torch.float32), rtol=tolerance, atol=tolerance)
    assert torch.equal(_run(_aligned(ours), torch.float32), _run(_aligned(ref), torch.float32))


def test_sdnq_defaults_on_small_layers_validate_and_load(tmp_path: Path) -> None:
    """SDNQ's default minimum sizes (16,384 weights, 32 channels) skip every tiny-sd layer: diffusers writes a folder
    with a quantization_config and no quantized tensor. Q004 refused it ("no stored tensor is quantized"); it is
    what diffusers writes, so it validates (Q010, a warning) and loads as diffusers' from_pretrained(folder) does."""
    from diffusers import SDNQConfig, UNet2DConditionModel

    folder = tmp_path / "tiny-sd"
    shutil.copytree(TINY_SD, folder, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", quantization_config=SDNQConfig(weights_dtype="int8"))
    unet.save_pretrained(folder / "unet")
    archive = tmp_path / "sdnq-defaults.dduf"
    result, _ = pack(folder, archive, quiet=True)
    record = result.index["components"]["unet"]["quantization"]
    assert (record["backend"], record["scheme"], record["quantized"]) == ("sdnq", "int8", 0)
    report = validate(archive, verify=True)  # valid; Q010 (a warning) says no layer is quantized
    assert report.valid and report.codes == ["Q010"], str(report)
    ours = load_dduf(archive).unet
    ref = UNet2DConditionModel.from_pretrained(folder / "unet")
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert ours.is_quantized and ours.config["quantization_config"] == ref.config["quantization_config"]
    torch.testing.assert_close(_run(ours, torch.float32), _run(ref, torch.float32), rtol=1e-5, atol=1e-5)  # as placed
    assert torch.equal(_run(_aligned(ours), torch.float32), _run(_aligned(ref), torch.float32))


def test_bf16_component_keeps_its_float32_scales(tmp_path: Path) -> None:
    """A bf16 SDNQ component: torch_dtype="auto" keeps everything as saved (bf16 biases and norms, float32
    scales). diffusers' reload with torch_dtype=bfloat16 rounds the scales through bf16 (then back to float32):
    the only difference, which the test pins down."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    folder = _quantized_folder(tmp_path / "bf16", "int8", torch.bfloat16)
    archive = tmp_path / "bf16.dduf"
    pack(folder, archive, quiet=True)
    ours = load_dduf(archive, torch_dtype="auto").unet
    ref = UNet2DConditionModel.from_pretrained(folder / "unet", torch_dtype=torch.bfloat16)
    stored = load_file(folder / "unet" / WEIGHTS)
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b) == set(stored)
    scales = [k for k in a if k.endswith(".scale")]
    assert len(scales) > 10
    for key, x in a.items():
        assert x.dtype == stored[key].dtype and torch.equal(x, stored[key]), key  # as saved
        if key in scales:
            assert x.dtype == b[key].dtype == torch.float32
            assert torch.equal(x.to(torch.bfloat16).float(), b[key]), key  # diffusers' = ours rounded to bf16
        else:
            assert torch.equal(x, b[key]), key
    assert any(not torch.equal(a[k], b[k]) for k in scales)  # the rounding is real: this test can fail
    with torch.no_grad():
        for key in scales:  # diffusers' model given the stored scales computes exactly what ours does
            ref.get_parameter(key).copy_(a[key])
    assert torch.equal(_run(_aligned(ours), torch.bfloat16), _run(_aligned(ref), torch.bfloat16))


def test_sdnq_dtype_names_are_sdnqs() -> None:
    """The torch-free reading of weights_dtype names agrees with sdnq's own table for every name it accepts."""
    common = pytest.importorskip("sdnq.common")
    for name, row in common.dtype_dict.items():
        assert quant_sdnq.sdnq_dtype(name) == quant_sdnq.SDNQDtype(
            str(row["storage_dtype"]).removeprefix("torch."), row["num_bits"], row["is_packed"], row["is_unsigned"],
            row["is_integer"]), name
    for name in ("int0", "int64", "float9_e9m9fn", "fp99", "int8 ", "float8_e4m3fn_x"):
        assert quant_sdnq.sdnq_dtype(name) is None, name


# --- hostile quantization metadata: refused by code, by validate and by load_dduf alike ------------------------------
def _header(path: Path) -> tuple[dict[str, Any], int]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), n


def _rewrite_header(path: Path, edit: Any) -> None:
    raw = path.read_bytes()
    header, n = _header(path)
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _drop_scale(header: dict[str, Any], qc: dict[str, Any]) -> None:
    header[f"{LAYER}.scalX"] = header.pop(f"{LAYER}.scale")  # same bytes, no longer its scale


def _drop_zero_point(header: dict[str, Any], qc: dict[str, Any]) -> None:
    header[f"{LAYER}.zero_pointX"] = header.pop(f"{LAYER}.zero_point")


def _bad_scale_shape(header: dict[str, Any], qc: dict[str, Any]) -> None:
    header[f"{LAYER}.scale"]["shape"] = [8, 4]  # 32 floats, but not one per output row


def _zero_point_unlike_scale(header: dict[str, Any], qc: dict[str, Any]) -> None:
    header[f"{LAYER}.zero_point"]["shape"] = [1, 32]


def _lying_scheme(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["weights_dtype"] = "int8"  # the weights are packed uint8


def _skipped_but_quantized(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["modules_to_not_convert"].append(f"{LAYER}.weight")


def _too_many_patterns(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["modules_to_not_convert"] += [f"block{i}.weight" for i in range(quant_sdnq.MAX_SDNQ_PATTERNS)]


def _regex_pattern(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["modules_to_not_convert"].append("(a+)+*")  # SDNQ would re.match it against every parameter name


def _huge_loop(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["codebook_steps"] = 10**9


def _unknown_dtype(header: dict[str, Any], qc: dict[str, Any]) -> None:
    qc["scale_dtype"] = "__class__"


def _other_layer_shape(header: dict[str, Any], qc: dict[str, Any]) -> None:
    """Self-consistent ([16, 256] packed with scales [16, 2, 1]: the same bytes), but not the [32, 128] layer."""
    header[f"{WIDE}.weight"]["shape"] = [2048]
    header[f"{WIDE}.scale"]["shape"] = header[f"{WIDE}.zero_point"]["shape"] = [16, 4, 1]


HOSTILE = [(_drop_scale, "Q002"), (_drop_zero_point, "Q002"), (_bad_scale_shape, "Q003"),
           (_zero_point_unlike_scale, "Q003"), (_lying_scheme, "Q004"), (_skipped_but_quantized, "Q004"),
           (_too_many_patterns, "Q005"), (_regex_pattern, "Q005"), (_huge_loop, "Q005"), (_unknown_dtype, "Q005"),
           (_other_layer_shape, "Q006")]


@pytest.mark.parametrize(("edit", "code"), HOSTILE, ids=[e.__name__.strip("_") for e, _ in HOSTILE])
def test_hostile_sdnq_metadata_is_refused_by_code(uint4_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  edit: Any, code: str) -> None:
    folder = tmp_path / "hostile"
    shutil.copytree(uint4_folder, folder)
    config_path = folder / "unet" / "config.json"
    config = json.loads(config_path.read_text())
    _rewrite_header(folder / "unet" / WEIGHTS, lambda header: edit(header, config["quantization_config"]))
    config_path.write_text(json.dumps(config))
    # a foreign writer checks nothing: neither the pack-time records nor the validation of the written file
    monkeypatch.setattr(pack_module, "_backend_records", lambda sources: {})
    monkeypatch.setattr(importlib.import_module("dduf_plus.format.pack"), "check_written", lambda tmp, out: None)
    archive = tmp_path / "hostile.dduf"
    pack(folder, archive, quiet=True)
    report = validate(archive)
    assert report.codes == ([] if code == "Q006" else [code]), str(report)  # Q006 needs the model class
    with pytest.raises(DDUFError, match=code) as caught:  # refused before sdnq sees anything
        load_dduf(archive)
    assert "unet" in str(caught.value) and code in caught.value.codes
    if code != "Q006":
        monkeypatch.undo()  # dduf pack itself refuses to pack such a folder
        with pytest.raises(DDUFError, match=code):
            pack(folder, tmp_path / "again.dduf", quiet=True)


def test_missing_sdnq_names_component_backend_and_pip(uint4_folder: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "sdnq.dduf"
    pack(uint4_folder, archive, quiet=True)
    monkeypatch.setitem(sys.modules, "sdnq", None)  # `import sdnq` now fails
    with pytest.raises(DDUFLoadError, match=r"unet.*sdnq.*pip install 'dduf_plus\[quant\]'"):
        load_dduf(archive)
