"""Pack-time dtype conversion: bf16/fp16/fp8 packs, what is left alone, valid safetensors, loading."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import read_dduf_file
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import PIPELINES
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFPackError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import plan_folder
from dduf_plus.packing.convert import (
    Target,
    convert_sources,
    pack_converted,
    parse_dtype_args,
    parse_dtype_spec,
)

UNET_SHARDS = ("diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_tensors(folder: Path, files: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(folder / f))
    return out


def entry_tensors(archive: DDUFArchive, entry: str) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in archive.tensors(entry.split("/")[0]).items()
            if name in archive.headers[entry].tensors}


@pytest.fixture(scope="module")
def bf16_sd(tmp_path_factory) -> Path:
    return pack_converted(PIPELINES / "tiny-sd", tmp_path_factory.mktemp("conv") / "sd-bf16.dduf",
                          dtype="bfloat16", quiet=True).path


@pytest.fixture(scope="module")
def fp8_sd(tmp_path_factory) -> Path:
    return pack_converted(PIPELINES / "tiny-sd", tmp_path_factory.mktemp("conv") / "sd-fp8.dduf",
                          dtype={"unet": "float8_e4m3fn", "default": "bf16"}, quiet=True).path


# --- the dtype argument ------------------------------------------------------------------------------


def test_dtype_spellings():
    assert parse_dtype_spec("bf16") == {"default": Target("bfloat16")}
    assert parse_dtype_spec(torch.float16) == {"default": Target("float16")}
    assert parse_dtype_spec({"unet": "float8_e4m3fn:float16", "*": "bfloat16"}) == {
        "unet": Target("float8_e4m3fn", "float16"), "default": Target("bfloat16")}
    assert parse_dtype_args(["bfloat16", "unet=fp8", "vae=float16"]) == {
        "default": "bfloat16", "unet": "fp8", "vae": "float16"}
    for bad in ("int8", "bfloat16:float16", "float8_e4m3fn:float8_e5m2"):
        with pytest.raises(DDUFPackError):
            parse_dtype_spec(bad)
    with pytest.raises(DDUFPackError, match="--dtype transformer: not a component"):
        convert_sources(plan_folder(PIPELINES / "tiny-sd"), {"transformer": "bfloat16"})


# --- bf16 --------------------------------------------------------------------------------------------


def test_bf16_pack_converts_floats_and_records_hashes(bf16_sd):
    src = PIPELINES / "tiny-sd"
    with DDUFArchive(bf16_sd) as archive:
        assert not [f for f in archive.findings if f.severity == "error" or f.code in ("S008", "S009")]
        index = archive.index
        for component in ("unet", "vae", "text_encoder"):
            record = index["components"][component]
            assert set(record["summary"]["dtypes"]) == {"bfloat16"}, component
            assert record["summary"]["dtype"] == "bfloat16"
            assert record["dtype_conversion"]["storage_dtype"] == "bfloat16"
        for entry in ("unet/" + UNET_SHARDS[0], "unet/" + UNET_SHARDS[1], "vae/diffusion_pytorch_model.safetensors",
                      "text_encoder/model.safetensors"):
            rec = index["files"][entry]
            assert rec["source_sha256"] == sha256(src / entry)  # the original file's hash...
            assert rec["sha256"] == hashlib.sha256(bytes(archive.view(entry))).hexdigest()  # ...and the new one
        # values are exactly what torch's own cast gives, tensor by tensor
        expected = source_tensors(src / "unet", UNET_SHARDS)
        stored = archive.tensors("unet")
        assert set(stored) == set(expected)
        for name, tensor in stored.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name
        # same byte size fp16 -> bf16: the shard index needs no rewrite and stays byte-identical
        shard_index = "unet/diffusion_pytorch_model.safetensors.index.json"
        assert bytes(archive.view(shard_index)) == (src / shard_index).read_bytes()
        # untouched entries stay byte-identical (tokenizer, scheduler)
        assert "source_sha256" not in index["files"]["tokenizer/vocab.json"]
    # a valid DDUF for the reference reader, and each converted entry a valid safetensors file
    entries = read_dduf_file(bf16_sd)
    assert "unet/" + UNET_SHARDS[0] in entries
    with _entry_file(bf16_sd, "vae/diffusion_pytorch_model.safetensors") as path:
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"} and all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


class _entry_file:
    """Copy one entry out to a file (safetensors' reader wants a path)."""

    def __init__(self, archive: Path, entry: str):
        self.archive, self.entry = archive, entry
        self.path = archive.with_name(entry.replace("/", "__"))

    def __enter__(self) -> Path:
        with DDUFArchive(self.archive) as a:
            self.path.write_bytes(bytes(a.view(self.entry)))
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def test_already_in_target_dtype_stays_byte_identical(tmp_path):
    src = PIPELINES / "tiny-dit"
    result = pack_converted(src, tmp_path / "dit.dduf", dtype={"transformer": "bfloat16"}, quiet=True)
    entry = "transformer/diffusion_pytorch_model.safetensors"  # the fixture's transformer is bf16 already
    rec = result.index["files"][entry]
    assert rec["sha256"] == sha256(src / entry) and "source_sha256" not in rec
    assert "dtype_conversion" not in result.index["components"]["transformer"]


def test_fp16_to_fp32_rewrites_shard_index_total_size(tmp_path):
    result = pack_converted(PIPELINES / "tiny-sd", tmp_path / "sd32.dduf", dtype={"unet": "float32"}, quiet=True)
    original = json.loads((PIPELINES / "tiny-sd/unet/diffusion_pytorch_model.safetensors.index.json").read_text())
    with DDUFArchive(result.path) as archive:
        index = archive.read_json("unet/diffusion_pytorch_model.safetensors.index.json")
        assert index["weight_map"] == original["weight_map"]
        assert index["metadata"]["total_size"] == 2 * original["metadata"]["total_size"]
        assert index["metadata"]["total_size"] == archive.index["components"]["unet"]["summary"]["bytes"]
        rec = archive.index["files"]["unet/diffusion_pytorch_model.safetensors.index.json"]
        assert rec["source_sha256"] == sha256(PIPELINES / "tiny-sd/unet/diffusion_pytorch_model.safetensors.index.json")


def test_integers_and_fp32_modules_are_left_alone(tmp_path, monkeypatch):
    import diffusers

    folder = tmp_path / "sd"
    shutil.copytree(PIPELINES / "tiny-sd", folder)
    te = folder / "text_encoder" / "model.safetensors"
    tensors = load_file(te)
    tensors["text_model.embeddings.position_ids"] = torch.arange(77, dtype=torch.int64)[None]  # as old CLIPs have
    tensors["text_model.mask"] = torch.ones(3, dtype=torch.bool)
    save_file(tensors, te, metadata={"format": "pt"})
    # a diffusers class that keeps a module in fp32 (as e.g. Kandinsky's time embeddings)
    monkeypatch.setattr(diffusers.UNet2DConditionModel, "_keep_in_fp32_modules", ["time_embedding"])
    result = pack_converted(folder, tmp_path / "sd.dduf", dtype="bfloat16", quiet=True)
    with DDUFArchive(result.path) as archive:
        te_stored = archive.tensors("text_encoder")
        assert te_stored["text_model.embeddings.position_ids"].dtype == torch.int64
        assert torch.equal(te_stored["text_model.embeddings.position_ids"], tensors["text_model.embeddings.position_ids"])
        assert te_stored["text_model.mask"].dtype == torch.bool
        unet = archive.tensors("unet")
        kept = {n: t.dtype for n, t in unet.items() if n.split(".")[0] == "time_embedding"}
        assert kept and set(kept.values()) == {torch.float16}  # left as stored (fp16), not converted
        assert {t.dtype for n, t in unet.items() if n.split(".")[0] != "time_embedding"} == {torch.bfloat16}
        assert archive.index["components"]["unet"]["dtype_conversion"]["kept_fp32"] == len(kept)


def test_transformers_keep_in_fp32_rules(tmp_path):
    """T5 keeps ``wo`` in fp32 for fp16 (transformers' _keep_in_fp32_modules), not for bf16."""
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    fp16 = pack_converted(PIPELINES / "tiny-dit", tmp_path / "a.dduf", dtype={"text_encoder": "fp16"}, quiet=True)
    bf16 = pack_converted(PIPELINES / "tiny-dit", tmp_path / "b.dduf", dtype={"text_encoder": "bf16"}, quiet=True)
    with DDUFArchive(fp16.path) as a, DDUFArchive(bf16.path) as b:
        assert a.tensors("text_encoder")[wo].dtype == torch.float32
        assert a.tensors("text_encoder")["shared.weight"].dtype == torch.float16
        assert b.tensors("text_encoder")[wo].dtype == torch.bfloat16


# --- fp8 ---------------------------------------------------------------------------------------------


def test_fp8_pack_stores_cast_layers_in_fp8(fp8_sd):
    with DDUFArchive(fp8_sd) as archive:
        record = archive.index["components"]["unet"]
        assert record["storage_dtype"] == "float8_e4m3fn"
        assert record["compute_dtype"] == "float16"  # the unet's source dtype
        assert "norm" in record["layerwise_casting"]["skip_modules_pattern"]
        unet = archive.tensors("unet")
        assert unet["conv_in.weight"].dtype == torch.float8_e4m3fn
        assert unet["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"].dtype == torch.float8_e4m3fn
        # layers layerwise casting skips (norms, proj_in/out by pattern) are stored in the compute dtype
        assert unet["conv_norm_out.weight"].dtype == torch.float16
        assert unet["down_blocks.1.attentions.0.norm.weight"].dtype == torch.float16
        assert archive.index["components"]["vae"]["summary"]["dtype"] == "bfloat16"
        expected = source_tensors(PIPELINES / "tiny-sd/unet", UNET_SHARDS)
        for name, t in unet.items():
            want = expected[name].to(t.dtype)
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
                else torch.equal(t, want), name
    assert len(read_dduf_file(fp8_sd)) > 0


def test_fp8_saturates_instead_of_nan(tmp_path):
    folder = tmp_path / "sd"
    shutil.copytree(PIPELINES / "tiny-sd", folder)
    shard = folder / "unet" / UNET_SHARDS[0]
    tensors = load_file(shard)
    name = "conv_in.weight" if "conv_in.weight" in tensors else next(k for k in tensors if k.endswith("conv1.weight"))
    tensors[name][0, 0, 0, 0] = 1000.0  # past float8_e4m3fn's 448
    tensors[name][0, 0, 0, 1] = -60000.0
    save_file(tensors, shard, metadata={"format": "pt"})
    result = pack_converted(folder, tmp_path / "fp8.dduf", dtype={"unet": "fp8:float16"}, quiet=True)
    with DDUFArchive(result.path) as archive:
        stored = archive.tensors("unet")[name]
        assert stored.dtype == torch.float8_e4m3fn
        assert stored[0, 0, 0, 0].float().item() == 448.0 and stored[0, 0, 0, 1].float().item() == -448.0
        assert not torch.isnan(stored.float()).any()


def test_fp8_only_for_diffusers_models(tmp_path):
    with pytest.raises(DDUFPackError, match="diffusers models only"):
        convert_sources(plan_folder(PIPELINES / "tiny-dit"), {"text_encoder": "float8_e4m3fn"})
    # as a default, non-diffusers components are stored in the compute dtype (or left alone without one)
    result = pack_converted(PIPELINES / "tiny-dit", tmp_path / "dit.dduf", dtype="float8_e4m3fn:bfloat16", quiet=True)
    comps = result.index["components"]
    assert comps["transformer"]["storage_dtype"] == "float8_e4m3fn"
    assert "storage_dtype" not in comps["text_encoder"]
    assert comps["text_encoder"]["summary"]["dtype"] == "bfloat16"


# --- CLI and loading ---------------------------------------------------------------------------------


def test_cli_pack_dtype_flags(tmp_path):
    out = tmp_path / "cli.dduf"
    code = cli_main(["pack", str(PIPELINES / "tiny-sd"), "-o", str(out), "--dtype", "bfloat16",
                     "--dtype", "unet=float8_e4m3fn:bfloat16", "-q"])
    assert code == 0
    with DDUFArchive(out) as archive:
        comps = archive.index["components"]
        assert comps["unet"]["storage_dtype"] == "float8_e4m3fn" and comps["unet"]["compute_dtype"] == "bfloat16"
        assert comps["vae"]["summary"]["dtype"] == "bfloat16"


def _run(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    out = pipe("a photo of a cat", num_inference_steps=2, height=32, width=32, output_type="pt", generator=generator)
    return out.images


def test_bf16_pack_loads_in_bf16_and_runs(bf16_sd):
    from dduf_plus.loading.pipeline import load_dduf

    pipe = load_dduf(bf16_sd)  # torch_dtype="auto": the saved precision
    pipe.set_progress_bar_config(disable=True)
    for name in ("unet", "vae", "text_encoder"):
        assert getattr(pipe, name).dtype == torch.bfloat16, name
    images = _run(pipe)
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


def test_fp8_pack_runs_with_layerwise_casting_on_cpu(fp8_sd):
    from dduf_plus.loading.pipeline import load_dduf

    pipe = load_dduf(fp8_sd)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.dtype == torch.float16  # the compute dtype
    stored = {p.dtype for p in pipe.unet.parameters()}
    assert torch.float8_e4m3fn in stored  # weights stay fp8 in memory between forwards
    images = _run(pipe)
    assert torch.isfinite(images).all()
    assert torch.float8_e4m3fn in {p.dtype for p in pipe.unet.parameters()}  # and after them
