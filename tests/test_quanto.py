"""optimum-quanto components: save, pack, reload without full-precision weights, identical outputs."""

from __future__ import annotations

import ctypes
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("optimum.quanto")
from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from conftest import PIPELINES  # noqa: E402
from dduf_plus.errors import DDUFLoadError, DDUFPackError  # noqa: E402
from dduf_plus.format.archive import DDUFArchive  # noqa: E402
from dduf_plus.format.pack import pack_folder  # noqa: E402
from dduf_plus.loading import quant  # noqa: E402

QTYPES = {"qint8": qint8, "qfloat8": qfloat8, "qint4": qint4}


def _quantized_transformer(qtype, dtype=torch.bfloat16):
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer", torch_dtype=dtype)
    quantize(model, weights=qtype)
    freeze(model)
    return model.eval()


def _write_component(pipeline: Path, component: str, model: torch.nn.Module, out: Path, *,
                     aligned: bool = True) -> Path:
    """The pipeline folder with ``component`` replaced by the quantized model: by
    ``save_quanto_component`` (tensors in aligned order) or as plain ``safetensors.save_file`` writes it."""
    shutil.copytree(pipeline, out)
    folder = out / component
    if aligned:
        quant.save_quanto_component(model, folder)
        return out
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    tensors, qmap = quant.quanto_state(model)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    (folder / quant.QMAP_NAME).write_bytes(qmap)
    return out


def _transformer_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=g).to(dtype), timestep=torch.tensor([10]),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None})


@pytest.fixture(scope="module", params=list(QTYPES))
def quantized_dit(request, tmp_path_factory):
    """(qtype name, in-memory quantized transformer, packed archive of the pipeline holding it)."""
    model = _quantized_transformer(QTYPES[request.param])
    root = tmp_path_factory.mktemp(f"quanto-{request.param}")
    folder = _write_component(PIPELINES / "tiny-dit", "transformer", model, root / "pipe")
    archive = pack_folder(folder, root / "pipe.dduf", quiet=True).path
    return request.param, model, archive


def test_state_holds_plain_quantized_tensors(quantized_dit):
    name, model, archive = quantized_dit
    tensors, qmap = quant.quanto_state(model)
    key = "transformer_blocks.0.attn1.to_q.weight"
    assert all(type(t) is torch.Tensor and t.is_contiguous() for t in tensors.values())
    expected = {"qint8": torch.int8, "qfloat8": torch.float8_e4m3fn, "qint4": torch.uint8}[name]
    data = tensors[f"{key}._data._data" if name == "qint4" else f"{key}._data"]
    assert data.dtype == expected
    assert tensors[f"{key}._scale"].dtype == torch.bfloat16
    assert json.loads(qmap)["transformer_blocks.0.attn1.to_q"]["weights"] == QTYPES[name].name
    with DDUFArchive(archive) as a:  # `dduf pack` of a folder holding quanto_qmap.json: a plain copy
        assert "transformer/quanto_qmap.json" in a
        assert json.loads(a.read_bytes("transformer/quanto_qmap.json")) == json.loads(qmap)


def test_reloaded_model_gives_identical_outputs(quantized_dit):
    from dduf_plus.loading.pipeline import load_dduf

    name, model, archive = quantized_dit
    pipe = load_dduf(archive)
    reloaded = pipe.transformer
    weight = reloaded.transformer_blocks[0].attn1.to_q.weight
    assert type(weight) is type(model.transformer_blocks[0].attn1.to_q.weight)
    assert weight.dtype == torch.bfloat16
    inputs = _transformer_inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reloaded(**inputs).sample)


