"""Components quantized by diffusers' own torchao quantizer: pack (byte-faithful, the index records the
quantization), validate (--strict --verify clean; Q001-Q005 refuse inconsistent or hostile metadata), load
(same modules, state and outputs as diffusers' from_pretrained of the folder, the quantized data viewing the
archive) and a clear error when torchao is not installed; bitsandbytes nf4 / int8 recorded, checked and
loaded the same way."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torchao") is None:  # a reason without "could not import": .ci/run fails on those
    pytest.skip("torchao is not installed here (pip install -e '.[quant]')", allow_module_level=True)

import torch  # noqa: E402
from bnb_shapes import CPU_PATHS, assert_every_4bit_layer_repacks, require_cpu_path, use_cpu_path  # noqa: E402

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.errors import DDUFError, DDUFLoadError, DDUFValidationError  # noqa: E402
from dduf_plus.format import quant_bnb, quant_rules  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.format.quantization import QuantError  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.loading.files import ArchiveComponentFiles  # noqa: E402
from dduf_plus.packing.pack import pack  # noqa: E402

pack_module = importlib.import_module("dduf_plus.packing.pack")

TINY_SD = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"
WEIGHTS = "diffusion_pytorch_model.safetensors"
LAYER = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"  # an nn.Linear torchao quantized


@pytest.fixture(scope="module")
def torchao_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd whose unet diffusers quantized with torchao int8 weight-only and saved (save_pretrained)."""
    from diffusers import TorchAoConfig, UNet2DConditionModel
    from torchao.quantization import Int8WeightOnlyConfig

    root = tmp_path_factory.mktemp("torchao") / "tiny-sd-int8"
    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", torch_dtype=torch.bfloat16,
                                                quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    unet.save_pretrained(root / "unet")
    return root


@pytest.fixture(scope="module")
def torchao_archive(torchao_folder: Path) -> Path:
    out = torchao_folder.parent / "tiny-sd-int8.dduf"
    pack(torchao_folder, out, quiet=True)
    return out


def _header(path: Path) -> tuple[dict[str, Any], int]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), n


def _rewrite(folder: Path, edit: Any) -> None:
    """Rewrite unet's safetensors header (same data section) after ``edit(header)``: a hostile archive."""
    path = folder / "unet" / WEIGHTS
    raw = path.read_bytes()
    header, n = _header(path)
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _hostile(torchao_folder: Path, tmp_path: Path, edit: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hostile"
    shutil.copytree(torchao_folder, folder)
    _rewrite(folder, edit)
    # a foreign writer checks nothing: neither the pack-time records nor the validation of the written file
    monkeypatch.setattr(pack_module, "_backend_records", lambda sources: {})
    monkeypatch.setattr(importlib.import_module("dduf_plus.format.pack"), "check_written", lambda tmp, out: None)
    out = tmp_path / "hostile.dduf"
    pack(folder, out, quiet=True)
    return out


def test_pack_records_the_quantization_and_validates_clean(torchao_folder: Path, torchao_archive: Path) -> None:
    report = validate(torchao_archive, verify=True, strict=True)
    assert report.valid and not report.codes, str(report)
    with DDUFArchive(torchao_archive) as archive:  # byte-faithful: the entry is the folder's file
        assert archive.read_bytes(f"unet/{WEIGHTS}") == (torchao_folder / "unet" / WEIGHTS).read_bytes()
        record = archive.stored_index["components"]["unet"]["quantization"]
    assert record["backend"] == "torchao" and record["scheme"] == "int8_weight_only"
    assert record["tensor_types"] == ["Int8Tensor"] and record["quantized"] > 0
    assert record["roles"] == {"qdata": "._weight_qdata", "scale": "._weight_scale",
                               "zero_point": "._weight_zero_point"}
    from dduf_plus.cli.info import quantization_tag
    from dduf_plus.inspection import inspect_dtypes

    assert quantization_tag({"quantization": record, "files": {}}) == "quantized: torchao int8_weight_only"
    assert inspect_dtypes(torchao_archive)["unet"]["quantization"]["scheme"] == "int8_weight_only"
    assert "quantization" not in inspect_dtypes(torchao_archive)["vae"]


def test_load_equals_diffusers_reload_of_the_folder(torchao_folder: Path, torchao_archive: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import UNet2DConditionModel
    from torchao.quantization import Int8Tensor

    views: set[int] = set()  # where the archive's tensor views point: the quantized data must be those bytes
    real = ArchiveComponentFiles.tensors

    def recording(self: ArchiveComponentFiles, filenames: Any) -> Any:
        out = real(self, filenames)
        views.update(t.data_ptr() for t in out.values())
        return out

    monkeypatch.setattr(ArchiveComponentFiles, "tensors", recording)
    ours = load_dduf(torchao_archive).unet
    ref = UNet2DConditionModel.from_pretrained(torchao_folder / "unet")
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    quantized = 0
    for key, x in a.items():
        y = b[key]
        assert type(x) is type(y), key
        if isinstance(x, Int8Tensor):
            quantized += 1
            for part in ("qdata", "scale", "zero_point"):
                assert torch.equal(getattr(x, part), getattr(y, part)), (key, part)
            assert x.qdata.data_ptr() in views and x.scale.data_ptr() in views, key  # no copy
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), key
    assert quantized > 10
    assert ours.is_quantized and ours.hf_quantizer is not None
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=gen, dtype=torch.bfloat16)
    text = torch.randn(1, 77, ours.config.cross_attention_dim, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(sample, 1, encoder_hidden_states=text).sample,
                           ref(sample, 1, encoder_hidden_states=text).sample)


