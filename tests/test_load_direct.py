"""The direct path for transformers text encoders (``models.build_transformers_direct``): when the stored names
and shapes are exactly the model's, load_dduf builds the model without transformers' generic loader (whose
first call in a process builds the conversion table of every architecture: most of a warm SD-1.5 load), and
the model is the one that loader returns: same tensors (views of the archive), buffers, config, attributes,
outputs; other layouts still go through the loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dduf_plus import load_dduf
from dduf_plus.errors import DDUFLoadError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.loading import models
from dduf_plus.loading.components import build_component
from dduf_plus.loading.files import ArchiveComponentFiles, FolderComponentFiles
from dduf_plus.loading.models import ModelRequest, build_transformers_model
from dduf_plus.loading.transfer import materialize

transformers = pytest.importorskip("transformers")


def _request() -> ModelRequest:
    return ModelRequest(variant=None, dtype="auto", device=torch.device("cpu"), declared=None,
                        name_or_path="x/text_encoder", materialize=materialize)


def _through_loader(monkeypatch, cls, files):
    with monkeypatch.context() as m:
        m.setattr(models, "DIRECT_TRANSFORMERS", {})
        return build_transformers_model(cls, files, _request())


def _assert_same_model(direct, loaded):
    ours = dict(direct.named_parameters()) | dict(direct.named_buffers())
    theirs = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        mine = ours[name]
        assert (type(mine), mine.dtype, mine.requires_grad) == (type(tensor), tensor.dtype, tensor.requires_grad), name
        assert torch.equal(mine, tensor), name
    assert direct.config.to_dict() == loaded.config.to_dict()
    skip = {"_modules", "_parameters", "_buffers", "config"}
    assert {k: repr(v) for k, v in vars(direct).items() if k not in skip} == \
           {k: repr(v) for k, v in vars(loaded).items() if k not in skip}
    assert not direct.training and not any(m.training for m in direct.modules())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(direct(ids).last_hidden_state, loaded(ids).last_hidden_state)


def test_load_dduf_builds_the_text_encoder_without_transformers_loader(packed, monkeypatch):
    calls = []
    original = transformers.CLIPTextModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.CLIPTextModel, "from_pretrained", classmethod(spy))
    pipe = load_dduf(packed["tiny-sd"])
    assert calls == []  # the old path called transformers' from_pretrained for the text encoder
    assert pipe.text_encoder.config.name_or_path.endswith("text_encoder")


def test_direct_model_equals_transformers_loader(packed, monkeypatch):
    files = ArchiveComponentFiles(DDUFArchive(packed["tiny-sd"]), "text_encoder")
    direct = build_transformers_model(transformers.CLIPTextModel, files, _request())
    loaded = _through_loader(monkeypatch, transformers.CLIPTextModel, files)
    _assert_same_model(direct, loaded)


def _clip_folder(tmp_path, names):
    config = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                                         num_hidden_layers=2, vocab_size=1000, max_position_embeddings=77,
                                         bos_token_id=0, eos_token_id=2, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.CLIPTextModel(config)
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    state = {names(k): v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return FolderComponentFiles(folder)


def test_prefixed_clip_checkpoint_is_direct_and_saves_its_names_back(tmp_path, monkeypatch):
    """Hub SD checkpoints store ``text_model.*``, which transformers 5 strips: so does the direct path, and
    save_pretrained writes the stored names back, as after transformers' loader."""
    files = _clip_folder(tmp_path, lambda k: f"text_model.{k}")
    taken = []
    direct_builder = models.build_transformers_direct
    monkeypatch.setattr(models, "build_transformers_direct",
                        lambda *a, **k: taken.append(m := direct_builder(*a, **k)) or m)
    direct = build_transformers_model(transformers.CLIPTextModel, files, _request())
    assert taken and taken[0] is direct
    loaded = _through_loader(monkeypatch, transformers.CLIPTextModel, files)
    _assert_same_model(direct, loaded)
    direct.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert all(k.startswith("text_model.") for k in f.keys())


def test_other_layouts_go_through_transformers_loader(tmp_path, monkeypatch):
    """Mixed names (some prefixed, some not) are no layout the direct path knows: transformers' loader
    decides (it strips the prefix where present), and the model is still the loader's."""
    files = _clip_folder(tmp_path, lambda k: f"text_model.{k}" if "layers.0." in k else k)
    stored = {n: None for n in files.tensor_infos(["model.safetensors"])}
    assert models._direct_names(stored, "text_model") == (None, None)
    direct = build_transformers_model(transformers.CLIPTextModel, files, _request())
    _assert_same_model(direct, _through_loader(monkeypatch, transformers.CLIPTextModel, files))


def test_shape_mismatch_keeps_the_loaders_error(tmp_path):
    files = _clip_folder(tmp_path, lambda k: k)
    config = json.loads((files.path / "config.json").read_text())
    config["hidden_size"] = 64  # the stored tensors are 32 wide
    (files.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDUFLoadError, match="text_encoder.*CLIPTextModel"):  # the loader's refusal, named
        build_component(transformers.CLIPTextModel, files, _request())


def test_another_transformers_internal_signature_falls_back_to_the_loader(packed, monkeypatch):
    """transformers 5.17's ``get_init_context`` takes one argument fewer than the one the direct path calls:
    where an internal has other parameters, the loader builds the model (it used to fail the whole load)."""
    original = transformers.CLIPTextModel.get_init_context.__func__

    def older(cls, dtype, is_quantized, _is_ds_init_called, *rest):  # other names than the direct path passes
        return original(cls, dtype, is_quantized, _is_ds_init_called, *rest)  # (this loader's call still works)

    monkeypatch.setattr(transformers.CLIPTextModel, "get_init_context", classmethod(older))
    models._INTERNALS_FIT.clear()
    try:
        assert not models._transformers_internals_fit(transformers.CLIPTextModel)
        files = ArchiveComponentFiles(DDUFArchive(packed["tiny-sd"]), "text_encoder")
        taken = []
        direct_builder = models.build_transformers_direct
        monkeypatch.setattr(models, "build_transformers_direct",
                            lambda *a, **k: taken.append(m := direct_builder(*a, **k)) or m)
        built = build_transformers_model(transformers.CLIPTextModel, files, _request())
        assert taken == [None]  # asked, declined: the loader built it
        _assert_same_model(built, _through_loader(monkeypatch, transformers.CLIPTextModel, files))
        pipe = load_dduf(packed["tiny-sd"])  # the whole load, which used to fail on it
        assert taken == [None] * len(taken) and isinstance(pipe.text_encoder, transformers.CLIPTextModel)
    finally:
        models._INTERNALS_FIT.clear()


def test_this_transformers_takes_the_direct_path():
    """The check above must not refuse the transformers the suite runs with (else the direct path is dead)."""
    assert models._transformers_internals_fit(transformers.CLIPTextModel)
