"""Every load_dduf failure is a DDUFError that names the component and says what to do."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.errors import (  # noqa: E402
    DDUFError,
    DDUFIntegrityError,
    DDUFLoadError,
    DDUFNotFoundError,
    DDUFReferenceError,
    DDUFValidationError,
)
from dduf_plus.format.pack import pack_folder  # noqa: E402

PIPELINES = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines"


def packed_variant(tmp_path: Path, mutate=None, name: str = "tiny-sd") -> Path:
    folder = tmp_path / "src"
    shutil.copytree(PIPELINES / name, folder)
    if mutate is not None:
        mutate(folder)
    return pack_folder(folder, tmp_path / "out.dduf", quiet=True, check=False).path  # what validate would refuse too


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def test_unknown_class_names_the_component(tmp_path):
    path = packed_variant(tmp_path, lambda f: edit_json(f / "model_index.json", lambda d: d.update(unet=["diffusers", "NoSuchUNet"])))
    with pytest.raises(DDUFLoadError, match=r"'unet'.*NoSuchUNet.*unet=\.\.\."):
        load_dduf(path)


def test_unknown_library_names_the_component(tmp_path):
    path = packed_variant(tmp_path, lambda f: edit_json(f / "model_index.json", lambda d: d.update(vae=["nosuchlib", "VAE"])))
    with pytest.raises(DDUFLoadError, match=r"'vae'.*library 'nosuchlib'.*vae=\.\.\."):
        load_dduf(path)
    # a module that happens to be imported is searched for a class, never called
    path = packed_variant(tmp_path / "os", lambda f: edit_json(f / "model_index.json", lambda d: d.update(vae=["os", "system"])))
    with pytest.raises(DDUFLoadError, match=r"'vae'.*no class 'system'"):
        load_dduf(path)


def test_missing_shard_names_component_and_file(tmp_path):
    path = packed_variant(tmp_path, lambda f: (f / "unet" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink())
    # refused before anything is built, as validate refuses it: D011, naming the index, the shard, the folder
    with pytest.raises(DDUFError, match=r"D011 \[unet/.*diffusion_pytorch_model-00002-of-00002\.safetensors.*missing") as info:
        load_dduf(path)
    assert info.value.codes == ["D011"]


def test_required_component_absent_says_pass_it(tmp_path):
    def drop_unet(folder: Path) -> None:
        edit_json(folder / "model_index.json", lambda d: d.pop("unet"))
        shutil.rmtree(folder / "unet")

    path = packed_variant(tmp_path, drop_unet)
    with pytest.raises(DDUFLoadError, match=r"needs unet.*pass unet=\.\.\."):
        load_dduf(path)


def test_weights_that_do_not_fit_the_config(tmp_path):
    path = packed_variant(tmp_path, lambda f: edit_json(f / "unet" / "config.json", lambda d: d.update(cross_attention_dim=48)))
    with pytest.raises(DDUFLoadError, match=r"unet.*UNet2DConditionModel"):
        load_dduf(path)
    path = packed_variant(tmp_path / "te", lambda f: edit_json(f / "text_encoder" / "config.json", lambda d: d.update(hidden_size=40)))
    with pytest.raises(DDUFLoadError, match=r"text_encoder.*CLIPTextModel"):
        load_dduf(path)


def test_missing_weights_are_an_error_not_random(tmp_path):
    from safetensors.torch import load_file, save_file

    def drop_tensor(folder: Path) -> None:
        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        state = load_file(weights)
        state.pop("decoder.conv_out.weight")
        save_file(state, weights)

    with pytest.raises(DDUFLoadError, match=r"vae.*missing.*decoder\.conv_out\.weight"):
        load_dduf(packed_variant(tmp_path, drop_tensor))


def test_damaged_archives_raise_dduf_errors(tmp_path):
    good = pack_folder(PIPELINES / "tiny-sd", tmp_path / "good.dduf", quiet=True).path
    data = good.read_bytes()
    truncated = tmp_path / "truncated.dduf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(DDUFValidationError):
        load_dduf(truncated)
    garbage = tmp_path / "garbage.dduf"
    garbage.write_bytes(b"not a zip at all" * 100)
    with pytest.raises(DDUFError):
        load_dduf(garbage)
    # same length, one byte changed inside unet/config.json: caught by the entry's CRC-32
    from dduf_plus.format.archive import DDUFArchive

    with DDUFArchive(good) as archive:
        entry = archive.entry("unet/config.json")
    flipped = bytearray(data)
    at = entry.offset + bytes(data[entry.offset: entry.offset + entry.length]).index(b"UNet2DConditionModel")
    flipped[at] ^= 0x01
    damaged = tmp_path / "damaged.dduf"
    damaged.write_bytes(bytes(flipped))
    with pytest.raises(DDUFError) as info:
        load_dduf(damaged)
    assert isinstance(info.value, (DDUFIntegrityError, DDUFValidationError))
    assert "unet/config.json" in str(info.value)
    with pytest.raises(DDUFError):
        load_dduf(tmp_path / "nope.dduf")


def test_missing_optional_library_says_pip_install(tmp_path, monkeypatch):
    # A placeholder class, as diffusers/transformers expose when a backend is not installed.
    class DummyObject(type):
        pass

    fake = types.ModuleType("dduf_fake_lib")
    fake.FancyScheduler = DummyObject("FancyScheduler", (), {"_backends": ["torchsde"]})
    monkeypatch.setitem(sys.modules, "dduf_fake_lib", fake)
    path = packed_variant(tmp_path, lambda f: edit_json(f / "model_index.json",
                                                         lambda d: d.update(scheduler=["dduf_fake_lib", "FancyScheduler"])))
    with pytest.raises(DDUFLoadError, match=r"'scheduler'.*pip install torchsde"):
        load_dduf(path)

    import dduf_plus.loading.components as components

    real = components.importlib.import_module

    def no_transformers(name, *args):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real(name, *args)

    monkeypatch.setattr(components.importlib, "import_module", no_transformers)
    with pytest.raises(DDUFLoadError, match=r"'(text_encoder|tokenizer)' needs transformers: pip install transformers"):
        load_dduf(pack_folder(PIPELINES / "tiny-sd", tmp_path / "plain.dduf", quiet=True).path)


def test_bad_arguments(tmp_path):
    path = pack_folder(PIPELINES / "tiny-sd", tmp_path / "sd.dduf", quiet=True).path
    with pytest.raises(DDUFLoadError, match="not a floating torch dtype"):
        load_dduf(path, torch_dtype="int8")
    with pytest.raises(DDUFLoadError, match="variant 'ema'"):
        load_dduf(path, variant="ema")
    with pytest.raises(DDUFLoadError, match="device_map='balanced' is not supported"):
        load_dduf(path, device_map="balanced")
    with pytest.raises(DDUFLoadError, match=r"^device='balanced' is not supported.*\(device=\{"):
        load_dduf(path, device="balanced")  # named as given (was device_map=)
    if not torch.cuda.is_available():
        with pytest.raises(DDUFLoadError, match="CUDA is not available"):
            load_dduf(path, device="cuda")
    with pytest.raises(DDUFNotFoundError, match="not in the remote cache"):  # offline (conftest): no request
        load_dduf("https://example.invalid/model.dduf")


def test_unresolvable_reference_names_the_component(tmp_path):
    from dduf_plus.packing.partial import pack_partial

    base = tmp_path / "base"
    shutil.copytree(PIPELINES / "tiny-sd", base)
    out = pack_partial(PIPELINES / "tiny-sd-finetune", tmp_path / "ft.dduf", base=str(base), quiet=True).path
    shutil.rmtree(base)
    with pytest.raises(DDUFReferenceError, match=r"'(vae|text_encoder|tokenizer|scheduler)'"):
        load_dduf(out, local_files_only=True, cache_dir=tmp_path / "empty-cache")


def test_zst_decompression_budget_is_a_load_argument(tmp_path, packed, monkeypatch):
    from dduf_plus.errors import DDUFError
    from dduf_plus.storage.zst import compress

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    zst = compress(packed["tiny-dit"], tmp_path / "tiny.dduf.zst", quiet=True).path
    with pytest.raises(DDUFError, match="budget"):
        load_dduf(zst, max_decompressed=4096)
    assert not list((tmp_path / "cache").rglob("*.dduf"))  # nothing left behind over budget
    assert load_dduf(zst) is not None


def test_missing_zst_is_a_file_not_found_error(tmp_path):
    from dduf_plus.errors import DDUFNotFoundError

    with pytest.raises(FileNotFoundError) as caught:
        load_dduf(tmp_path / "missing.dduf.zst")
    assert isinstance(caught.value, DDUFNotFoundError)
