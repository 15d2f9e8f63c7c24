"""save_dduf of pipelines whose components diffusers quantized (torchao int8 weight-only, bitsandbytes nf4 / fp4 /
int8): the archive equals ``dduf pack`` of diffusers' own ``save_pretrained`` folder, entry for entry (the one
documented difference: the order of the safetensors ``__metadata__`` keys, which safetensors writes in hash
order), the quantized data is streamed from the live tensors (no clone), and a bitsandbytes 4-bit layer a CPU
forward repacked is stored in the canonical layout without touching the live model."""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torchao") is None or importlib.util.find_spec("bitsandbytes") is None:
    pytest.skip("torchao / bitsandbytes are not installed here (pip install -e '.[quant]')", allow_module_level=True)

import torch  # noqa: E402

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.errors import DDUFPackError  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.packing.pack import pack  # noqa: E402
from dduf_plus.packing.save import save_dduf  # noqa: E402

INDEX = "dduf_plus.index.json"
WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


def bnb_cpu_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' "No GPU found" gate for bitsandbytes: the library itself runs on the CPU."""
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
        monkeypatch.setattr(cls, "validate_environment", lambda self, *args, **kwargs: None)


def quantization_config(scheme: str) -> Any:
    from diffusers import BitsAndBytesConfig, TorchAoConfig

    if scheme == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    if scheme.startswith("sdnq-"):
        from diffusers import SDNQConfig

        # tiny-sd's layers are all under SDNQ's default minimum sizes (16384 elements, 32 channels)
        return SDNQConfig(weights_dtype=scheme.removeprefix("sdnq-"), minimum_allowed_numel=256,
                          minimum_allowed_channel_size=16)
    if scheme.startswith("quanto-"):
        from diffusers import QuantoConfig

        return QuantoConfig(weights_dtype=scheme.removeprefix("quanto-"))
    if scheme == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme.removeprefix("bnb-"))


def source_for(scheme: str, pipelines_dir: Path, bnb_sd: Path) -> Path:
    """The pipeline a scheme's tests quantize: tiny-sd, or for bitsandbytes bnb_sd, whose 4-bit layers fit both
    of bitsandbytes' CPU paths (tests/bnb_shapes.py; tiny-sd's are narrower than one block)."""
    return bnb_sd if scheme.startswith("bnb") else pipelines_dir / "tiny-sd"


def quantized_pipe(source: Path, scheme: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The pipeline folder ``source`` with its unet quantized by diffusers itself."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import logging as dlog

    dlog.disable_progress_bar()
    bnb_cpu_gate(monkeypatch)
    kwargs: dict[str, Any] = {"torch_dtype": torch.bfloat16} if scheme.startswith("torchao") else {"device_map": "cpu"}
    unet = UNet2DConditionModel.from_pretrained(source / "unet", quantization_config=quantization_config(scheme),
                                                **kwargs)
    return DiffusionPipeline.from_pretrained(source, unet=unet)


def entries(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if n != INDEX}


def split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes, int]:
    """(header as JSON, data section, header length)."""
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :], n


def assert_same_archive(ours: Path, theirs: Path) -> None:
    """Entry for entry equal; a weights file whose ``__metadata__`` has several keys (torchao) may differ only in
    that object's key order (safetensors writes it in hash order: two diffusers saves differ too)."""
    a, b = entries(ours), entries(theirs)
    assert sorted(a) == sorted(b)
    for name, data in b.items():
        if a[name] == data:
            continue
        assert name.endswith(".safetensors"), name
        (ha, da, na), (hb, db, nb) = split_safetensors(a[name]), split_safetensors(data)
        assert ha == hb and da == db and na == nb, name  # same JSON, same length, same tensor bytes
        assert list(ha) == list(hb) and len(ha["__metadata__"]) > 1, name  # only the metadata order differs
    with DDUFArchive(ours) as x, DDUFArchive(theirs) as y:
        assert x.stored_index["components"]["unet"].get("quantization") == y.stored_index["components"]["unet"].get(
            "quantization")


SDNQ = pytest.mark.skipif(importlib.util.find_spec("sdnq") is None, reason="sdnq is not installed here")


