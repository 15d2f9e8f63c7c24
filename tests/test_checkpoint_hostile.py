"""Full checkpoints and component files in their original layouts (LDM, OpenCLIP, MMDiT, BFL) as hostile input
to the model-folder search's layout reader (``dduf_plus.packing.model_dir_layouts``): its headers are read and
converted on meta tensors by diffusers' converters, whose work grows with keys x blocks. What a header and an
(equally untrusted) archive's reference can make it do is bounded by counts, not by the reference."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import PIPELINES
from dduf_plus.format.safetensors_header import SafetensorsHeader, TensorInfo
from dduf_plus.packing import model_dir_layouts, single_file_convert
from dduf_plus.packing.model_dir_layouts import read_parts

UNET_CONFIG = json.loads((PIPELINES / "tiny-sd" / "unet" / "config.json").read_text())


def _blocks(n: int, prefix: str = "model.diffusion_model.") -> SafetensorsHeader:
    """A header of ``n`` empty ``input_blocks.N`` tensors: 0 bytes of data, ~50 bytes of header each."""
    names = [f"{prefix}input_blocks.{i}.0.weight" for i in range(n)]
    return SafetensorsHeader(0, {k: TensorInfo(k, "float16", (0,), 0, 0) for k in names}, {})


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The key counts diffusers' converter was run with (it still runs)."""
    seen: list[int] = []
    real = single_file_convert.convert_component

    def counting(kind: str, prefix: str, views: dict[str, Any], *args: Any) -> Any:
        seen.append(len(views))
        return real(kind, prefix, views, *args)

    monkeypatch.setattr(single_file_convert, "convert_component", counting)
    return seen


def test_a_reference_claiming_many_tensors_does_not_lift_the_key_cap(conversions: list[int]) -> None:
    """The cap on keys converted was twice the reference's count (+ 64), and the count comes from the archive:
    an archive claiming 5,000 tensors let a model-folder file of 5,000 empty ``input_blocks.N`` keys through to
    diffusers' LDM converter (8,000 keys: 30 s per file per reference, 32,768 allowed by the header caps). Now
    no part is converted with more than 4,096 keys, whatever the reference says; real parts have up to 1,680
    (SDXL's LDM UNet)."""
    n = model_dir_layouts._MAX_KEYS + 1
    said = list(read_parts(_blocks(n), UNET_CONFIG, n, 0))
    assert conversions == []
    assert len(said) == 1 and f"{n} tensors, more than {model_dir_layouts._MAX_KEYS}" in str(said[0])


def test_a_part_within_both_caps_is_still_converted(conversions: list[int]) -> None:
    """The caps refuse nothing real: the same header with few keys reaches the converter (and is refused by
    what it lacks, with a reason)."""
    said = list(read_parts(_blocks(40), UNET_CONFIG, 100, 0))
    assert conversions == [40]
    assert said and all(isinstance(s, str) and "LDM UNet under model.diffusion_model." in s for s in said)


def test_a_small_reference_keeps_the_relative_cap(conversions: list[int]) -> None:
    said = list(read_parts(_blocks(300), UNET_CONFIG, 100, 0))
    assert conversions == [] and "300 tensors, more than 264" in str(said[0])


# --- the single-file mutation engine (tests/mutations.py) through the model-folder search --------------------
MUTANTS = 40


@pytest.fixture(scope="module")
def sf_bases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Any]]:
    import mutations as m

    work = tmp_path_factory.mktemp("model-dir-mutants")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("DDUF_PLUS_CACHE", str(work / "dduf-cache"))
        mp.delenv("DDUF_PLUS_MODEL_DIRS", raising=False)
        yield work, m.single_file_bases(work / "bases", families=("v1",))


def test_checkpoint_mutants_in_a_model_folder_end_in_matches_or_reasons(sf_bases: tuple[Any, list[Any]],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutated SD 1.x checkpoints (shapes, declared-empty tensors, dtypes, keys, floods of block keys, raw bytes:
    seeded, one input per number) in an app's folder, searched for BASE's UNet, VAE and text encoder: every
    search answers a match or a reason, a part found is viewed in place, nothing raises. The engine reaches the
    converters and the in-place load (it does not stop at the header checks)."""
    import mutations as m

    from dduf_plus.loading.in_place import MappedPartFiles

    work, bases = sf_bases
    loads, converted = [], []
    real_tensors, real_convert = MappedPartFiles.tensors, single_file_convert.convert_component
    monkeypatch.setattr(MappedPartFiles, "tensors", lambda self, f: loads.append(1) or real_tensors(self, f))
    monkeypatch.setattr(single_file_convert, "convert_component",
                        lambda *a: converted.append(1) or real_convert(*a))
    ckpt = work / "mutant.safetensors"
    findings = []
    for number in range(MUTANTS):
        inp = m.generate_single_file(bases, 0, number)
        ckpt.write_bytes(inp.data)
        o = m.run_target("sf-model-dirs", m.single_file_targets(ckpt, inp.base_path, work / "o")["sf-model-dirs"], 60)
        if o.bad:
            findings.append(f"input {number} ({inp.mutations}): {o.label}\n{o.detail}")
    assert not findings, "\n\n".join(findings[:3])
    assert len(loads) >= MUTANTS // 4 and len(converted) >= MUTANTS // 2, (len(loads), len(converted))


def test_the_model_folder_target_catches_a_raw_error(sf_bases: tuple[Any, list[Any]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine flags what 0.9.0 did on a file system that cannot map: a raw OSError out of the load."""
    import errno

    import mutations as m

    from dduf_plus.loading import in_place

    work, bases = sf_bases

    def no_map(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(in_place.MappedPartFiles, "_open", no_map)
    ckpt = work / "clean.safetensors"
    ckpt.write_bytes(m.write_checkpoint(m.SingleFileDraft({k: list(v) for k, v in bases[0].tensors.items()}, None)))
    o = m.run_target("sf-model-dirs", m.single_file_targets(ckpt, bases[0].base, work / "o")["sf-model-dirs"], 60)
    assert o.bad and o.label == "OSError", o
