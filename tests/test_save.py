"""save_dduf(): what save_pretrained writes, byte for byte, streamed without copying the weights."""

from __future__ import annotations

import json
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dduf_plus.errors import DDUFPackError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.loading.transfer import _stream, _SyncCopier
from dduf_plus.packing.save import save_dduf, tensor_bytes, transformers_checkpoint, weight_source

INDEX = "dduf_plus.index.json"


@pytest.fixture(scope="module")
def pipes(pipelines_dir):
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as dlog

    dlog.disable_progress_bar()
    return {name: DiffusionPipeline.from_pretrained(pipelines_dir / name) for name in ("tiny-sd", "tiny-dit")}


def _folder_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _archive_files(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if n != INDEX}


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-dit"])
def test_archive_holds_exactly_what_save_pretrained_writes(pipes, name, tmp_path):
    pipe = pipes[name]
    pipe.save_pretrained(tmp_path / "folder")
    result = save_dduf(pipe, tmp_path / "x.dduf", quiet=True)
    expected, got = _folder_files(tmp_path / "folder"), _archive_files(result.path)
    assert sorted(got) == sorted(expected)
    for entry, data in expected.items():  # model_index.json, configs, tokenizer files AND weights
        assert got[entry] == data, entry
    assert result.skipped == []


def test_dtype_and_variant_match_diffusers_own_fp16_save(pipes, pipelines_dir, tmp_path):
    """save_dduf(fp32 pipe, dtype=fp16) == from_pretrained(dtype=fp16).save_pretrained(variant="fp16"),
    including T5's wo kept in fp32 (_keep_in_fp32_modules) and config.json's dtype."""
    from diffusers import DiffusionPipeline

    half = DiffusionPipeline.from_pretrained(pipelines_dir / "tiny-dit", dtype=torch.float16)
    half.save_pretrained(tmp_path / "folder", variant="fp16")
    result = save_dduf(pipes["tiny-dit"], tmp_path / "x.dduf", dtype="float16", variant="fp16", quiet=True)
    expected, got = _folder_files(tmp_path / "folder"), _archive_files(result.path)
    assert sorted(got) == sorted(expected)
    assert all(got[k] == v for k, v in expected.items())
    assert "text_encoder/model.fp16.safetensors" in got
    assert json.loads(got["text_encoder/config.json"])["dtype"] == "float16"
    with DDUFArchive(result.path) as archive:
        te = archive.headers["text_encoder/model.fp16.safetensors"].tensors
        assert {t.dtype for n, t in te.items() if ".wo." in n} == {"float32"}
        assert {t.dtype for n, t in te.items() if ".wo." not in n} == {"float16"}
    # the live pipeline was not touched
    assert pipes["tiny-dit"].text_encoder.dtype == torch.float32
    assert pipes["tiny-dit"].text_encoder.config.dtype in (torch.float32, "float32")


def test_per_component_dtype_dict(pipes, tmp_path):
    result = save_dduf(pipes["tiny-sd"], tmp_path / "x.dduf", dtype={"unet": torch.bfloat16, "default": None},
                       quiet=True)
    summaries = {k: v.get("summary", {}).get("dtype") for k, v in result.index["components"].items()}
    assert summaries["unet"] == "bfloat16" and summaries["vae"] == "float32" and summaries["text_encoder"] == "float32"


