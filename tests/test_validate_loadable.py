"""Valid means it loads: a model component stored with its config but no weights (D016) and a component class
its library does not have (D017) are errors of default validation, refused by the loader with the same codes;
the opt-in load check (``load_check=True`` / ``--load-check``) builds each model on the meta device and matches
its state-dict table to the stored headers (L001-L005), never crashing on a hostile config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from counting import assert_small, built

from conftest import PIPELINES
from dduf_plus import validate, validate_many
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError
from dduf_plus.format.pack import pack_folder

TINY_SD = PIPELINES / "tiny-sd"


def variant(tmp_path: Path, name: str = "p", *, drop: tuple[str, ...] = (), index: dict | None = None,
            configs: dict[str, dict] | None = None) -> Path:
    """tiny-sd packed after edits: files dropped, model_index.json keys set, config keys set."""
    folder = tmp_path / name
    shutil.copytree(TINY_SD, folder)
    for rel in drop:
        (folder / rel).unlink()
    if index:
        data = json.loads((folder / "model_index.json").read_text())
        data.update(index)
        (folder / "model_index.json").write_text(json.dumps(data))
    for rel, changes in (configs or {}).items():
        data = json.loads((folder / rel).read_text())
        data.update(changes)
        (folder / rel).write_text(json.dumps(data))
    return pack_folder(folder, tmp_path / f"{name}.dduf", quiet=True, check=False).path


def codes(report) -> set[str]:
    return {f.code for f in report.findings}


def load_error(path: Path, **kwargs) -> DDUFError:
    from dduf_plus import load_dduf

    with pytest.raises(DDUFError) as info:
        load_dduf(path, **kwargs)
    return info.value


UNET_WEIGHTS = ("unet/diffusion_pytorch_model-00001-of-00002.safetensors",
                "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
                "unet/diffusion_pytorch_model.safetensors.index.json")


# --- D016 ------------------------------------------------------------------------------------------------------
def test_model_component_without_weights_is_d016_and_the_loader_says_so(tmp_path):
    archive = variant(tmp_path, drop=UNET_WEIGHTS)
    report = validate(archive)
    assert not report.valid and [(f.code, f.entry) for f in report.errors] == [("D016", "unet")]
    assert "UNet2DConditionModel is a model" in report.errors[0].message
    error = load_error(archive)
    assert error.codes == ["D016"] and "D016 unet" in str(error) and "load_dduf(..., unet=...)" in str(error)


def test_weightless_kinds_and_referenced_components_are_not_d016(tmp_path):
    """The scheduler and tokenizer folders hold configs and no weights: fine. A model class name with a
    tokenizer's config is not a model either; nor is an image processor stored with a plain config.json."""
    report = validate(variant(tmp_path))
    assert report.valid and "D016" not in codes(report)
    from dduf_plus.format.class_names import is_model_component

    assert not is_model_component("PNDMScheduler", ["scheduler_config.json"])
    assert not is_model_component("CLIPTokenizer", ["tokenizer_config.json", "vocab.json"])
    assert not is_model_component("VaeImageProcessor", ["config.json"])
    assert not is_model_component(None, ["preprocessor_config.json"])
    assert is_model_component("UNet2DConditionModel", ["config.json"])
    assert is_model_component(None, ["config.json"])  # an unknown class with a model's config


def test_a_passed_component_loads_though_its_folder_has_no_weights(tmp_path):
    """The loader refuses D016 where it would build the component: passing it yourself still loads."""
    from dduf_plus import load_dduf

    whole = load_dduf(variant(tmp_path, "whole"))
    pipe = load_dduf(variant(tmp_path, drop=UNET_WEIGHTS), unet=whole.unet)
    assert pipe.unet is whole.unet


# --- D017 ------------------------------------------------------------------------------------------------------
def test_unknown_component_class_is_d017_with_the_closest_name(tmp_path):
    archive = variant(tmp_path, index={"unet": ["diffusers", "UNet2DConditionModle"],
                                       "text_encoder": ["transformers", "CLIPTextModle"]})
    report = validate(archive)
    found = {f.entry: f.message for f in report.errors if f.code == "D017"}
    assert set(found) == {"unet", "text_encoder"}, report
    assert "did you mean UNet2DConditionModel?" in found["unet"]
    assert "did you mean CLIPTextModel?" in found["text_encoder"]
    error = load_error(archive)
    assert error.codes == ["D017"] and "did you mean UNet2DConditionModel?" in str(error)
    assert "load_dduf(..., text_encoder=..., unet=...)" in str(error)


def test_names_the_loader_maps_or_cannot_check_are_not_d017(tmp_path):
    """diffusers maps CLIPFeatureExtractor to CLIPImageProcessor itself; a library other than diffusers and
    transformers (or one not installed) is nothing to check against; a pipeline class is pack's warning."""
    from dduf_plus.format.class_names import class_findings

    index = json.loads((TINY_SD / "model_index.json").read_text())
    index |= {"feature_extractor": ["transformers", "CLIPFeatureExtractor"],
              "safety_checker": ["my_library", "NoSuchClass"], "_class_name": "MyOwnPipeline"}
    assert class_findings(index) == []
    index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjektion"]
    assert [f.entry for f in class_findings(index)] == ["image_encoder"]


