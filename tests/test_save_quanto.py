"""save_dduf of optimum-quanto pipelines: quantized tensors streamed, map and index record written, the same
archive as save_quanto_component + `dduf pack`, reloaded by load_dduf with identical outputs."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

pytest.importorskip("optimum.quanto")
from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize  # noqa: E402
from optimum.quanto.tensor import QTensor  # noqa: E402

from conftest import PIPELINES  # noqa: E402
from dduf_plus.cli import main as cli_main  # noqa: E402
from dduf_plus.errors import DDUFPackError  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.loading import quant  # noqa: E402
from dduf_plus.loading.pipeline import load_dduf  # noqa: E402
from dduf_plus.packing.save import save_dduf  # noqa: E402

QTYPES = {"qint8": qint8, "qfloat8": qfloat8, "qint4": qint4}
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
QMAP = "unet/quanto_qmap.json"


def _pipe():
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as dlog

    dlog.disable_progress_bar()
    pipe = DiffusionPipeline.from_pretrained(PIPELINES / "tiny-sd")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _quantize(model, qtype):
    quantize(model, weights=qtype)
    freeze(model)
    return model


def _images(pipe) -> torch.Tensor:
    return pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def _quantized_weights(model) -> dict[str, type]:
    return {name: type(m.weight) for name, m in model.named_modules() if isinstance(getattr(m, "weight", None), QTensor)}


@pytest.fixture(scope="module", params=list(QTYPES))
def saved(request, tmp_path_factory):
    """(qtype name, in-memory pipeline with a quantized unet, save_dduf's result)."""
    pipe = _pipe()
    _quantize(pipe.unet, QTYPES[request.param])
    result = save_dduf(pipe, tmp_path_factory.mktemp(f"save-{request.param}") / "pipe.dduf", quiet=True)
    return request.param, pipe, result


def test_reloaded_pipeline_gives_identical_images(saved):
    _name, pipe, result = saved
    reloaded = load_dduf(result.path)
    reloaded.set_progress_bar_config(disable=True)
    assert _quantized_weights(reloaded.unet) == _quantized_weights(pipe.unet) != {}  # quantized, not dequantized
    with torch.no_grad():
        assert torch.equal(_images(pipe), _images(reloaded))


def test_quantized_tensors_map_and_index_record(saved):
    name, pipe, result = saved
    tensors, qmap = quant.quanto_state(pipe.unet)
    record = result.index["components"]["unet"]["quantization"]
    assert record == quant.quanto_index_record(json.loads(qmap))["quantization"]
    assert record["method"] == "optimum-quanto" and record["weights"] == [QTYPES[name].name]
    assert "quantization" not in result.index["components"]["vae"]
    with DDUFArchive(result.path) as archive:
        assert archive.read_bytes(QMAP) == qmap
        header = archive.headers[UNET_WEIGHTS].tensors
        assert set(header) == set(tensors)
        key = "conv_in.weight._data._data" if name == "qint4" else "conv_in.weight._data"
        assert header[key].dtype == {"qint8": "int8", "qfloat8": "float8_e4m3fn", "qint4": "uint8"}[name]
        stored = archive.tensors("unet")
        assert all(stored[k].dtype == t.dtype and torch.equal(stored[k].reshape(-1).view(torch.uint8),
                                                              t.reshape(-1).view(torch.uint8))
                   for k, t in tensors.items())


def test_result_validates(saved, capsys):
    _name, _pipe, result = saved
    report = validate(result.path, verify=True, strict=True)
    assert report.valid, report
    assert cli_main(["validate", "--verify", "--json", str(result.path)]) == 0
    assert json.loads(capsys.readouterr().out)["files"][0]["valid"] is True


def test_archive_equals_save_quanto_component_and_pack(tmp_path):
    """qint4 unet + qint8 text encoder: save_dduf writes the bytes of the folder route, byte for byte, and
    the reloaded text encoder computes exactly what the in-memory one does."""
    from dduf_plus.packing import pack

    pipe = _pipe()
    pipe.save_pretrained(tmp_path / "folder")  # the other components, as docs/precision.md says
    _quantize(pipe.unet, qint4)
    _quantize(pipe.text_encoder, qint8)
    quant.save_quanto_component(pipe.unet, tmp_path / "folder" / "unet")
    quant.save_quanto_component(pipe.text_encoder, tmp_path / "folder" / "text_encoder")
    folder_route, _ = pack(tmp_path / "folder", tmp_path / "packed.dduf", quiet=True)
    result = save_dduf(pipe, tmp_path / "saved.dduf", quiet=True)
    assert result.index == folder_route.index
    assert result.path.read_bytes() == folder_route.path.read_bytes()
    assert result.index["components"]["text_encoder"]["quantization"]["weights"] == ["qint8"]

    reloaded = load_dduf(result.path)
    reloaded.set_progress_bar_config(disable=True)
    assert _quantized_weights(reloaded.text_encoder) == _quantized_weights(pipe.text_encoder) != {}
    ids = pipe.tokenizer(["a cat"], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(pipe.text_encoder(ids)[0], reloaded.text_encoder(ids)[0])
        assert torch.equal(_images(pipe), _images(reloaded))
    assert validate(result.path, verify=True).valid


@pytest.mark.parametrize("saved", ["qint8"], indirect=True)
def test_dtype_never_touches_quantized_values(saved, tmp_path):
    _name, pipe, plain = saved
    result = save_dduf(pipe, tmp_path / "bf16.dduf", dtype=torch.bfloat16, quiet=True)
    with DDUFArchive(result.path) as archive, DDUFArchive(plain.path) as before:
        header = archive.headers[UNET_WEIGHTS].tensors
        assert {t.dtype for n, t in header.items() if n.endswith("._data")} == {"int8"}
        assert {t.dtype for n, t in header.items() if not n.endswith("._data")} == {"bfloat16"}  # scales, biases
        new, old = archive.tensors("unet"), before.tensors("unet")
        assert all(torch.equal(new[n], old[n]) for n in header if n.endswith("._data"))
    reloaded = load_dduf(result.path).unet
    weight = reloaded.conv_in.weight
    assert isinstance(weight, QTensor) and weight._data.dtype == torch.int8 and weight._scale.dtype == torch.bfloat16

    with pytest.raises(DDUFPackError, match="optimum-quanto.*float8_e4m3fn"):  # named: refused
        save_dduf(pipe, tmp_path / "fp8.dduf", dtype={"unet": torch.float8_e4m3fn}, quiet=True)
    assert not (tmp_path / "fp8.dduf").exists()
    result = save_dduf(pipe, tmp_path / "fp8.dduf", dtype=torch.float8_e4m3fn, quiet=True)  # a default: skipped
    with DDUFArchive(result.path) as archive, DDUFArchive(plain.path) as before:
        assert archive.read_bytes(UNET_WEIGHTS) == before.read_bytes(UNET_WEIGHTS)


@pytest.mark.parametrize("saved", ["qint8"], indirect=True)
def test_variant_names_the_quantized_weights(saved, tmp_path):
    _name, pipe, _result = saved
    result = save_dduf(pipe, tmp_path / "v.dduf", variant="fp16", quiet=True)
    with zipfile.ZipFile(result.path) as z:
        assert "unet/diffusion_pytorch_model.fp16.safetensors" in z.namelist()
    reloaded = load_dduf(result.path, variant="fp16").unet
    assert _quantized_weights(reloaded) == _quantized_weights(pipe.unet)


@pytest.mark.parametrize("saved", ["qint8", "qfloat8"], indirect=True)
def test_quantized_values_are_streamed_from_the_module_not_copied(saved):
    """The weights entry's chunks are views of the module's own quantized tensors (no copy, no temp file)."""
    import ctypes

    from dduf_plus.packing.save import _component_sources

    _name, pipe, _result = saved
    sources, _skipped, record = _component_sources("unet", pipe.unet, None, None)
    assert record is not None and record["quantization"]["method"] == "optimum-quanto"
    (weights,) = [s for s in sources if s.name == UNET_WEIGHTS]
    assert weights.path is None and weights.data is None  # streamed
    addresses = {ctypes.addressof(ctypes.c_char.from_buffer(chunk)) for chunk in list(weights.chunks())[1:]}
    data = [m.weight._data for m in pipe.unet.modules() if isinstance(getattr(m, "weight", None), QTensor)]
    assert data and all(d.data_ptr() in addresses for d in data)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # diffusers deprecates QuantoConfig
def test_unfrozen_and_quantizer_backends_are_refused(tmp_path):
    from diffusers import QuantoConfig, UNet2DConditionModel

    pipe = _pipe()
    quantize(pipe.unet, weights=qint8)  # no freeze: weights are still floats
    with pytest.raises(DDUFPackError, match="freeze"):
        save_dduf(pipe, tmp_path / "x.dduf", quiet=True)
    assert not (tmp_path / "x.dduf").exists()
    # diffusers' own QuantoConfig backend is stored as its save_pretrained writes it (as bitsandbytes and torchao)
    pipe.unet = UNet2DConditionModel.from_pretrained(PIPELINES / "tiny-sd", subfolder="unet",
                                                     quantization_config=QuantoConfig(weights_dtype="int8"))
    assert pipe.unet.hf_quantizer is not None
    save_dduf(pipe, tmp_path / "x.dduf", quiet=True)
    assert validate(tmp_path / "x.dduf").valid
