"""A trainer's and a model author's round trip, as they run it with the real libraries: ``from_pretrained(BASE)``,
change one thing, ``save_pretrained(FT)`` (in BASE's dtypes, in another dtype, as a ``variant``, sharded),
``dduf pack FT --base BASE``; then ``dduf complete`` and ``dduf export`` back out. Each case checks what is stored
and what is referenced, the archive's size where it is the point, the report's words, and that the archive loads
exactly as diffusers loads FT (tensors with ``torch.equal``, configs, one step of inference).

The rule under test (docs/partial.md, "The same component, by content"): a component is referenced when its
library reads BASE's copy and FT's as the same model, whoever wrote the files; anything that changes the model
(a tensor, a scheduler setting, a special token, a config dtype) is stored."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dduf_plus import load_dduf, save_dduf
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing.complete import complete_archive
from dduf_plus.packing.export import export_single_file
from dduf_plus.packing.pack import pack
from dduf_plus.packing.partial import pack_partial

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"
TINY_DIT = ROOT / "fixtures" / "pipelines" / "tiny-dit"
AS_SAVED = {"unet": torch.float16, "default": torch.float32}  # tiny-sd's dtypes: an fp16 UNet, the rest fp32
DIT_DTYPES = {"transformer": torch.bfloat16, "default": torch.float32}  # tiny-dit's: a bf16 transformer


def trainer(base: Path, out: Path, *, load: dict[str, Any] | None = None, save: dict[str, Any] | None = None,
            change: Callable[[Any], None] | None = None) -> Path:
    """``from_pretrained(base)``, a step of "training" (the UNet's weights moved, or ``change(pipe)``),
    ``save_pretrained(out)``."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base, **({"torch_dtype": AS_SAVED} if load is None else load))
    if change is None:
        with torch.no_grad():
            for p in pipe.unet.parameters():
                p.add_(0.01)
    else:
        change(pipe)
    pipe.save_pretrained(out, **(save or {}))
    return out


def packed(ft: Path, out: Path, base: Path, caplog: pytest.LogCaptureFixture, **kwargs: Any
           ) -> tuple[set[str], set[str], list[str]]:
    """``pack FT --base BASE``: (stored components, referenced components, the report's lines)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(ft, out, base=str(base), quiet=True, **kwargs)
    with DDUFArchive(out) as archive:
        stored = {n.split("/")[0] for n in archive.entries if "/" in n}
        referenced = set(archive.references)
    return stored, referenced, [r.getMessage() for r in caplog.records if r.name.startswith("dduf_plus")]


def _public(config: Any) -> dict[str, Any]:
    """A config less what says where and by which version it was read."""
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: v for k, v in items.items() if not k.startswith("_") and k != "transformers_version"}


def assert_loads_as_diffusers(archive: Path, folder: Path, steps: int = 1, call: dict[str, Any] | None = None,
                              **kwargs: Any) -> None:
    """``load_dduf(archive)`` equals ``DiffusionPipeline.from_pretrained(folder)`` with the same arguments: every
    tensor (dtype and bytes), every config, the tokenizer's ids, ``steps`` steps of inference."""
    from diffusers import DiffusionPipeline

    ours, theirs = load_dduf(archive, **kwargs), DiffusionPipeline.from_pretrained(folder, **kwargs)
    for name, module in theirs.components.items():
        mine = getattr(ours, name)
        if isinstance(module, torch.nn.Module):
            a, b = mine.state_dict(), module.state_dict()
            assert set(a) == set(b), name
            assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b), name
            assert _public(mine.config) == _public(module.config), name
        elif hasattr(module, "config"):
            assert type(mine) is type(module) and _public(mine.config) == _public(module.config), name
    prompt = "a <sks> cat"
    assert ours.tokenizer(prompt, padding="max_length").input_ids == theirs.tokenizer(prompt, padding="max_length").input_ids
    assert ours.tokenizer.pad_token == theirs.tokenizer.pad_token
    ours.to(torch.float32)  # diffusers cannot run its own mixed-precision load (an fp16 UNet, fp32 encoders):
    theirs.to(torch.float32)  # the step runs both, equal tensors cast alike, in fp32
    call = {"num_inference_steps": steps, "output_type": "np", "height": 32, "width": 32, **(call or {})}
    x = ours("a cat", generator=torch.Generator().manual_seed(0), **call).images
    y = theirs("a cat", generator=torch.Generator().manual_seed(0), **call).images
    assert (x == y).all()