@pytest.mark.parametrize("quantized_dit", ["qint8", "qfloat8"], indirect=True)  # qint4 is unpacked at load
def test_quantized_values_view_the_archive(quantized_dit):
    """int8/fp8 quantized values are the archive's bytes (no copy); nothing else got allocated for them."""
    from diffusers import PixArtTransformer2DModel

    from dduf_plus.loading.files import ArchiveComponentFiles

    _name, _model, archive_path = quantized_dit
    with DDUFArchive(archive_path) as archive:
        files = ArchiveComponentFiles(archive, "transformer")
        model = quant.load_quanto_component(PixArtTransformer2DModel, files.read_json("config.json"), files)
        mm = archive.mmap
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        stored = archive.tensor_infos("transformer")
        for prefix, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if hasattr(weight, "_data") and weight._data.dtype in (torch.int8, torch.float8_e4m3fn):
                entry, info = stored[f"{prefix}.weight._data"]
                offset = archive.entry(entry).offset + archive.headers[entry].data_start + info.begin
                assert weight._data.data_ptr() == base + offset, prefix
        del model, files
        import gc

        gc.collect()


@pytest.mark.parametrize("quantized_dit", ["qint8"], indirect=True)  # the model-level test covers every qtype
def test_pipeline_outputs_equal_in_memory_pipeline(quantized_dit, packed):
    from dduf_plus.loading.pipeline import load_dduf

    _name, model, archive = quantized_dit
    from dduf_plus.loading.bridge import install_bridge

    in_memory = load_dduf(packed["tiny-dit"])
    in_memory.transformer = model  # the quantized component that was saved
    install_bridge(in_memory)  # its mixed dtypes (bf16 transformer, fp32 text encoder) as load_dduf runs them
    reloaded = load_dduf(archive)
    outputs = []
    for pipe in (in_memory, reloaded):
        pipe.set_progress_bar_config(disable=True)
        g = torch.Generator().manual_seed(0)
        outputs.append(pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt", generator=g,
                            use_resolution_binning=False, clean_caption=False).images)
    assert torch.equal(outputs[0], outputs[1])


def test_misaligned_bf16_qint8_from_plain_save_file(tmp_path):
    """A foreign writer's layout (safetensors.save_file) leaves int8 weights off 16-byte boundaries; quanto's
    bf16 CPU kernel would crash on them, so exactly those are copied, and outputs still match."""
    from dduf_plus.loading.pipeline import load_dduf

    model = _quantized_transformer(qint8)
    folder = _write_component(PIPELINES / "tiny-dit", "transformer", model, tmp_path / "pipe", aligned=False)
    reloaded = load_dduf(pack_folder(folder, tmp_path / "pipe.dduf", quiet=True).path).transformer
    inputs = _transformer_inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reloaded(**inputs).sample)
    assert all(m.weight._data.data_ptr() % quant.KERNEL_ALIGNMENT == 0 for m in reloaded.modules()
               if hasattr(getattr(m, "weight", None), "_data"))


def test_qint8_unet_round_trip(tmp_path):
    """Convolutions too, in fp16 (the tiny SD unet's saved dtype), from a plain save_file layout."""
    from diffusers import UNet2DConditionModel

    from dduf_plus.loading.pipeline import load_dduf

    unet = UNet2DConditionModel.from_pretrained(PIPELINES / "tiny-sd", subfolder="unet", torch_dtype=torch.float16)
    quantize(unet, weights=qint8)
    freeze(unet)
    folder = _write_component(PIPELINES / "tiny-sd", "unet", unet, tmp_path / "pipe", aligned=False)
    archive = pack_folder(folder, tmp_path / "pipe.dduf", quiet=True).path
    reloaded = load_dduf(archive).unet
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=g).half()
    context = torch.randn(1, 7, 32, generator=g).half()
    with torch.no_grad():
        assert torch.equal(unet(sample, 10, context).sample, reloaded(sample, 10, context).sample)


def test_diffusers_quanto_config_loads_zero_copy(tmp_path):
    from diffusers import PixArtTransformer2DModel, QuantoConfig

    from dduf_plus.loading.files import FolderComponentFiles

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     quantization_config=QuantoConfig(weights_dtype="int8"),
                                                     torch_dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "transformer")
    files = FolderComponentFiles(tmp_path / "transformer")
    config = files.read_json("config.json")
    assert quant.backend_of(config) == "quanto"
    reloaded = quant.load_with_diffusers_quantizer(PixArtTransformer2DModel, config, files)
    inputs = _transformer_inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reloaded(**inputs).sample)


