"""load_dduf: images identical to diffusers' own folder loading, zero-copy parameters, configs, round trips."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.format.pack import pack_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
NAMES = ("tiny-sd", "tiny-sd-finetune", "tiny-dit")
PROMPT = "a photo of a cat sitting on a mat"


def run(pipe, name: str, seed: int = 0) -> np.ndarray:
    """Two steps, fixed seed, numpy output: what every equality test compares."""
    pipe.set_progress_bar_config(disable=True)
    extra = {"use_resolution_binning": False, "clean_caption": False} if "dit" in name else {}
    return pipe(PROMPT, num_inference_steps=2, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(seed), **extra).images


def reference(name: str, **kwargs):
    return diffusers.DiffusionPipeline.from_pretrained(PIPELINES / name, dtype=torch.float32, **kwargs)


def archive_ranges(path: str | os.PathLike) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (from /proc/self/maps)."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end))
    return out


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    """Each fixture packed by dduf_plus (default weights), with the fp16 variant, and by huggingface_hub."""
    from huggingface_hub import export_folder_as_dduf

    out = tmp_path_factory.mktemp("load")
    made = {}
    for name in NAMES:
        made[name] = pack_folder(PIPELINES / name, out / f"{name}.dduf", quiet=True).path
        if name != "tiny-dit":  # tiny-dit has no fp16 weights: pack refuses that variant, as the loader does
            made[f"{name}:fp16"] = pack_folder(PIPELINES / name, out / f"{name}.fp16.dduf", variant="fp16",
                                               quiet=True).path
        export_folder_as_dduf(out / f"{name}.hub.dduf", PIPELINES / name)
        made[f"{name}:hub"] = out / f"{name}.hub.dduf"
    return made


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    """diffusers 0.42 folder loads, fp32: the images every load_dduf result must equal exactly."""
    out = {}
    for name in NAMES:
        out[name] = run(reference(name), name)
        if name != "tiny-dit":
            out[f"{name}:fp16"] = run(reference(name, variant="fp16"), name)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_fp32_images_equal_diffusers(archives, expected, name):
    pipe = load_dduf(archives[name], torch_dtype=torch.float32)
    assert type(pipe).__name__ == reference_class(name)
    assert np.array_equal(run(pipe, name), expected[name])


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-sd-finetune"))
@pytest.mark.parametrize("source", (":fp16", ":hub"))
def test_fp16_variant_images_equal_diffusers(archives, expected, name, source):
    pipe = load_dduf(archives[name + source], torch_dtype=torch.float32, variant="fp16")
    assert np.array_equal(run(pipe, name), expected[f"{name}:fp16"])


@pytest.mark.parametrize("name", NAMES)
def test_huggingface_hub_archives_load(archives, expected, name):
    # export_folder_as_dduf aligns nothing (misaligned tensors are copied) and stores both vae variants.
    pipe = load_dduf(archives[f"{name}:hub"], dtype="float32")
    assert np.array_equal(run(pipe, name), expected[name])


def test_pread_path_equals_mmap_path(archives, expected, monkeypatch):
    import mmap

    def no_map(*args, **kwargs):
        raise AssertionError("use_mmap=False mapped the archive")

    monkeypatch.setattr(mmap, "mmap", no_map)  # nothing is mapped (network file systems), prefetch or not
    pipe = load_dduf(archives["tiny-sd"], torch_dtype=torch.float32, use_mmap=False, prefetch=True)
    monkeypatch.undo()
    assert np.array_equal(run(pipe, "tiny-sd"), expected["tiny-sd"])
    assert not archive_ranges(archives["tiny-sd"]) or all(
        not inside(p.data_ptr(), archive_ranges(archives["tiny-sd"])) for p in pipe.unet.parameters())


def test_pread_reads_the_archive_that_was_opened(archives, tmp_path):
    """use_mmap=False reads from the descriptor whose structure was checked: a file put in the archive's place
    after it was opened is never read (it was, when tensors were read by path)."""
    import shutil

    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.files import ArchiveComponentFiles

    path = tmp_path / "a.dduf"
    shutil.copy(archives["tiny-sd"], path)
    with DDUFArchive(archives["tiny-sd"]) as original:
        expected = {k: v.clone() for k, v in original.tensors("unet").items()}
    with DDUFArchive(path) as archive:
        files = ArchiveComponentFiles(archive, "unet", use_mmap=False)
        other = tmp_path / "zeros"
        other.write_bytes(bytes(path.stat().st_size))
        os.replace(other, path)
        got = files.tensors(files.weight_files())
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], v) for k, v in expected.items())


def reference_class(name: str) -> str:
    return "PixArtAlphaPipeline" if "dit" in name else "StableDiffusionPipeline"


def inside(pointer: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= pointer < end for start, end in ranges)


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-dit"))
def test_auto_parameters_view_the_archive_mapping(archives, name):
    path = archives[name]
    pipe = load_dduf(path)  # torch_dtype="auto"
    ranges = archive_ranges(path)
    assert ranges, "the archive is not mapped"
    for component in ("unet", "transformer", "text_encoder", "vae"):
        module = getattr(pipe, component, None)
        if module is None:
            continue
        state = module.state_dict()
        outside = [k for k, t in state.items() if not inside(t.data_ptr(), ranges)]
        # transformers ties T5's encoder.embed_tokens to shared: same storage, also inside
        assert not outside, f"{component}: {outside[:5]} were copied"


def test_auto_keeps_saved_dtypes(archives):
    sd = load_dduf(archives["tiny-sd"])
    assert (sd.unet.dtype, sd.text_encoder.dtype, sd.vae.dtype) == (torch.float16, torch.float32, torch.float32)
    dit = load_dduf(archives["tiny-dit"])
    assert (dit.transformer.dtype, dit.text_encoder.dtype, dit.vae.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    fp16 = load_dduf(archives["tiny-sd:fp16"])  # the archive holds only the vae's fp16 variant
    assert fp16.vae.dtype == torch.float16


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-dit"))
def test_configs_equal_diffusers(archives, name):
    ours, theirs = load_dduf(archives[name], torch_dtype=torch.float32), reference(name)
    assert _without_path(dict(ours.config)) == _without_path(dict(theirs.config))
    for component, value in theirs.components.items():
        mine = getattr(ours, component)
        assert type(mine) is type(value), component
        if value is None:
            continue
        config = getattr(value, "config", None)
        if config is not None:
            a = mine.config.to_dict() if hasattr(config, "to_dict") else dict(mine.config)
            b = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            assert _without_path(a) == _without_path(b), component
        if hasattr(value, "state_dict"):
            mine_sd, their_sd = mine.state_dict(), value.state_dict()
            assert mine_sd.keys() == their_sd.keys(), component
            assert all(torch.equal(mine_sd[k], their_sd[k]) for k in their_sd), component
            assert dict(mine.named_buffers()).keys() == dict(value.named_buffers()).keys(), component
            assert mine.training is False
    tokens = ours.tokenizer(PROMPT, padding="max_length", max_length=16, truncation=True).input_ids
    assert tokens == theirs.tokenizer(PROMPT, padding="max_length", max_length=16, truncation=True).input_ids


def _without_path(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "name_or_path")}


def test_name_or_path_points_into_the_archive(archives):
    path = str(archives["tiny-sd"])
    pipe = load_dduf(path)
    assert pipe.config._name_or_path == path
    assert pipe.unet.config._name_or_path == os.path.join(path, "unet")
    assert pipe.text_encoder.config.name_or_path == os.path.join(path, "text_encoder")


def test_save_pretrained_round_trip(archives, expected, tmp_path):
    pipe = load_dduf(archives["tiny-sd"], torch_dtype=torch.float32)
    pipe.save_pretrained(tmp_path / "saved")
    again = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert np.array_equal(run(again, "tiny-sd"), expected["tiny-sd"])
    # and the auto (mixed precision) pipeline saves each component in its own dtype
    mixed = load_dduf(archives["tiny-sd"])
    mixed.save_pretrained(tmp_path / "mixed")
    back = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "mixed", dtype={"unet": torch.float16, "default": torch.float32})
    assert back.unet.dtype == torch.float16 and back.vae.dtype == torch.float32


def test_kwargs_replace_components_and_set_options(archives, expected):
    base = load_dduf(archives["tiny-sd"], torch_dtype=torch.float32)
    my_vae = copy.deepcopy(base.vae)
    pipe = load_dduf(archives["tiny-sd"], torch_dtype=torch.float32, vae=my_vae, requires_safety_checker=False)
    assert pipe.vae is my_vae
    assert pipe.config.requires_safety_checker is False
    assert np.array_equal(run(pipe, "tiny-sd"), expected["tiny-sd"])
    assert load_dduf(archives["tiny-sd"], safety_checker=None).safety_checker is None
    scheduler = diffusers.DDIMScheduler.from_config(base.scheduler.config)
    assert load_dduf(archives["tiny-sd"], scheduler=scheduler).scheduler is scheduler


def test_per_component_dtype_and_device_dicts(archives):
    pipe = load_dduf(archives["tiny-sd"], dtype={"unet": "bfloat16", "default": torch.float32},
                     device_map={"default": "cpu"})
    assert pipe.unet.dtype == torch.bfloat16
    assert pipe.text_encoder.dtype == torch.float32 and pipe.vae.dtype == torch.float32
    assert np.isfinite(run(pipe, "tiny-sd")).all()


def test_referenced_components_resolve(tmp_path):
    """A partial archive (every component but the unet referenced to a base folder) loads like the full one."""
    import shutil

    from dduf_plus.packing.partial import pack_partial

    base = tmp_path / "base"
    shutil.copytree(PIPELINES / "tiny-sd", base)
    out = pack_partial(PIPELINES / "tiny-sd-finetune", tmp_path / "ft.dduf", base=str(base), quiet=True).path
    pipe = load_dduf(out, torch_dtype=torch.float32, local_files_only=True)
    full = reference("tiny-sd-finetune")
    assert np.array_equal(run(pipe, "tiny-sd-finetune"), run(full, "tiny-sd-finetune"))


def test_top_level_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, dduf_plus, dduf_plus.loading, dduf_plus.fs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_file_cache_is_content_keyed(tmp_path, monkeypatch, archives):
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.files import ArchiveComponentFiles

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    with DDUFArchive(archives["tiny-sd"]) as a, DDUFArchive(archives["tiny-sd-finetune"]) as b:
        first = ArchiveComponentFiles(a, "tokenizer").local_dir()
        second = ArchiveComponentFiles(b, "tokenizer").local_dir()  # byte-identical tokenizer: same folder
        assert first == second and Path(first).parent == tmp_path / "cache" / "files"
        assert sorted(os.listdir(first)) == sorted(a.component("tokenizer").files)
        with pytest.raises(Exception, match="never extracted"):
            ArchiveComponentFiles(a, "unet").local_dir(["diffusion_pytorch_model-00001-of-00002.safetensors"])
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")] == []


def test_folder_component_files_match_archive(archives):
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.files import ArchiveComponentFiles, ComponentFiles, FolderComponentFiles

    folder = FolderComponentFiles(PIPELINES / "tiny-sd" / "unet")
    with DDUFArchive(archives["tiny-sd"]) as archive:
        packed = ArchiveComponentFiles(archive, "unet")
        assert isinstance(folder, ComponentFiles) and isinstance(packed, ComponentFiles)
        assert folder.weight_files() == packed.weight_files() == [
            "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
        a, b = folder.tensors(folder.weight_files()), packed.tensors(packed.weight_files())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        lazy = FolderComponentFiles(PIPELINES / "tiny-sd" / "unet", use_mmap=False).tensors(folder.weight_files())
        assert all(torch.equal(lazy[k], a[k]) for k in a)
    vae = FolderComponentFiles(PIPELINES / "tiny-sd" / "vae")
    assert vae.weight_files("fp16") == ["diffusion_pytorch_model.fp16.safetensors"]
    assert vae.weight_files() == ["diffusion_pytorch_model.safetensors"]