def edit_json(path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text())), indent=2))


# --- 1. one component fine-tuned, saved every way a trainer saves ---------------------------------------------
@pytest.mark.parametrize("save", [{}, {"variant": "fp16"}, {"max_shard_size": "100KB"}],
                         ids=["as-loaded", "variant-fp16", "sharded"])
def test_only_the_trained_unet_is_stored(save: dict[str, Any], tmp_path: Path, hf_env: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """Re-saved by diffusers 0.42 / transformers 5 (configs rewritten, the tokenizer's slow files dropped, the UNet
    in one file or in 19 shards and the text encoder in 3, ``.fp16.`` file names over fp32 tensors): every frozen
    component is BASE's and referenced."""
    ft = trainer(TINY_SD, tmp_path / "ft", save=save)
    if "max_shard_size" in save:
        assert len(list((ft / "text_encoder").glob("model-*.safetensors"))) > 1  # the premise: re-sharded
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog, variant=save.get("variant"))
    assert stored == {"unet"}, lines
    assert referenced == {"scheduler", "text_encoder", "tokenizer", "vae"}, lines
    assert any(line.startswith("stored unet: differs from BASE") and "tensor conv_in.bias differs" in line
               for line in lines), lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED, **({"variant": "fp16"} if "variant" in save else {}))


