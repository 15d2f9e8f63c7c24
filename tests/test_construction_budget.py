"""The construction budget on every path that builds a model from an untrusted config (issue 18 item 7): the
quanto paths (``quanto_qmap.json``, a ``quantization_config``) and ``dduf pack --dtype``'s conversion skeleton
built models with no budget: a 3,000-layer config over a 2-layer checkpoint ran 25-60 s of CPU (and 600+ MB)
before failing on missing weights. Now each is refused as soon as construction passes a small multiple of the
stored weights (dduf_plus/torchkit/meta_model.py): the tests count what construction built (modules and
parameter/buffer elements, through torch's global registration hooks), not seconds."""

from __future__ import annotations

import json
import resource
import shutil
from pathlib import Path

import pytest
import torch
from counting import assert_small, built

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFPackError
from dduf_plus.loading.files import FolderComponentFiles
from dduf_plus.torchkit.meta_model import ConstructionBudgetError, construction_budget, meta_model

pytest.importorskip("optimum.quanto")
from diffusers import PixArtTransformer2DModel, QuantoConfig  # noqa: E402
from optimum.quanto import freeze, qint8, quantize  # noqa: E402

from dduf_plus.loading import quant  # noqa: E402

LAYERS = 3000


def _grow(folder: Path, key: str = "num_layers", value: int = LAYERS) -> dict:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    return config


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """The tiny DiT's transformer quantized two ways (quanto_qmap.json; diffusers' quantization_config), each a
    component folder; the stored weights are those of its 2 layers."""
    root = tmp_path_factory.mktemp("quantized")
    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)
    quantize(model, weights=qint8)
    freeze(model)
    (root / "qmap").mkdir()
    quant.save_quanto_component(model, root / "qmap")
    shutil.copy(PIPELINES / "tiny-dit" / "transformer" / "config.json", root / "qmap" / "config.json")
    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     quantization_config=QuantoConfig(weights_dtype="int8"),
                                                     torch_dtype=torch.bfloat16)
    model.save_pretrained(root / "qconfig")
    return {"qmap": root / "qmap", "qconfig": root / "qconfig"}


@pytest.mark.parametrize("key", ["num_layers", "num_attention_heads"])
def test_quanto_qmap_component_asking_for_a_huge_model_is_refused(quantized, tmp_path, key) -> None:
    folder = tmp_path / "transformer"
    shutil.copytree(quantized["qmap"], folder)
    config = _grow(folder, key, LAYERS if key == "num_layers" else 4096)
    with built() as counts, pytest.raises(ConstructionBudgetError, match="far bigger than the weights stored"):
        quant.load_quanto_component(PixArtTransformer2DModel, config, FolderComponentFiles(folder))
    assert_small(counts)


def test_quantization_config_component_asking_for_a_huge_model_is_refused(quantized, tmp_path) -> None:
    folder = tmp_path / "transformer"
    shutil.copytree(quantized["qconfig"], folder)
    config = _grow(folder)
    with built() as counts, pytest.raises(ConstructionBudgetError, match="PixArtTransformer2DModel far bigger"):
        quant.load_with_diffusers_quantizer(PixArtTransformer2DModel, config, FolderComponentFiles(folder))
    assert_small(counts)


def test_quantized_components_within_budget_still_load(quantized) -> None:
    for kind, load in (("qmap", quant.load_quanto_component), ("qconfig", quant.load_with_diffusers_quantizer)):
        files = FolderComponentFiles(quantized[kind])
        model = load(PixArtTransformer2DModel, files.read_json("config.json"), files)
        assert len(model.transformer_blocks) == 2


def test_pack_dtype_of_a_huge_config_is_refused(tmp_path) -> None:
    from dduf_plus.packing.convert import pack_converted

    folder = tmp_path / "pipe"
    shutil.copytree(PIPELINES / "tiny-dit", folder)
    _grow(folder / "transformer")
    with built() as counts, \
            pytest.raises(DDUFPackError, match="transformer: its config makes PixArtTransformer2DModel far bigger"):
        pack_converted(folder, tmp_path / "out.dduf", dtype="float16", quiet=True)
    assert_small(counts)
    assert not (tmp_path / "out.dduf").exists()