@pytest.mark.parametrize("scheme", ["torchao-int8", "bnb-nf4", "bnb-fp4", "bnb-int8",
                                    pytest.param("sdnq-int8", marks=SDNQ), pytest.param("sdnq-uint4", marks=SDNQ)])
def test_save_equals_packing_diffusers_save_pretrained(pipelines_dir: Path, bnb_sd: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    from dduf_plus.loading.quant_backends import SUPPORTED

    pipe = quantized_pipe(source_for(scheme, pipelines_dir, bnb_sd), scheme, monkeypatch)
    result = save_dduf(pipe, tmp_path / "ours.dduf", quiet=True)
    pipe.save_pretrained(tmp_path / "folder")
    pack(tmp_path / "folder", tmp_path / "theirs.dduf", quiet=True)
    assert_same_archive(result.path, tmp_path / "theirs.dduf")
    report = validate(result.path, verify=True, strict=True)
    assert report.valid and not report.codes, str(report)
    if scheme.startswith("sdnq") and "sdnq" not in SUPPORTED:
        return  # stored as diffusers writes it; recorded and loaded once dduf_plus reads SDNQ
    record = result.index["components"]["unet"]["quantization"]
    assert record["quantized"] > 10 and record["backend"].startswith(scheme.split("-")[0].replace("bnb", "bitsandb"))
    reloaded = load_dduf(result.path)  # it loads back as the same quantized model, and saves again to the same
    a, b = reloaded.unet.state_dict(), pipe.unet.state_dict()
    assert set(a) == set(b) and all(type(a[k]) is type(b[k]) for k in a)
    again = save_dduf(reloaded, tmp_path / "again.dduf", quiet=True)  # (model_index's _name_or_path differs)
    a_entries, b_entries = entries(again.path), entries(result.path)
    assert a_entries[WEIGHTS] == b_entries[WEIGHTS] or \
        split_safetensors(a_entries[WEIGHTS])[:2] == split_safetensors(b_entries[WEIGHTS])[:2]
    configs = [[line for line in e["unet/config.json"].splitlines() if b'"_name_or_path"' not in line]
               for e in (a_entries, b_entries)]
    if not scheme.startswith("sdnq"):  # quantization_config included, as diffusers writes it
        assert configs[0] == configs[1]
    else:  # SDNQ's loaded quantizer rewrites some of its options (add_skip_keys...): the scheme at least
        qc = [json.loads(e["unet/config.json"])["quantization_config"] for e in (a_entries, b_entries)]
        assert [(c["quant_method"], c["weights_dtype"]) for c in qc] == [("sdnq", scheme.removeprefix("sdnq-"))] * 2
    assert again.index["components"]["unet"]["quantization"] == record


def test_torchao_parts_are_streamed_from_the_live_tensors(pipelines_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's own flattening clones every quantized part; ours hands the writer views of them."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    from dduf_plus.torchkit.quant_state import torchao_flat_state

    unet = quantized_pipe(pipelines_dir / "tiny-sd", "torchao-int8", monkeypatch).unet
    state = unet.state_dict()
    ours, meta = torchao_flat_state(state)
    theirs, their_meta = flatten_tensor_state_dict(state)
    assert list(ours) == list(theirs) and meta == their_meta
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    layer = unet.get_submodule("mid_block.attentions.0.transformer_blocks.0.attn1.to_q")
    assert ours["mid_block.attentions.0.transformer_blocks.0.attn1.to_q._weight_qdata"].data_ptr() == \
        layer.weight.qdata.data_ptr()


def _repack_for_cpu(unet: Any) -> list[Any]:
    """What a CPU forward does to each 4-bit layer on an AVX512-BF16 machine (bitsandbytes' own function): every
    layer of bnb_sd's unet fits it (tests/bnb_shapes.py), as quant_bnb.bnb_cpu_repack_problem agrees."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu
    from bnb_shapes import four_bit_layers

    from dduf_plus.format.quant_bnb import bnb_cpu_repack_problem

    repacked = four_bit_layers(unet)
    for module in repacked:
        state = module.weight.quant_state
        assert bnb_cpu_repack_problem(state.shape, state.blocksize) is None
        module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(module.weight.data, state)
    return repacked


def test_bitsandbytes_repacked_by_a_cpu_forward_is_saved_canonical(bnb_sd: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The trap: bitsandbytes' own save of a repacked layer writes absmax transposed in bfloat16 (and undoes the
    live layer's repack). save_dduf writes the canonical layout, the live model keeps its repack."""
    pipe = quantized_pipe(bnb_sd, "bnb-nf4", monkeypatch)
    save_dduf(pipe, tmp_path / "before.dduf", quiet=True)
    repacked = _repack_for_cpu(pipe.unet)
    assert len(repacked) >= 4
    with caplog.at_level(logging.WARNING, logger="dduf_plus.torchkit.quant_state"):
        save_dduf(pipe, tmp_path / "after.dduf", quiet=True)
    assert f"{len(repacked)} bitsandbytes 4-bit layers were repacked" in caplog.text
    assert all(m.weight.quant_state.packing_format_for_cpu for m in repacked)  # the live model is untouched
    report = validate(tmp_path / "after.dduf", verify=True, strict=True)
    assert report.valid and not report.codes, str(report)
    before = load_dduf(tmp_path / "before.dduf").unet.state_dict()
    after = load_dduf(tmp_path / "after.dduf").unet.state_dict()
    names = {n for n, m in pipe.unet.named_modules() if m in repacked}
    for key, tensor in before.items():
        layer = key.split(".weight")[0]
        if layer in names and key.endswith(".absmax"):  # what the repack kept: the bf16-rounded absmax
            assert after[key].dtype == torch.float32 and torch.equal(after[key], tensor.to(torch.bfloat16).float())
            assert not torch.equal(after[key], tensor)
        else:  # packed data, quant_map, quant_state JSON, every other tensor: as before the forward
            assert torch.equal(after[key], tensor), key
    # what bitsandbytes' own state_dict writes for it is not the canonical layout (the reason for the above)
    own = pipe.unet.state_dict()
    key = f"{sorted(names)[0]}.weight.absmax"
    assert own[key].dtype == torch.bfloat16 and own[key].dim() == 2


def test_dtype_does_not_apply_to_backend_quantized_components(bnb_sd: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = quantized_pipe(bnb_sd, "bnb-int8", monkeypatch)
    with pytest.raises(DDUFPackError, match=r"'unet' is quantized with bitsandbytes: dtype float16"):
        save_dduf(pipe, tmp_path / "x.dduf", dtype={"unet": "float16"}, quiet=True)
    result = save_dduf(pipe, tmp_path / "x.dduf", dtype="bfloat16", quiet=True)  # a default: the others convert
    with DDUFArchive(result.path) as archive:
        assert archive.headers[WEIGHTS].tensors["conv_in.weight"].dtype == "float16"  # as quantized (bnb: fp16)
        assert archive.headers["vae/diffusion_pytorch_model.safetensors"].tensors["decoder.conv_in.weight"].dtype \
            == "bfloat16"


def test_double_quantized_layers_repacked_by_a_cpu_forward_are_quantized_again(
        bnb_sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With bnb_4bit_use_double_quant the repack dequantizes absmax; the save quantizes it again as quantize_4bit
    does (blockwise 256 around its mean): same layout and packed data, weights equal within that rounding."""
    import bitsandbytes as bnb
    from diffusers import BitsAndBytesConfig, DiffusionPipeline, UNet2DConditionModel

    bnb_cpu_gate(monkeypatch)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    unet = UNet2DConditionModel.from_pretrained(bnb_sd / "unet", quantization_config=config, device_map="cpu")
    pipe = DiffusionPipeline.from_pretrained(bnb_sd, unet=unet)
    save_dduf(pipe, tmp_path / "before.dduf", quiet=True)
    repacked = _repack_for_cpu(pipe.unet)
    save_dduf(pipe, tmp_path / "after.dduf", quiet=True)
    assert repacked and all(m.weight.quant_state.packing_format_for_cpu for m in repacked)  # live model untouched
    assert validate(tmp_path / "after.dduf", verify=True, strict=True).valid
    before, after = load_dduf(tmp_path / "before.dduf").unet, load_dduf(tmp_path / "after.dduf").unet
    a, b = before.state_dict(), after.state_dict()
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype for k in a)
    # same tensors and shapes; the packed quant_state JSON holds the new offset (other digits, other length)
    assert all(a[k].shape == b[k].shape for k in a if not k.endswith("quant_state.bitsandbytes__nf4"))
    key = f"{sorted(names := {n for n, m in pipe.unet.named_modules() if m in repacked})[0]}.weight"
    state_a, state_b = (json.loads(bytes(t[f"{key}.quant_state.bitsandbytes__nf4"].tolist())) for t in (a, b))
    assert set(state_a) == set(state_b) and state_a["nested_offset"] != state_b["nested_offset"]
    for name in names:
        x, y = before.get_submodule(name).weight, after.get_submodule(name).weight
        assert torch.equal(x.data, y.data)  # the packed nibbles, exactly
        wx = bnb.functional.dequantize_4bit(x.data, x.quant_state)
        wy = bnb.functional.dequantize_4bit(y.data, y.quant_state)
        assert torch.allclose(wx.float(), wy.float(), rtol=0.02, atol=1e-3), name


def _registered(model: Any) -> dict[str, Any]:
    """What diffusers' from_pretrained leaves on a quantized model: attributes, config, quantizer state."""
    config = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in model.config.items() if k != "_name_or_path"}
    quantizer = dict(vars(model.hf_quantizer))
    quantizer.pop("_checkpoint_keys", None)  # bitsandbytes' bookkeeping while diffusers reads shards: unused after
    if "torch_dtype" in quantizer and quant_rules_backend(model) == "sdnq":
        quantizer.pop("torch_dtype")  # diffusers leaves None; ours is the saved compute dtype (docs/precision.md)
    quantizer["quantization_config"] = quantizer["quantization_config"].to_dict()
    return {"is_quantized": model.is_quantized, "quantization_method": model.quantization_method,
            "quantizer": (type(model.hf_quantizer), quantizer), "config": config}


def quant_rules_backend(model: Any) -> str:
    return str(getattr(model.quantization_method, "value", model.quantization_method))


@pytest.mark.parametrize("scheme", ["torchao-int8", "bnb-nf4", "bnb-int8", pytest.param("sdnq-int8", marks=SDNQ)])
def test_loaded_model_carries_what_diffusers_from_pretrained_leaves(pipelines_dir: Path, bnb_sd: Path,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    scheme: str) -> None:
    """load_dduf's quantized model registers its quantizer as diffusers' from_pretrained(folder) does (torchao's
    save_pretrained raised AttributeError 'offload'; config.quantization_config was missing), so diffusers' own
    save_pretrained of it writes what it writes from its own load (config.json but _name_or_path; the same
    tensors and __metadata__, whose key order safetensors picks)."""
    from diffusers import UNet2DConditionModel

    quantized_pipe(source_for(scheme, pipelines_dir, bnb_sd), scheme, monkeypatch).save_pretrained(tmp_path / "folder")
    pack(tmp_path / "folder", tmp_path / "p.dduf", quiet=True)
    kwargs = {"device_map": "cpu"} if scheme.startswith("bnb") else {}
    theirs = UNet2DConditionModel.from_pretrained(tmp_path / "folder" / "unet", **kwargs)
    ours = load_dduf(tmp_path / "p.dduf").unet
    assert "quantization_config" in ours.config and ours.config["_pre_quantization_dtype"] == \
        theirs.config["_pre_quantization_dtype"]
    assert _registered(ours) == _registered(theirs)
    theirs.save_pretrained(tmp_path / "theirs")
    ours.save_pretrained(tmp_path / "ours")
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        a, b = ((tmp_path / who / name).read_bytes() for who in ("ours", "theirs"))
        if name == "config.json":
            a, b = ([line for line in x.splitlines() if b'"_name_or_path"' not in line] for x in (a, b))
            assert a == b
        else:
            assert a == b or split_safetensors(a)[:2] == split_safetensors(b)[:2]