@pytest.mark.slow  # 5-6 s each on 2 cores (fp16/bf16 on CPU); tests/slow_tests.txt
@pytest.mark.parametrize(("dtype", "expected"), [
    (torch.float16, {"text_encoder", "unet"}),  # BASE has an fp16 VAE variant (referenced), no fp16 text encoder
    (torch.bfloat16, {"text_encoder", "unet", "vae"}),  # BASE has no bf16 copy of anything
])
def test_a_finetune_saved_in_another_dtype(dtype: torch.dtype, expected: set[str], tmp_path: Path, hf_env: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Loaded with ``torch_dtype`` (fp32 BASE, fp16 or bf16 fine-tune): what BASE holds in that precision is
    referenced (its variant files), the rest stored, and the report says why for each."""
    ft = trainer(TINY_SD, tmp_path / "ft", load={"torch_dtype": dtype})
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog)
    assert stored == expected and referenced == {"scheduler", "tokenizer", "text_encoder", "unet", "vae"} - expected
    name = str(dtype).removeprefix("torch.")
    assert any(line.startswith("stored text_encoder:") and f"{name} [77, 32] here, float32 [77, 32] in BASE; it has "
               "no other variant: pack in its precision" in line for line in lines), lines
    if dtype == torch.float16:
        assert any(line.startswith("referenced vae") and "BASE's fp16 variant" in line for line in lines), lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=dtype)


def test_a_dit_finetune_stores_only_its_transformer(tmp_path: Path, hf_env: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """tiny-dit (PixArt: a bf16 transformer, T5): transformers 5 re-saves the T5 tokenizer without its
    sentencepiece model (``spiece.model``), which it does not read where ``tokenizer.json`` is: the same tokenizer
    (it was stored: "BASE's spiece.model is not here")."""
    ft = trainer(TINY_DIT, tmp_path / "ft", load={"torch_dtype": DIT_DTYPES},
                 change=lambda pipe: [p.data.add_(0.01) for p in pipe.transformer.parameters()])
    assert not (ft / "tokenizer" / "spiece.model").exists() and (TINY_DIT / "tokenizer" / "spiece.model").exists()
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", TINY_DIT, caplog)
    assert stored == {"transformer"} and referenced == {"scheduler", "text_encoder", "tokenizer", "vae"}, lines
    # two steps: PixArt's one-step path is for DMD schedulers; its resolution bins start at 256 px
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, steps=2, call={"use_resolution_binning": False},
                              torch_dtype=DIT_DTYPES)


# --- a config change is stored when it changes the model, referenced when it does not ------------------------
def _spacing(ft: Path) -> None:
    edit_json(ft / "scheduler" / "scheduler_config.json", lambda c: {**c, "timestep_spacing": "trailing"})


def _pad_token(ft: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ft / "tokenizer")
    tokenizer.pad_token = "!"
    tokenizer.save_pretrained(ft / "tokenizer")


def _added_token(ft: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ft / "tokenizer")
    tokenizer.add_tokens(["<sks>"])  # a textual-inversion trainer's new word
    tokenizer.save_pretrained(ft / "tokenizer")


def _bookkeeping_only(ft: Path) -> None:
    """Another writer: reversed key order, another ``_diffusers_version`` / ``transformers_version``."""
    for name in ("scheduler/scheduler_config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/tokenizer_config.json"):
        edit_json(ft / name, lambda c: {**dict(reversed(list(c.items()))), "_diffusers_version": "0.20.0",
                                        "transformers_version": "4.30.0"})


@pytest.mark.parametrize(("edit", "stored_too", "why"), [
    (_spacing, "scheduler", "scheduler_config.json: key 'timestep_spacing': \"trailing\" here, \"leading\" in BASE"),
    (_pad_token, "tokenizer", "tokenizer_config.json: key 'pad_token': \"!\" here, \"<|endoftext|>\" in BASE"),
    (_added_token, "tokenizer", "tokenizer.json: key 'added_tokens'"),  # was "BASE's merges.txt is not here"
    (_bookkeeping_only, None, None),
], ids=["timestep-spacing", "pad-token", "added-token", "key-order-and-versions"])
def test_a_config_change_is_stored_only_when_it_changes_the_model(
        edit: Callable[[Path], None], stored_too: str | None, why: str | None, tmp_path: Path, hf_env: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    ft = trainer(TINY_SD, tmp_path / "ft")
    edit(ft)
    stored, _referenced, lines = packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog)
    assert stored == {"unet"} | ({stored_too} if stored_too else set()), lines
    if why is not None:
        assert any(line.startswith(f"stored {stored_too}: differs from BASE") and why in line for line in lines), lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED)


# --- BASEs written by other library versions ----------------------------------------------------------------
def _rewrite_safetensors(path: Path, metadata: dict[str, str]) -> None:
    """``path`` as another writer lays it out: tensors in reverse name order, other ``__metadata__``, the header
    padded with spaces to 16 bytes (safetensors pads to 8)."""
    import struct

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header: dict[str, Any] = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name in sorted(tensors, reverse=True):
        t = tensors[name].contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 16)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_a_base_written_by_another_writer_is_the_same(tmp_path: Path, hf_env: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """BASE's text encoder and VAE written by another safetensors writer (tensor order, metadata, header padding),
    its configs' keys in another order: the same components, referenced."""
    base = tmp_path / "base"
    shutil.copytree(TINY_SD, base)
    _rewrite_safetensors(base / "text_encoder" / "model.safetensors", {"format": "pt", "writer": "another"})
    _rewrite_safetensors(base / "vae" / "diffusion_pytorch_model.safetensors", {})
    for name in ("vae/config.json", "text_encoder/config.json"):
        edit_json(base / name, lambda c: dict(reversed(list(c.items()))))
    ft = trainer(base, tmp_path / "ft")
    assert (ft / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() != \
        (base / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()  # the premise
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"unet"} and referenced == {"scheduler", "text_encoder", "tokenizer", "vae"}, lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED)


def _transformers_4_base(tmp_path: Path, torch_dtype: str = "float32") -> Path:
    """tiny-sd as the Hub holds SD 1.5, SDXL, FLUX.1: its text encoder's config written by transformers 4
    (``torch_dtype``, not ``dtype``)."""
    base = tmp_path / "base-tf4"
    shutil.copytree(TINY_SD, base)

    def as_transformers_4(config: dict[str, Any]) -> dict[str, Any]:
        config.pop("dtype")
        return dict(sorted({**config, "torch_dtype": torch_dtype, "transformers_version": "4.22.0.dev0",
                            "_name_or_path": "openai/clip-vit-large-patch14"}.items()))

    edit_json(base / "text_encoder" / "config.json", as_transformers_4)
    return base


def test_a_text_encoder_saved_by_transformers_4_is_referenced(tmp_path: Path, hf_env: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """transformers 5 reads transformers 4's ``torch_dtype`` as ``dtype`` and writes ``dtype``: the frozen text
    encoder of every fine-tune of a Hub BASE was stored ("key 'dtype': "float32" here, null in BASE")."""
    base = _transformers_4_base(tmp_path)
    ft = trainer(base, tmp_path / "ft")
    assert "torch_dtype" not in json.loads((ft / "text_encoder" / "config.json").read_text())  # the premise
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"unet"} and "text_encoder" in referenced, lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED)
    # the trainer's pipeline in memory, compared as it streams (save_dduf(pipe, base=...)): the same decision
    from diffusers import DiffusionPipeline

    save_dduf(DiffusionPipeline.from_pretrained(ft, torch_dtype=AS_SAVED), tmp_path / "mem.dduf", base=str(base))
    with DDUFArchive(tmp_path / "mem.dduf") as archive:
        assert "text_encoder" in archive.references and "unet" not in archive.references