def test_pack_dtype_within_budget_still_converts(tmp_path) -> None:
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.packing.convert import pack_converted

    out = pack_converted(PIPELINES / "tiny-dit", tmp_path / "out.dduf", dtype="float16", quiet=True).path
    with DDUFArchive(out) as archive:
        dtypes = {info.dtype for info in archive.headers["transformer/diffusion_pytorch_model.safetensors"].tensors.values()}
    assert "float16" in dtypes


def test_meta_model_refuses_past_the_budget_and_names_where() -> None:
    config = json.loads((PIPELINES / "tiny-dit" / "transformer" / "config.json").read_text())
    stored = {"w": ("float32", (4, 4), 64)}
    with pytest.raises(ConstructionBudgetError, match=r"here/transformer: .* \(over 264 modules; 1 tensors"):
        meta_model(PixArtTransformer2DModel, {**config, "num_layers": LAYERS}, "here/transformer", stored)
    assert isinstance(ConstructionBudgetError("x"), DDUFError)


def test_budgets_nest_and_end_with_their_block() -> None:
    with construction_budget("outer", "Outer", {"w": ("float32", (1,), 4)}):
        with pytest.raises(ConstructionBudgetError, match="inner"):
            with construction_budget("inner", "Inner", {}):
                torch.nn.Sequential(*[torch.nn.Identity() for _ in range(300)])
        torch.nn.Sequential(*[torch.nn.Identity() for _ in range(100)])  # the outer budget counts again
    torch.nn.Sequential(*[torch.nn.Identity() for _ in range(1000)])  # no budget outside the block


def test_other_quantizers_build_a_folder_component_within_the_budget(quantized, tmp_path) -> None:
    """A referenced folder quantized with another backend goes to its class' own ``from_pretrained``: that
    construction runs under the budget too (here a stand-in class whose from_pretrained builds 10,000 modules
    over the 2 stored layers)."""
    folder = tmp_path / "transformer"
    shutil.copytree(quantized["qconfig"], folder)
    config = json.loads((folder / "config.json").read_text())
    # a backend dduf_plus does not rebuild itself (bitsandbytes and torchao are: tests/test_quant_backends.py)
    config["quantization_config"] = {"quant_method": "gguf", "compute_dtype": "float32"}

    class Greedy(torch.nn.Module):
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            return torch.nn.Sequential(*[torch.nn.Identity() for _ in range(10_000)])

    with pytest.raises(ConstructionBudgetError, match="Greedy far bigger"):
        quant.load_with_diffusers_quantizer(Greedy, config, FolderComponentFiles(folder))


@pytest.mark.parametrize("edit", [{"sample_size": 2147483647}, {"sample_size": [65536, 65536]},
                                  {"pos_embed_max_size": 1 << 20}])
def test_a_huge_position_grid_is_refused_before_it_is_computed(tmp_path, edit) -> None:
    """A patch transformer computes its position table before registering it (the hooks saw it too late:
    sample_size 2147483647 took 55 s and 8.6 GB): the grid is checked against the budget first, on the
    loader's path and on pack --dtype's."""
    from dduf_plus import load_dduf, pack

    folder = tmp_path / "tiny-dit"
    shutil.copytree(PIPELINES / "tiny-dit", folder)
    config_path = folder / "transformer" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **edit}))
    archive = tmp_path / "grid.dduf"
    pack(folder, archive, quiet=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    with built() as counts:
        with pytest.raises(ConstructionBudgetError, match="transformer.*position-embedding grid"):
            load_dduf(archive)
        with pytest.raises(DDUFPackError, match="position-embedding grid"):
            pack(folder, tmp_path / "grid-bf16.dduf", dtype="bfloat16", quiet=True)
    assert_small(counts)  # the grid is computed before it is registered: the peak RSS says it was not
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before < 1 << 30  # the old run: 8.6 GB


def test_real_position_grids_fit_the_budget() -> None:
    from dduf_plus.torchkit.meta_model import ELEMENT_SLACK, position_grid_elements

    pixart_1024 = {"patch_size": 2, "sample_size": 128, "num_attention_heads": 16, "attention_head_dim": 72}
    sd3 = {"patch_size": 2, "sample_size": 128, "pos_embed_max_size": 192, "num_attention_heads": 24,
           "attention_head_dim": 64}
    assert position_grid_elements(pixart_1024) == 64 * 64 * 1152 < ELEMENT_SLACK
    assert position_grid_elements(sd3) == 192 * 192 * 1536
    assert position_grid_elements({"sample_size": 1 << 30}) == 0  # a UNet: sample_size is metadata only
