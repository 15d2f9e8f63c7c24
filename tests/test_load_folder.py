"""load_dduf of a diffusers pipeline folder and of a Hub folder repo (issue 20, "every diffusers source, in its
saved precision"): the saved dtype per component (headers only), zero-copy views of the files, diffusers'
own loads state for state and image for image, only the needed files downloaded, hostile folders refused with
the archive path's codes, and inspect_dtypes / dduf info answering the same for every source."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_server import HubServer, folder_files  # noqa: E402

from dduf_plus import inspect_dtypes, load_dduf  # noqa: E402
from dduf_plus.errors import DDUFError, DDUFLoadError, DDUFValidationError  # noqa: E402
from dduf_plus.format.pack import pack_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
NAMES = ("tiny-sd", "tiny-sd-finetune", "tiny-dit")
PROMPT = "a photo of a cat sitting on a mat"
MODELS = ("unet", "transformer", "text_encoder", "vae")


def run(pipe, name: str) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    extra = {"use_resolution_binning": False, "clean_caption": False} if "dit" in name else {}
    return pipe(PROMPT, num_inference_steps=2, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(0), **extra).images


def saved_dtypes(folder: Path) -> dict[str, torch.dtype]:
    """diffusers' ``dtype={...}`` that loads each model component as saved (from the headers alone)."""
    return {n: getattr(torch, d["dtype"]) for n, d in inspect_dtypes(folder).items()} | {"default": torch.float32}


def same_state(ours, theirs) -> None:
    for component in MODELS:
        a, b = getattr(ours, component, None), getattr(theirs, component, None)
        if a is None and b is None:
            continue
        sa, sb = a.state_dict(), b.state_dict()
        assert sorted(sa) == sorted(sb), component
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, f"{component}.{key}: {sa[key].dtype} vs {sb[key].dtype}"
            assert torch.equal(sa[key], sb[key]), f"{component}.{key} differs"


def mapped_ranges(paths: list[Path]) -> list[tuple[int, int]]:
    real = {os.path.realpath(p) for p in paths}
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end))
    return out


# --- local folders ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_folder_auto_equals_diffusers_in_the_saved_dtypes(name: str, tmp_path: Path) -> None:
    folder = PIPELINES / name
    ours = load_dduf(folder)  # torch_dtype="auto"
    theirs = diffusers.DiffusionPipeline.from_pretrained(folder, dtype=saved_dtypes(folder))
    assert type(ours) is type(theirs)
    same_state(ours, theirs)
    assert ours.config._name_or_path == str(folder)
    assert dict(ours.scheduler.config) == dict(theirs.scheduler.config)
    assert ours.tokenizer.get_vocab() == theirs.tokenizer.get_vocab()
    if name == "tiny-sd":  # unet fp16 beside fp32 encoders: runs through the precision bridge, as the archive
        archive = load_dduf(pack_folder(folder, tmp_path / "tiny-sd.dduf", quiet=True).path)
        assert np.array_equal(run(ours, name), run(archive, name))


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-dit"))
def test_folder_images_equal_diffusers(name: str) -> None:
    folder = PIPELINES / name
    ours = load_dduf(folder, torch_dtype=torch.float32)  # an explicit dtype converts every component
    assert {getattr(ours, c).dtype for c in MODELS if getattr(ours, c, None) is not None} == {torch.float32}
    theirs = diffusers.DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    assert np.array_equal(run(ours, name), run(theirs, name))