def test_missing_optimum_quanto_says_how_to_install(quantized_dit, monkeypatch):
    from dduf_plus.loading.pipeline import load_dduf

    _name, _model, archive = quantized_dit
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)  # `import optimum.quanto` now fails
    with pytest.raises(DDUFLoadError, match=r"pip install .dduf_plus\[quanto\]"):
        load_dduf(archive)


def test_state_refuses_unfrozen_and_ignores_plain_modules():
    assert quant.quanto_state(torch.nn.Linear(4, 4)) is None
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    quantize(model, weights=qint8)
    with pytest.raises(DDUFPackError, match="freeze"):
        quant.quanto_state(model)


def test_bad_map_and_mismatched_tensors_are_load_errors(quantized_dit):
    from diffusers import PixArtTransformer2DModel

    from dduf_plus.loading.files import ArchiveComponentFiles

    _name, _model, archive_path = quantized_dit
    with DDUFArchive(archive_path) as archive:
        files = ArchiveComponentFiles(archive, "transformer")
        config = files.read_json("config.json")
        with pytest.raises(DDUFLoadError, match="unknown weights qtype"):
            quant.load_quanto_component(PixArtTransformer2DModel, config, files, qmap={"proj_out": {"weights": "qint3"}})
        with pytest.raises(DDUFLoadError, match="does not have"):
            quant.load_quanto_component(PixArtTransformer2DModel, config, files, qmap={"nope": {"weights": "qint8"}})
        with pytest.raises(DDUFLoadError, match="do not match"):  # the map says less than the tensors hold
            quant.load_quanto_component(PixArtTransformer2DModel, config, files,
                                        qmap={"proj_out": {"weights": "qint8", "activations": "none"}})


def test_index_record_is_torch_free():
    record = quant.quanto_index_record({"a": {"weights": "qint8", "activations": "none"},
                                        "b": {"weights": "qint4", "activations": "none"}})
    assert record == {"quantization": {"method": "optimum-quanto", "map": "quanto_qmap.json", "modules": 2,
                                       "weights": ["qint4", "qint8"], "activations": []}}


def test_load_dduf_of_a_quanto_config_component(tmp_path):
    """A pipeline whose transformer was saved by diffusers with QuantoConfig loads through load_dduf
    (the quantizer path), quantized, with outputs equal to the model that was saved."""
    from diffusers import PixArtTransformer2DModel, QuantoConfig
    from optimum.quanto import QLinear

    from dduf_plus.loading.pipeline import load_dduf

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     quantization_config=QuantoConfig(weights_dtype="int8"),
                                                     torch_dtype=torch.bfloat16)
    folder = tmp_path / "pipe"
    shutil.copytree(PIPELINES / "tiny-dit", folder, ignore=shutil.ignore_patterns("transformer"))
    model.save_pretrained(folder / "transformer")
    archive = pack_folder(folder, tmp_path / "pipe.dduf", quiet=True).path
    pipe = load_dduf(archive)
    reloaded = pipe.transformer
    assert any(isinstance(m, QLinear) for m in reloaded.modules())
    assert reloaded.dtype == torch.bfloat16
    inputs = _transformer_inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reloaded(**inputs).sample)


def test_a_quantizer_that_cannot_run_here_is_a_clear_error(tmp_path):
    """A config claiming bitsandbytes over unquantized tensors: a DDUFError naming the component and the
    backend, no traceback (Q004 at pack time; a real bitsandbytes archive's load refusal is in
    tests/test_quant_backends.py)."""
    from dduf_plus.errors import DDUFError

    folder = tmp_path / "pipe"
    shutil.copytree(PIPELINES / "tiny-sd", folder)
    config = json.loads((folder / "vae" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (folder / "vae" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDUFError, match=r"Q004.*vae.*bitsandbytes"):
        pack_folder(folder, tmp_path / "pipe.dduf", quiet=True)