def test_a_config_dtype_that_differs_is_stored(tmp_path: Path, hf_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same tensors, but BASE's config says float16: ``torch_dtype="auto"`` loads the two differently."""
    base = _transformers_4_base(tmp_path, torch_dtype="float16")
    ft = trainer(base, tmp_path / "ft")
    edit_json(ft / "text_encoder" / "config.json", lambda c: {**c, "dtype": "float32"})
    stored, _referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"text_encoder", "unet"}, lines
    assert any("config.json: key 'dtype': \"float32\" here, \"float16\" in BASE" in line for line in lines), lines


def _t5_from_transformers_4(tmp_path: Path, **changes: Any) -> Path:
    """tiny-dit with its T5 encoder's config.json as transformers 4 wrote FLUX.1's, SD3's and PixArt's
    (``torch_dtype``, ``is_encoder_decoder``/``use_cache`` true, ``tie_word_embeddings`` false, no
    ``scale_decoder_outputs``), plus ``changes``."""
    base = tmp_path / "dit-tf4"
    shutil.copytree(TINY_DIT, base)

    def as_transformers_4(config: dict[str, Any]) -> dict[str, Any]:
        for key in ("dtype", "scale_decoder_outputs", "is_decoder"):
            config.pop(key, None)
        return dict(sorted({**config, "_name_or_path": "google/t5-v1_1-xxl", "is_encoder_decoder": True,
                            "output_past": True, "tie_word_embeddings": False, "torch_dtype": "float32",
                            "transformers_version": "4.43.3", "use_cache": True, **changes}.items()))

    edit_json(base / "text_encoder" / "config.json", as_transformers_4)
    return base


def test_a_t5_saved_by_transformers_4_is_referenced(tmp_path: Path, hf_env: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """transformers 5's T5EncoderModel rewrites its config on save (``is_encoder_decoder``/``use_cache`` false, as
    its ``__init__`` sets them; ``tie_word_embeddings`` read as ``scale_decoder_outputs``): the same T5, read by
    transformers. It was stored ("key 'is_encoder_decoder': false here, true in BASE"): FLUX.1's T5 is 9.5 GB."""
    base = _t5_from_transformers_4(tmp_path)
    ft = trainer(base, tmp_path / "ft", load={"torch_dtype": DIT_DTYPES},
                 change=lambda pipe: [p.data.add_(0.01) for p in pipe.transformer.parameters()])
    assert json.loads((ft / "text_encoder" / "config.json").read_text())["is_encoder_decoder"] is False  # premise
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"transformer"} and "text_encoder" in referenced, lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, steps=2, call={"use_resolution_binning": False},
                              torch_dtype=DIT_DTYPES)