def test_round_trip_gives_identical_images(pipes, tmp_path):
    from diffusers import DiffusionPipeline

    pipe = pipes["tiny-sd"]
    result = save_dduf(pipe, tmp_path / "x.dduf", quiet=True)
    with zipfile.ZipFile(result.path) as z:
        z.extractall(tmp_path / "unpacked")
    reloaded = DiffusionPipeline.from_pretrained(tmp_path / "unpacked")

    def run(p):
        return p("a cat", num_inference_steps=2, height=32, width=32, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images

    np.testing.assert_array_equal(run(pipe), run(reloaded))


def test_other_readers_accept_it(pipes, tmp_path):
    from huggingface_hub import read_dduf_file

    result = save_dduf(pipes["tiny-sd"], tmp_path / "x.dduf", quiet=True)
    entries = read_dduf_file(result.path)
    assert "unet/diffusion_pytorch_model.safetensors" in entries and "model_index.json" in entries
    with zipfile.ZipFile(result.path) as z:
        assert z.testzip() is None
    with DDUFArchive(result.path) as archive:  # strict reader: no findings, tensor data page-aligned
        assert [f for f in archive.findings if f.severity == "error"] == []
        assert archive.stored_index is not None


# --- safetensors bytes -------------------------------------------------------------------------------
def _all_dtypes_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "b.f64": torch.randn(5, generator=g, dtype=torch.float64),
        "a.f32": torch.randn(3, 4, generator=g),
        "z.f16": torch.randn(7, generator=g).half(),
        "y.bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "m.bool": torch.rand(9, generator=g) > 0.5,
        "i64": torch.arange(6),
        "i32": torch.arange(6, dtype=torch.int32),
        "i16": torch.arange(6, dtype=torch.int16),
        "i8": torch.arange(6, dtype=torch.int8),
        "u8": torch.arange(6, dtype=torch.uint8),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "ünïcode.weight": torch.ones(2),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            state[name] = torch.randn(4, generator=g).to(getattr(torch, name))
    return state


def _stream_bytes(source) -> bytes:
    return b"".join(bytes(memoryview(c).cast("B")) for c in source.chunks())


def test_weight_source_is_byte_identical_to_safetensors():
    from safetensors.torch import save

    state = _all_dtypes_state()
    source = weight_source("c/model.safetensors", state)
    data = _stream_bytes(source)
    assert data == save({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"})
    assert source.size == len(data)
    assert set(source.header.tensors) == set(state)


def test_weight_source_converts_floating_tensors_only():
    from safetensors.torch import load

    state = _all_dtypes_state()
    floating = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    source = weight_source("c/model.safetensors", state,
                           dtype_for=lambda n, t: torch.float16 if t.dtype in floating else None)
    loaded = load(_stream_bytes(source))
    for k, v in state.items():
        want = v.to(torch.float16) if v.dtype in floating else v
        assert loaded[k].dtype == want.dtype and torch.equal(loaded[k], want), k


def test_tensor_bytes_are_views_of_the_parameter_not_copies():
    param = torch.nn.Parameter(torch.randn(1000, 300))
    (view,) = list(tensor_bytes(param))
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == param.data_ptr()
    big = torch.zeros((70 << 20) // 4)  # larger than one piece: handed out in slices of itself
    pieces = list(tensor_bytes(big))
    assert len(pieces) == 2 and sum(len(p) for p in pieces) == big.nbytes
    assert torch.frombuffer(pieces[0], dtype=torch.uint8).data_ptr() == big.data_ptr()


def test_flat_buffer_weights_are_not_cloned(pipes):
    """A model whose weights are views of one flat buffer (materialize's CUDA layout) must not look
    like "shared tensors" to transformers' tied-weight logic (which would clone them all)."""
    import copy

    te = copy.deepcopy(pipes["tiny-sd"].text_encoder)
    flat = _stream(te.state_dict(), torch.device("cpu"), lambda n, t: None, 1 << 20, 2, _SyncCopier())
    te.load_state_dict(flat, assign=True)
    assert len({t.untyped_storage().data_ptr() for t in te.state_dict().values()}) == 1
    checkpoint = transformers_checkpoint(te)
    assert {t.data_ptr() for t in checkpoint.values()} <= {t.data_ptr() for t in flat.values()}


def test_tied_weights_are_dropped_as_transformers_does(pipes):
    te = pipes["tiny-dit"].text_encoder  # T5: encoder.embed_tokens is tied to shared
    state = te.state_dict()
    assert state["shared.weight"].data_ptr() == state["encoder.embed_tokens.weight"].data_ptr()
    checkpoint = transformers_checkpoint(te)
    assert ("shared.weight" in checkpoint) != ("encoder.embed_tokens.weight" in checkpoint)


# --- memory ------------------------------------------------------------------------------------------
def _sample_peak_rss(process):
    """Start sampling RSS every 2 ms; returns ([peak], stop)."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()

    def done() -> None:
        stop.set()
        thread.join()

    return peak, done


def test_peak_memory_stays_far_below_the_weights(pipes, tmp_path):
    """Streaming a 220 MB VAE (as is, then converted to fp16) adds little to RSS: no full copy."""
    psutil = pytest.importorskip("psutil")
    from diffusers import AutoencoderKL

    pipe = pipes["tiny-sd"]
    vae = AutoencoderKL(block_out_channels=(128, 256, 512), layers_per_block=2, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3)
    weights = sum(t.nbytes for t in vae.state_dict().values())
    assert weights > 100e6
    old = pipe.vae
    pipe.register_modules(vae=vae)
    process = psutil.Process()
    try:
        for dtype in (None, torch.float16):
            baseline = process.memory_info().rss
            peak, done = _sample_peak_rss(process)
            try:
                save_dduf(pipe, tmp_path / "big.dduf", dtype=dtype, quiet=True)
            finally:
                done()
            largest = max(t.nbytes for t in vae.state_dict().values())
            assert peak[0] - baseline < 0.25 * weights + 2 * largest, (dtype, peak[0] - baseline, weights)
    finally:
        pipe.register_modules(vae=old)


# --- refusals ----------------------------------------------------------------------------------------
def test_refusals(pipes, tmp_path):
    pipe = pipes["tiny-sd"]
    with pytest.raises(DDUFPackError, match="variant"):
        save_dduf(pipe, tmp_path / "x.dduf", variant="../fp16")
    with pytest.raises(DDUFPackError, match="dtype"):
        save_dduf(pipe, tmp_path / "x.dduf", dtype="float17")
    old = pipe.unet
    pipe.unet = torch.nn.Linear(2, 2)  # set without register_modules: config still says UNet2DConditionModel
    try:
        with pytest.raises(DDUFPackError, match="neither a diffusers nor a transformers model"):
            save_dduf(pipe, tmp_path / "x.dduf", quiet=True)
    finally:
        pipe.unet = old
    assert not (tmp_path / "x.dduf").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_streams_the_same_bytes(pipes, tmp_path):
    """A pipeline on the GPU, its weights in materialize's one-buffer-per-component layout, saves the
    same archive entries as on the CPU (one tensor at a time crosses to the host)."""
    import copy

    from dduf_plus.loading.transfer import materialize

    pipe = copy.deepcopy(pipes["tiny-sd"])
    save_dduf(pipe, tmp_path / "cpu.dduf", quiet=True)
    pipe.to("cuda")
    te = pipe.text_encoder
    te.load_state_dict(materialize(te.state_dict(), device="cuda"), assign=True)
    save_dduf(pipe, tmp_path / "cuda.dduf", quiet=True)
    assert _archive_files(tmp_path / "cuda.dduf") == _archive_files(tmp_path / "cpu.dduf")