def test_folder_variant_equals_diffusers() -> None:
    folder = PIPELINES / "tiny-sd"
    ours = load_dduf(folder, variant="fp16")
    assert ours.vae.dtype == torch.float16  # the fp16 variant's file, in its saved dtype
    theirs = diffusers.DiffusionPipeline.from_pretrained(folder, variant="fp16", dtype=torch.float32)
    same = load_dduf(folder, variant="fp16", torch_dtype=torch.float32)
    assert np.array_equal(run(same, "tiny-sd"), run(theirs, "tiny-sd"))


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-dit"))
def test_folder_parameters_view_the_files(name: str) -> None:
    folder = PIPELINES / name
    pipe = load_dduf(folder)
    for component in MODELS:
        module = getattr(pipe, component, None)
        if module is None:
            continue
        ranges = mapped_ranges(sorted((folder / component).glob("*.safetensors")))
        assert ranges, f"{component}: no weight file is mapped"
        copied = [k for k, t in module.state_dict().items()
                  if not any(s <= t.data_ptr() < e for s, e in ranges)]
        assert not copied, f"{component}: {copied[:5]} were copied, not viewed"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd re-saved with its unet fp32 and its text encoder fp16 (the opposite of the fixture)."""
    folder = tmp_path_factory.mktemp("mixed") / "tiny-sd-mixed"
    shutil.copytree(PIPELINES / "tiny-sd", folder)
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet", dtype=torch.float32)
    shutil.rmtree(folder / "unet")
    unet.save_pretrained(folder / "unet")
    from transformers import CLIPTextModel

    encoder = CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=torch.float16)
    shutil.rmtree(folder / "text_encoder")
    encoder.save_pretrained(folder / "text_encoder")
    return folder


def test_mixed_precision_folder_loads_each_component_as_saved(mixed: Path) -> None:
    assert {n: d["dtype"] for n, d in inspect_dtypes(mixed).items()} == \
        {"unet": "float32", "text_encoder": "float16", "vae": "float32"}
    pipe = load_dduf(mixed)
    assert (pipe.unet.dtype, pipe.text_encoder.dtype, pipe.vae.dtype) == (torch.float32, torch.float16, torch.float32)
    theirs = diffusers.DiffusionPipeline.from_pretrained(mixed, dtype=saved_dtypes(mixed))
    same_state(pipe, theirs)
    assert np.isfinite(run(pipe, "tiny-sd")).all()  # fp16 embeddings into an fp32 unet: bridged
    explicit = load_dduf(mixed, torch_dtype={"unet": torch.bfloat16, "default": torch.float32})
    assert (explicit.unet.dtype, explicit.text_encoder.dtype) == (torch.bfloat16, torch.float32)


# --- hostile folders: the archive path's codes -----------------------------------------------------------------
def _copy(tmp_path: Path, name: str = "tiny-sd") -> Path:
    folder = tmp_path / name
    shutil.copytree(PIPELINES / name, folder)
    return folder


def _codes(call) -> tuple[type, list[str] | str | None]:
    try:
        call()
    except DDUFValidationError as e:
        return type(e), e.codes
    except DDUFError as e:
        return type(e), getattr(e, "code", None)
    raise AssertionError("loaded")


def test_config_over_the_json_budget_is_refused_as_from_an_archive(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    config = json.loads((folder / "unet" / "config.json").read_text())
    config["padding"] = [0] * 1_100_000  # 3.3 MB, over the 1M values a config may hold (D013)
    (folder / "unet" / "config.json").write_text(json.dumps(config))
    archive = pack_folder(folder, tmp_path / "bad.dduf", quiet=True, check=False).path
    from_archive = _codes(lambda: load_dduf(archive))
    assert from_archive[0] is DDUFValidationError and "D013" in from_archive[1]
    assert _codes(lambda: load_dduf(folder)) == from_archive


def test_scheduler_number_out_of_range_is_refused_as_from_an_archive(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_train_timesteps": 4294967296}))
    archive = pack_folder(folder, tmp_path / "bad.dduf", quiet=True, check=False).path
    assert _codes(lambda: load_dduf(folder)) == _codes(lambda: load_dduf(archive)) == (DDUFValidationError, ["D015"])


def test_a_symlink_out_of_the_folder_is_refused_before_it_is_read(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "yours"}')
    (folder / "text_encoder" / "config.json").unlink()
    (folder / "text_encoder" / "config.json").symlink_to(secret)
    kind, codes = _codes(lambda: load_dduf(folder))
    assert kind is DDUFValidationError and codes == ["Z008"]  # the rule for an entry escaping the archive
    # a whole component folder linked from elsewhere escapes too
    shutil.rmtree(folder / "vae")
    (folder / "text_encoder" / "config.json").unlink()
    shutil.copy(PIPELINES / "tiny-sd" / "text_encoder" / "config.json", folder / "text_encoder" / "config.json")
    (folder / "vae").symlink_to(PIPELINES / "tiny-sd" / "vae")
    assert _codes(lambda: load_dduf(folder))[1] == ["Z008", "Z008", "Z008"]
    # inside the folder, a link is fine
    (folder / "vae").unlink()
    shutil.copytree(PIPELINES / "tiny-sd" / "vae", folder / "vae-real")
    (folder / "vae").symlink_to("vae-real")
    assert load_dduf(folder).vae.dtype == torch.float32


def test_non_model_classes_get_no_weights(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "unet": ["diffusers", "AutoModel"]}))
    archive = pack_folder(folder, tmp_path / "bad.dduf", quiet=True, check=False).path
    with pytest.raises(DDUFLoadError) as from_folder:
        load_dduf(folder)
    with pytest.raises(DDUFLoadError) as from_archive:
        load_dduf(archive)
    assert "AutoModel" in str(from_folder.value) and "weightless" in str(from_folder.value)
    assert str(from_folder.value).split("unet: it is")[1] == str(from_archive.value).split("unet: it is")[1]


def test_a_tokenizer_sees_only_its_own_small_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    folder = _copy(tmp_path)
    (folder / "tokenizer" / "model.safetensors").write_bytes(b"\0" * 64)  # weights where none belong
    (folder / "tokenizer" / "pytorch_model.bin").write_bytes(b"pickle")
    seen: list[set[str]] = []
    from transformers import CLIPTokenizer

    real = CLIPTokenizer.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        seen.append({p.name for p in Path(path).iterdir()})
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(CLIPTokenizer, "from_pretrained", classmethod(spy))
    load_dduf(folder)
    assert seen and not any(n.endswith((".safetensors", ".bin")) for n in seen[0]), seen


def test_a_folder_without_model_index_says_what_load_dduf_reads(tmp_path: Path) -> None:
    (tmp_path / "x.dduf").write_bytes(b"")
    with pytest.raises(DDUFError, match=r"no diffusers pipeline.*dduf_file='x.dduf'"):
        load_dduf(tmp_path)


# --- the Hub: folder repos ---------------------------------------------------------------------------------------
@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as constants

    server = HubServer()
    folder = folder_files(PIPELINES / "tiny-sd")
    junk = {"unet/diffusion_pytorch_model.bin": b"pickle" * 100, "sample.png": b"\x89PNG" + b"0" * 100,
            "text_encoder/flax_model.msgpack": b"f" * 100, "vae/model.onnx": b"o" * 100, "unet/.hidden.json": b"{}"}
    server.add("diffusers-org/tiny-sd", {**folder, **junk})
    archive = pack_folder(PIPELINES / "tiny-dit", tmp_path / "dit.dduf", quiet=True).path.read_bytes()
    server.add("diffusers-org/both", {**folder_files(PIPELINES / "tiny-sd"), "tiny-dit.dduf": archive})
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "dduf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with server:
        yield server


def needed(variant: str | None) -> set[str]:
    """What a load of tiny-sd needs: model_index.json, each component's configs and tokenizer files and the
    weights of the variant (else the default ones), nothing else."""
    from dduf_plus.format.weights import classify, select_weights

    out = {"model_index.json"}
    for comp in ("scheduler", "text_encoder", "tokenizer", "unet", "vae"):
        names = sorted(p.name for p in (PIPELINES / "tiny-sd" / comp).iterdir())
        weights = set(select_weights(names, variant))
        out |= {f"{comp}/{n}" for n in names if classify(n) is None or n in weights}
    return out


def test_hub_folder_repo_downloads_only_what_the_pipeline_needs(hub: HubServer, monkeypatch) -> None:
    pipe = load_dduf("diffusers-org/tiny-sd")
    fetched = hub.downloads()
    assert len(fetched) == len(set(fetched)), "a file was downloaded twice"
    assert set(fetched) == needed(None)
    assert "vae/diffusion_pytorch_model.fp16.safetensors" not in fetched and "sample.png" not in fetched
    assert pipe.config._name_or_path == "diffusers-org/tiny-sd"
    assert (pipe.unet.dtype, pipe.vae.dtype) == (torch.float16, torch.float32)  # as saved
    local = load_dduf(PIPELINES / "tiny-sd")
    same_state(pipe, local)
    hub.reset()
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = load_dduf("diffusers-org/tiny-sd")  # offline, from the cache: no request at all
    assert inspect_dtypes("diffusers-org/tiny-sd") == inspect_dtypes(PIPELINES / "tiny-sd")
    assert hub.requests == []
    same_state(again, local)


def test_hub_folder_repo_variant_and_revision(hub: HubServer) -> None:
    commit = hub.repos["diffusers-org/tiny-sd"].refs["main"]
    pipe = load_dduf(f"diffusers-org/tiny-sd@{commit}", variant="fp16")
    assert set(hub.downloads()) == needed("fp16")
    assert pipe.vae.dtype == torch.float16
    with pytest.raises(DDUFError, match="disagree"):
        load_dduf(f"diffusers-org/tiny-sd@{commit}", revision="main")


def test_hub_repo_with_an_archive_and_a_folder_loads_the_archive(hub: HubServer) -> None:
    pipe = load_dduf("diffusers-org/both")
    assert type(pipe).__name__ == "PixArtAlphaPipeline"  # the archive (tiny-dit), not the folder (tiny-sd)
    assert hub.downloads() == ["tiny-dit.dduf"]


# --- inspect_dtypes and dduf info: one answer per pipeline, whatever the source -----------------------------------
def test_inspect_and_info_agree_across_sources(hub: HubServer, tmp_path: Path, capsys) -> None:
    from servers import FileServer

    from dduf_plus.cli import main

    archive = pack_folder(PIPELINES / "tiny-sd", tmp_path / "web" / "tiny-sd.dduf", quiet=True).path
    pack_folder(PIPELINES / "tiny-sd", tmp_path / "web" / "tiny-sd.fp16.dduf", variant="fp16", quiet=True)
    with FileServer(archive.parent) as web:
        for variant in (None, "fp16"):  # an archive holds the variant it was packed with
            stem = "tiny-sd.fp16" if variant else "tiny-sd"
            sources = [str(PIPELINES / "tiny-sd"), str(archive.parent / f"{stem}.dduf"), web.url(f"{stem}.dduf"),
                       "diffusers-org/tiny-sd"]
            answers = [inspect_dtypes(s, variant=variant) for s in sources]
            assert all(a == answers[0] for a in answers), dict(zip(sources, answers, strict=True))
            assert answers[0]["vae"]["dtype"] == ("float16" if variant else "float32")
            infos = []
            for s in sources:
                capsys.readouterr()
                assert main(["info", "--json", s, *(["--variant", variant] if variant else [])]) == 0, s
                report = json.loads(capsys.readouterr().out)
                infos.append({n: (c["class"], c["dtype"], c["dtypes"], c["parameters"], c["bytes"])
                              for n, c in report["components"].items()})
            assert all(i == infos[0] for i in infos), dict(zip(sources, infos, strict=True))