def test_a_t5_setting_that_differs_is_still_stored(tmp_path: Path, hf_env: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    base = _t5_from_transformers_4(tmp_path, layer_norm_epsilon=1e-5)
    ft = trainer(base, tmp_path / "ft", load={"torch_dtype": DIT_DTYPES},
                 change=lambda pipe: [p.data.add_(0.01) for p in pipe.transformer.parameters()])
    edit_json(ft / "text_encoder" / "config.json", lambda c: {**c, "layer_norm_epsilon": 1e-6})
    stored, _referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"text_encoder", "transformer"}, lines


@pytest.mark.parametrize("written", ["trailing", "leading"])
def test_use_default_values_is_read_as_diffusers_reads_it(written: str, tmp_path: Path, hf_env: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A BASE config listing a key in ``_use_default_values`` (older diffusers wrote the list) means the class's
    default for it, whatever value is written. FT says "trailing" outright: the scheduler differs whatever BASE
    writes (it was referenced when BASE wrote "trailing": loaded as "leading", silently). FT says "leading", the
    default: the same scheduler (it was stored when BASE wrote "trailing")."""
    base = tmp_path / "base"
    shutil.copytree(TINY_SD, base)
    edit_json(base / "scheduler" / "scheduler_config.json",
              lambda c: {**c, "timestep_spacing": "trailing", "_use_default_values": ["timestep_spacing"]})
    ft = trainer(base, tmp_path / "ft")
    assert json.loads((ft / "scheduler" / "scheduler_config.json").read_text())["timestep_spacing"] == "leading"
    edit_json(ft / "scheduler" / "scheduler_config.json", lambda c: {**c, "timestep_spacing": written})
    stored, _referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert ("scheduler" in stored) == (written == "trailing"), lines
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED)


# --- 2. only the scheduler changed ------------------------------------------------------------------------------
def test_a_scheduler_swap_ships_a_few_kilobytes(tmp_path: Path, hf_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    from diffusers import EulerDiscreteScheduler

    def swap(pipe: Any) -> None:
        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)

    ft = trainer(TINY_SD, tmp_path / "ft", change=swap)
    stored, referenced, lines = packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog)
    assert stored == {"scheduler"} and referenced == {"text_encoder", "tokenizer", "unet", "vae"}, lines
    assert "stored scheduler: BASE's is diffusers.PNDMScheduler, this one diffusers.EulerDiscreteScheduler" in lines
    with DDUFArchive(tmp_path / "ft.dduf") as archive:
        assert set(archive.entries) == {"model_index.json", "scheduler/scheduler_config.json", "dduf_plus.index.json"}
    # 26 kB measured: the reference records (files, tensor digests, configs) are most of it, not the scheduler
    assert (tmp_path / "ft.dduf").stat().st_size < 32 * 1024
    assert_loads_as_diffusers(tmp_path / "ft.dduf", ft, torch_dtype=AS_SAVED)


# --- 4, 5. back out: complete, export ------------------------------------------------------------------------------
def test_complete_equals_a_pack_of_the_stored_part_and_bases_files(tmp_path: Path, hf_env: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """``dduf complete`` of a partial decided by content writes BASE's files for the references (what the archive
    recorded and verified), not the trainer's re-saved ones: byte for byte the pack of FT's UNet beside BASE's
    other folders, and it loads as FT loads."""
    ft = trainer(TINY_SD, tmp_path / "ft")
    packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog)
    complete_archive(tmp_path / "ft.dduf", tmp_path / "full.dduf", quiet=True)
    mixed = tmp_path / "mixed"
    shutil.copytree(ft, mixed)
    for name in ("scheduler", "text_encoder", "tokenizer", "vae"):
        shutil.rmtree(mixed / name)
        shutil.copytree(TINY_SD / name, mixed / name)
    direct = pack(mixed, tmp_path / "direct.dduf", quiet=True)[0].path
    assert (tmp_path / "full.dduf").read_bytes() == direct.read_bytes()
    assert (tmp_path / "full.dduf").read_bytes() != pack(ft, tmp_path / "ft-folder.dduf", quiet=True)[0].path.read_bytes()
    assert_loads_as_diffusers(tmp_path / "full.dduf", ft, torch_dtype=AS_SAVED)


def test_export_of_the_partial_loads_in_from_single_file_as_ft(tmp_path: Path, hf_env: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    ft = trainer(TINY_SD, tmp_path / "ft")
    packed(ft, tmp_path / "ft.dduf", TINY_SD, caplog)
    result = export_single_file(tmp_path / "ft.dduf", tmp_path / "ft.safetensors")
    assert result.components["unet"] == "stored"
    # where each reference resolved, said once ("recorded folder: recorded folder ..." before)
    assert result.components["vae"] == f"recorded folder {TINY_SD} ({TINY_SD / 'vae'})", result.components
    theirs = StableDiffusionPipeline.from_single_file(tmp_path / "ft.safetensors", config=str(TINY_SD),
                                                      torch_dtype=torch.float32)
    original = DiffusionPipeline.from_pretrained(ft, torch_dtype=torch.float32)
    for name in ("unet", "vae", "text_encoder"):
        a, b = getattr(theirs, name).state_dict(), getattr(original, name).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b), name


# --- 3. a LoRA on the real (mixed-precision) BASE, through the command line ----------------------------------------
def _lora_state(pipe: Any) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v for c in ("unet", "text_encoder") for k, v in getattr(pipe, c).state_dict().items()}


def _assert_same_modules(ours: Any, theirs: Any) -> None:
    a, b = _lora_state(ours), _lora_state(theirs)
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b), [k for k in b if not torch.equal(a[k], b[k])][:3]


@pytest.mark.slow  # 10-11 s on 2 cores (two CLI runs, four pipelines); tests/slow_tests.txt
def test_a_lora_trained_on_base_round_trips(tmp_path: Path, hf_env: Path) -> None:
    """peft adapters (B random, not a no-op) on the UNet's attention and the text encoder, ``save_lora_weights``;
    ``dduf pack NAME=FILE@0.7 --base BASE``; loaded as ``from_pretrained(BASE, torch_dtype=<as saved>)`` +
    ``load_lora_weights`` + ``set_adapters`` (the UNet's adapter in fp16, as its layer), fused alike; exported
    (``--adapter``, kohya names) and read back by diffusers: the same model."""
    import subprocess
    import sys

    from diffusers import DiffusionPipeline
    from lora_files import TE_TARGETS, UNET_TARGETS, diffusers_lora

    lora = diffusers_lora(TINY_SD, tmp_path / "lora", {"unet": UNET_TARGETS, "text_encoder": TE_TARGETS})
    cli = [sys.executable, "-m", "dduf_plus.cli"]
    archive = tmp_path / "style.dduf"
    done = subprocess.run([*cli, "pack", f"style={lora}@0.7", "--base", str(TINY_SD), "-o", str(archive)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with DDUFArchive(archive) as a:
        assert {n.split("/")[0] for n in a.entries if "/" in n} == {"_lora"}
    assert archive.stat().st_size < lora.stat().st_size + 64 * 1024  # docs/lora.md: within 64 KiB of the file

    def theirs(file: Path = lora, weight: float = 0.7) -> Any:
        pipe = DiffusionPipeline.from_pretrained(TINY_SD, torch_dtype=AS_SAVED)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name="style")
        pipe.set_adapters(["style"], [weight])
        return pipe

    ours, reference = load_dduf(archive), theirs()
    assert ours.unet.dtype == torch.float16 and any("lora_A" in k for k in _lora_state(ours))
    _assert_same_modules(ours, reference)
    step = {"num_inference_steps": 1, "output_type": "np", "height": 32, "width": 32}
    images = [p.to(torch.float32)("a cat", generator=torch.Generator().manual_seed(0), **step).images
              for p in (ours, reference)]
    assert (images[0] == images[1]).all()
    fused = theirs()
    fused.fuse_lora()
    fused.unload_lora_weights()
    _assert_same_modules(load_dduf(archive, fuse_lora=True), fused)
    exported = tmp_path / "style_kohya.safetensors"
    done = subprocess.run([*cli, "export", str(archive), "-o", str(exported)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    again = theirs(exported)
    again.fuse_lora()
    again.unload_lora_weights()
    _assert_same_modules(again, fused)


# --- the heart: --exclude NAME --ref SOURCE, resolved and verified at load, or a clear refusal ----------------------
def test_exclude_and_ref_resolve_verify_and_say_what_is_wrong(tmp_path: Path, hf_env: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from dduf_plus.errors import DDUFPackError, DDUFReferenceError

    ft = trainer(TINY_SD, tmp_path / "ft")
    base = tmp_path / "base"
    shutil.copytree(TINY_SD, base)
    archive = tmp_path / "ft.dduf"
    pack_partial(ft, archive, exclude=["text_encoder"], refs={"*": str(base)}, quiet=True)  # a re-saved copy: BASE's
    with DDUFArchive(archive) as a:
        assert set(a.references) == {"text_encoder"}
    assert_loads_as_diffusers(archive, ft, torch_dtype=AS_SAVED)
    with pytest.raises(DDUFPackError, match=r"unet differs from its reference .*tensor conv_in.bias differs"):
        pack_partial(ft, tmp_path / "x.dduf", exclude=["unet"], refs={"*": str(base)}, quiet=True)
    weights = base / "text_encoder" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # BASE changed after the pack
    weights.write_bytes(bytes(data))
    with pytest.raises(DDUFReferenceError, match=r"(?s)component 'text_encoder' \(transformers CLIPTextModel\).*"
                                                 r"text_encoder/model.safetensors .*sha256 \w+ differs from the recorded"):
        load_dduf(archive)
    shutil.rmtree(base)
    with pytest.raises(DDUFReferenceError, match=r"(?s)component 'text_encoder'.*does not exist here.*To fix: .*refs="):
        load_dduf(archive)


@pytest.mark.parametrize("hostile", [
    {"model_type": "t5", "feed_forward_proj": "no-such-act-fn"},  # refused by T5Config: compared as written
    {"model_type": "no_such_model"},  # transformers does not know it
    {"model_type": ["t5"]},  # not a name
    {"model_type": "t5", "num_layers": 10 ** 30, "d_model": -1},  # numbers no model has: a config, nothing built
    # Gemma 3's config class builds one layer_types item per layer (10**7: 44 s, 1.5 GB): never given to it
    {"model_type": "gemma3_text", "num_hidden_layers": 10 ** 7},
])
def test_a_hostile_base_config_is_compared_without_a_crash(hostile: dict[str, Any], tmp_path: Path, hf_env: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The transformers reading of a BASE's config.json (untrusted) builds a config object, never a model, and a
    config transformers refuses is compared as written: the component is stored."""
    base = tmp_path / "base"
    shutil.copytree(TINY_DIT, base)
    ft = trainer(TINY_DIT, tmp_path / "ft", load={"torch_dtype": DIT_DTYPES},
                 change=lambda pipe: [p.data.add_(0.01) for p in pipe.transformer.parameters()])
    edit_json(base / "text_encoder" / "config.json", lambda c: {**c, **hostile})
    stored, _referenced, lines = packed(ft, tmp_path / "ft.dduf", base, caplog)
    assert stored == {"text_encoder", "transformer"}, lines


@pytest.mark.parametrize("config", [
    {"model_type": "gemma3_text", "num_hidden_layers": 10 ** 7},  # 44 s and 1.5 GB in Gemma3TextConfig
    {"model_type": "qwen3", "num_hidden_layers": 5000},
    {"model_type": "t5", "vocab_size": 1 << 40},
    {"model_type": "t5", "text_config": {"num_layers": 1 << 31}},
])
def test_a_config_with_sizes_no_model_has_is_not_given_to_its_config_class(config: dict[str, Any]) -> None:
    """Config classes build lists from layer counts: an untrusted BASE config with such a number is compared as
    written (None here), before transformers sees it; a real one is read."""
    from dduf_plus.packing.identity import transformers_reading

    assert transformers_reading(config, None) is None
    real = transformers_reading({"model_type": "gemma3_text", "num_hidden_layers": 26, "vocab_size": 262_144}, None)
    assert real is not None and len(real["layer_types"]) == 26