def test_validate_still_imports_no_torch(tmp_path):
    """The D017 lookup reads the libraries' source text: ``dduf validate`` of an archive with a typo (which
    falls back to transformers' lazy table) imports neither torch nor diffusers."""
    archive = variant(tmp_path, index={"text_encoder": ["transformers", "CLIPTextModle"]})
    code = ("import sys; from dduf_plus.cli import main; rc = main(['validate', '-q', sys.argv[1]]); "
            "print(rc, [m for m in ('torch', 'diffusers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code, str(archive)], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "1 []", done.stdout + done.stderr


# --- the load check ------------------------------------------------------------------------------------------
def test_load_check_passes_a_good_pipeline(tmp_path, capsys):
    archive = variant(tmp_path)
    report = validate(archive, load_check=True)
    assert report.valid and not [c for c in codes(report) if c.startswith("L")], report
    assert cli_main(["validate", "--load-check", str(archive)]) == 0
    assert [r.valid for r in validate_many([archive], load_check=True)] == [True]
    for name in ("tiny-dit", "tiny-sd-finetune"):  # T5EncoderModel (tied embeddings) and PixArt; a fine-tune
        other = pack_folder(PIPELINES / name, tmp_path / f"{name}.dduf", quiet=True).path
        report = validate(other, load_check=True)
        assert report.valid and not [c for c in codes(report) if c.startswith("L")], (name, report)


def test_load_check_finds_tensors_that_do_not_fit(tmp_path):
    archive = variant(tmp_path, configs={
        "unet/config.json": {"cross_attention_dim": 64},  # the stored attn2 to_k/to_v are [32, 32]
        "text_encoder/config.json": {"num_hidden_layers": 3},  # one layer more than stored
        "vae/config.json": {"layers_per_block": 200},  # far more than stored: the construction budget
    })
    assert validate(archive).valid  # structurally nothing is wrong
    with built() as counts:
        report = validate(archive, load_check=True)
    found = {f.code: f for f in report.errors}
    assert set(found) == {"L001", "L003", "L004"}, report
    assert found["L003"].entry == "unet" and "attn2.to_k.weight float16[32, 32] (the model's: float32[32, 64])" \
        in found["L003"].message
    assert found["L001"].entry == "text_encoder" and "encoder.layers.2." in found["L001"].message
    assert found["L004"].entry == "vae" and "far bigger than the weights stored" in found["L004"].message
    assert_small(counts)  # the 200-layer VAE was refused, not built


def test_load_check_finds_stored_tensors_the_model_does_not_have(tmp_path):
    archive = variant(tmp_path, configs={"text_encoder/config.json": {"num_hidden_layers": 1}})
    found = [f for f in validate(archive, load_check=True).errors if f.code == "L002"]
    assert [f.entry for f in found] == ["text_encoder"] and "encoder.layers.1." in found[0].message
    assert cli_main(["validate", "-q", str(archive)]) == 0  # without the flag: valid
    assert cli_main(["validate", "-q", "--load-check", str(archive)]) == 1


@pytest.mark.parametrize("change", [
    {"block_out_channels": "not a list"},
    {"layers_per_block": -3},
    {"in_channels": 10 ** 12},
])
def test_load_check_never_crashes_on_a_hostile_config(tmp_path, change):
    report = validate(variant(tmp_path, configs={"unet/config.json": change}), load_check=True)
    assert "X000" not in codes(report), report
    assert [f.entry for f in report.errors if f.code.startswith("L")] == ["unet"]


def test_quantized_components_are_left_out_with_an_info(tmp_path):
    archive = variant(tmp_path, configs={"unet/config.json": {"quantization_config": {"quant_method": "torchao"}}})
    report = validate(archive, load_check=True)
    assert [(f.code, f.entry) for f in report.infos if f.code == "L005"] == [("L005", "unet")]
    assert not [f for f in report.errors if f.code.startswith("L")]


def test_load_check_is_opt_in(tmp_path):
    """Default validation never builds a model: the same archive, no L finding without load_check."""
    archive = variant(tmp_path, configs={"text_encoder/config.json": {"num_hidden_layers": 3}})
    assert validate(archive).valid and "L001" in codes(validate(archive, load_check=True))


def test_class_lookups_from_many_threads_agree(tmp_path):
    """dduf serve and validate_many validate on threads: the per-process name tables grow under a lock, so
    concurrent lookups (a typo makes one read more of transformers) never see a set change under them."""
    from concurrent.futures import ThreadPoolExecutor

    from dduf_plus.format import class_names

    class_names.forget_libraries()  # every thread starts from nothing
    index = json.loads((TINY_SD / "model_index.json").read_text())
    typo = dict(index, text_encoder=["transformers", "CLIPTextModle"], unet=["diffusers", "UNet2DConditionModle"])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(class_names.class_findings, [index, typo] * 8))
    assert all(r == [] for r in results[::2])
    assert all(sorted(f.entry for f in r) == ["text_encoder", "unet"] for r in results[1::2])