def _drop_scale(header: dict[str, Any]) -> None:
    header[f"{LAYER}._weight_scalX"] = header.pop(f"{LAYER}._weight_scale")  # same bytes, no longer its scale


def _bad_scale_shape(header: dict[str, Any]) -> None:
    header[f"{LAYER}._weight_scale"]["shape"] = [1, 32]


def _foreign_class(header: dict[str, Any]) -> None:
    meta = header["__metadata__"]
    meta[f"{LAYER}.weight"] = meta[f"{LAYER}.weight"].replace('"Int8Tensor"', '"subprocess.Popen"', 1)


def _torch_attribute_as_dtype(header: dict[str, Any]) -> None:
    meta = header["__metadata__"]
    meta[f"{LAYER}.weight"] = meta[f"{LAYER}.weight"].replace('"_data": "bfloat16"', '"_data": "load"', 1)


def _private_enum_member(header: dict[str, Any]) -> None:
    description = json.loads(header["__metadata__"][f"{LAYER}.weight"])
    description["_data"]["mapping"] = {"_type": "MappingType", "_data": "__class__"}
    header["__metadata__"][f"{LAYER}.weight"] = json.dumps(description)


def _deep_description(header: dict[str, Any]) -> None:
    header["__metadata__"][f"{LAYER}.weight"] = json.dumps(
        {"_type": "Int8Tensor", "_data": {"x": [[[[[[[[1]]]]]]]]}, "_tensor_data_names": ["qdata"]})


def _other_scheme(header: dict[str, Any]) -> None:
    meta = header["__metadata__"]
    meta[f"{LAYER}.weight"] = meta[f"{LAYER}.weight"].replace('"Int8Tensor"', '"Float8Tensor"', 1)


@pytest.mark.parametrize(("edit", "code"), [(_drop_scale, "Q002"), (_bad_scale_shape, "Q003"),
                                            (_foreign_class, "Q005"), (_torch_attribute_as_dtype, "Q005"),
                                            (_deep_description, "Q005"), (_private_enum_member, "Q005"),
                                            (_other_scheme, "Q004")])
def test_hostile_quantization_metadata_is_refused(torchao_folder: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, edit: Any, code: str) -> None:
    archive = _hostile(torchao_folder, tmp_path, edit, monkeypatch)
    report = validate(archive)
    assert report.codes == [code], str(report)
    with pytest.raises(DDUFValidationError, match=code) as caught:  # refused before anything is built
        load_dduf(archive)
    assert "unet" in str(caught.value) and code in caught.value.codes
    monkeypatch.undo()  # dduf pack itself refuses to pack such a folder
    with pytest.raises(DDUFError, match=code):
        pack(tmp_path / "hostile", tmp_path / "again.dduf", quiet=True)


def test_config_without_scheme_is_q001(torchao_folder: Path) -> None:
    config = json.loads((torchao_folder / "unet" / "config.json").read_text())
    config["quantization_config"]["quant_type"] = None
    assert [f.code for f in quant_rules.findings_for("unet", config, [])] == ["Q001"]
    del config["quantization_config"]["quant_method"]
    assert [f.code for f in quant_rules.findings_for("unet", config, [])] == ["Q001"]


def test_missing_torchao_names_component_backend_and_pip(torchao_archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now fails
    with pytest.raises(DDUFLoadError, match=r"unet.*torchao.*pip install 'dduf_plus\[quant\]'"):
        load_dduf(torchao_archive)


# --- bitsandbytes (nf4, int8): recorded, checked, loaded over the archive ------------------------------------------
@pytest.fixture(scope="module", params=["nf4", "int8"])
def bnb_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, bnb_sd: Path) -> Path:
    """bnb_sd (tiny SD whose 4-bit layers fit every CPU path: tests/bnb_shapes.py) whose unet diffusers quantized
    with bitsandbytes (its "No GPU found" gate bypassed: the library itself runs on CPU) and saved."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed here (pip install -e '.[quant]')")
    from diffusers import BitsAndBytesConfig, UNet2DConditionModel
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    patch = pytest.MonkeyPatch()
    for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
        patch.setattr(cls, "validate_environment", lambda self, *args, **kwargs: None)
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if request.param == "nf4"
              else BitsAndBytesConfig(load_in_8bit=True))
    root = tmp_path_factory.mktemp(f"bnb-{request.param}") / "tiny-sd"
    shutil.copytree(bnb_sd, root, ignore=shutil.ignore_patterns("unet"))
    try:
        unet = UNet2DConditionModel.from_pretrained(bnb_sd / "unet", quantization_config=config, device_map="cpu")
        unet.save_pretrained(root / "unet")  # before any forward: a CPU forward repacks 4-bit weights
    finally:
        patch.undo()
    return root


def test_bitsandbytes_is_recorded_validated_and_refused_clearly(bnb_folder: Path, tmp_path: Path) -> None:
    archive = tmp_path / "bnb.dduf"
    pack(bnb_folder, archive, quiet=True)
    report = validate(archive, verify=True, strict=True)
    assert report.valid and not report.codes, str(report)
    with DDUFArchive(archive) as opened:
        record = opened.stored_index["components"]["unet"]["quantization"]
    scheme = json.loads((bnb_folder / "unet" / "config.json").read_text())["quantization_config"]
    if scheme.get("load_in_4bit"):
        assert (record["backend"], record["scheme"]) == ("bitsandbytes_4bit", "nf4")
        assert record["roles"] == {"data": ".weight", "absmax": ".weight.absmax", "quant_map": ".weight.quant_map",
                                   "quant_state": ".weight.quant_state.bitsandbytes__nf4"}
    else:
        assert (record["backend"], record["scheme"]) == ("bitsandbytes_8bit", "int8")
        assert record["roles"] == {"data": ".weight", "SCB": ".SCB", "weight_format": ".weight_format"}
    assert record["quantized"] > 10


@pytest.mark.parametrize("cpu_path", CPU_PATHS)
def test_bitsandbytes_load_equals_diffusers_reload(bnb_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   cpu_path: str) -> None:
    """Same state and, on each of bitsandbytes' CPU paths for 4-bit layers (forced, not left to the machine),
    the same output as diffusers' own reload of the folder."""
    import bitsandbytes as bnb
    from diffusers import UNet2DConditionModel
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    archive = tmp_path / "bnb4.dduf"
    pack(bnb_folder, archive, quiet=True)
    four_bit = json.loads((bnb_folder / "unet" / "config.json").read_text())["quantization_config"].get("load_in_4bit")
    if not four_bit and cpu_path != CPU_PATHS[0]:
        pytest.skip("8-bit layers have one CPU path")
    require_cpu_path(cpu_path)  # before the work: skips where the CPU lacks the flag
    views: set[int] = set()
    real = ArchiveComponentFiles.tensors

    def recording(self: ArchiveComponentFiles, filenames: Any) -> Any:
        out = real(self, filenames)
        views.update(t.data_ptr() for t in out.values())
        return out

    monkeypatch.setattr(ArchiveComponentFiles, "tensors", recording)
    ours = load_dduf(archive).unet
    for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
        monkeypatch.setattr(cls, "validate_environment", lambda self, *args, **kwargs: None)  # CPU: no GPU gate
    ref = UNet2DConditionModel.from_pretrained(bnb_folder / "unet", device_map="cpu")
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    for key, x in a.items():
        assert type(x) is type(b[key]) and x.dtype == b[key].dtype and torch.equal(x, b[key]), key
    layers = [m for m in ours.modules() if isinstance(m, bnb.nn.Linear4bit if four_bit else bnb.nn.Linear8bitLt)]
    assert len(layers) > 10 and all(m.weight.data_ptr() in views for m in layers)  # quantized data: no copy
    assert ours.is_quantized and ours.hf_quantizer is not None
    if four_bit:
        assert_every_4bit_layer_repacks(ours)  # the shapes fit the AVX512-BF16 path, whatever this CPU has
        use_cpu_path(ours, cpu_path)
        use_cpu_path(ref, cpu_path)
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=gen, dtype=torch.float16)
    text = torch.randn(1, 77, ours.config.cross_attention_dim, generator=gen, dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(ours(sample, 1, encoder_hidden_states=text).sample,
                           ref(sample, 1, encoder_hidden_states=text).sample)


def test_bitsandbytes_parts_and_scheme_are_checked(bnb_folder: Path) -> None:
    from dduf_plus.format.safetensors_header import read_file_header

    config = json.loads((bnb_folder / "unet" / "config.json").read_text())
    header = read_file_header(bnb_folder / "unet" / WEIGHTS, "unet")
    assert quant_rules.findings_for("unet", config, [header]) == []
    four_bit = bool(config["quantization_config"].get("load_in_4bit"))
    part = f"{LAYER}.weight.absmax" if four_bit else f"{LAYER}.SCB"
    missing = header._replace(tensors={k: v for k, v in header.tensors.items() if k != part})
    assert [f.code for f in quant_rules.findings_for("unet", config, [missing])] == ["Q002"]
    if four_bit:  # the config says fp4, the quant states say nf4
        other = {**config, "quantization_config": {**config["quantization_config"], "bnb_4bit_quant_type": "fp4"}}
        assert [f.code for f in quant_rules.findings_for("unet", other, [header])] == ["Q004"]
        with pytest.raises(QuantError, match="Q005|over"):
            quant_bnb.parse_quant_state(b"{" * 5000, "x")
        assert quant_bnb.parse_quant_state(b'{"quant_type": "nf4", "blocksize": 64, "shape": [32, 32]}', "x")


def test_a_backend_without_a_loader_is_a_clear_error(tmp_path: Path) -> None:
    """A backend load_dduf does not rebuild (modelopt): packed and validated as any component, refused at load
    naming component and backend."""
    folder = tmp_path / "pipe"
    shutil.copytree(TINY_SD, folder)
    config = json.loads((folder / "vae" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_type": "FP8"}
    (folder / "vae" / "config.json").write_text(json.dumps(config))
    archive = tmp_path / "pipe.dduf"
    pack(folder, archive, quiet=True)
    with pytest.raises(DDUFLoadError, match=r"vae.*modelopt") as refused:
        load_dduf(archive)
    # the message names what load_dduf does rebuild, from the loaders' own tables (it said "quanto, torchao and
    # bitsandbytes" once SDNQ loaded too), and the CPU table covers every one of them
    assert "rebuilds bitsandbytes, quanto, sdnq and torchao only" in str(refused.value)
    from dduf_plus.loading.quant import CPU_BACKENDS
    from dduf_plus.loading.quant_backends import SUPPORTED

    assert {"quanto", *SUPPORTED} <= set(CPU_BACKENDS)
    assert all(CPU_BACKENDS[m].startswith("yes: zero-copy load by dduf_plus") for m in {"quanto", *SUPPORTED})


def _hostile_bnb(bnb_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bytes, new: bytes) -> Path:
    """bnb_folder's unet with the first ``old`` in its weights file replaced by ``new`` (same length), packed as a
    foreign writer would (nothing checked)."""
    folder = tmp_path / "hostile"
    shutil.copytree(bnb_folder, folder)
    weights = folder / "unet" / WEIGHTS
    raw = weights.read_bytes()
    assert old in raw
    weights.write_bytes(raw.replace(old, new.ljust(len(old)), 1))  # same length: only the JSON changes
    monkeypatch.setattr(pack_module, "_backend_records", lambda sources: {})
    monkeypatch.setattr(importlib.import_module("dduf_plus.format.pack"), "check_written", lambda tmp, out: None)
    archive = tmp_path / "hostile.dduf"
    pack(folder, archive, quiet=True)
    return archive


@pytest.mark.parametrize(("old", "new", "code"), [(b'"blocksize": 64', b'"blocksize": -1', "Q005"),
                                                  (b'"blocksize": 64', b'"blocksize":128', "Q003"),
                                                  (b'"shape": [', b'"shape":[9', "Q003"),
                                                  (b'"dtype": "float16"', b'"dtype": "bogus16"', "Q005"),
                                                  (b'"quant_type": "nf4"', b'"quant_type": {}', "Q005")])
def test_hostile_bitsandbytes_quant_state_is_refused_by_validate_and_load(
        bnb_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bytes, new: bytes, code: str) -> None:
    """The packed quant_state is JSON bitsandbytes parses: `dduf validate` reads and checks it (budget, values, fit
    to its tensors) as load_dduf does, with the same code (validate used to check only its size)."""
    if not json.loads((bnb_folder / "unet" / "config.json").read_text())["quantization_config"].get("load_in_4bit"):
        return  # 8-bit stores no quant_state
    archive = _hostile_bnb(bnb_folder, tmp_path, monkeypatch, old, new)
    report = validate(archive)
    assert report.codes == [code] and "unet" in str(report), str(report)
    with pytest.raises(DDUFError, match=rf"{code} \[unet/") as caught:
        load_dduf(archive)
    assert code in caught.value.codes


def test_quant_state_shape_unlike_the_layer_is_refused_at_load(bnb_folder: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A [512, 64] layer whose quant_state says [64, 512]: the same values and blocks, so self-consistent for
    validate, but bitsandbytes would dequantize it transposed: Q006 at load, naming component and layer."""
    if not json.loads((bnb_folder / "unet" / "config.json").read_text())["quantization_config"].get("load_in_4bit"):
        return  # 8-bit stores no quant_state
    archive = _hostile_bnb(bnb_folder, tmp_path, monkeypatch, b'"shape": [512, 64]', b'"shape": [64, 512]')
    assert validate(archive).valid
    with pytest.raises(DDUFLoadError, match=r"unet: Q006: \S+ff\.net\.0\.proj\.weight .*\[64, 512\].*\[512, 64\]") as caught:
        load_dduf(archive)
    assert caught.value.codes == ["Q006"]
