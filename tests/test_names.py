"""Names a user gives are checked, never ignored (issue 19): a name that is not a component is an error that
names it, the closest component and the components, wherever it is given; exit 2 on the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dduf_plus.assignments import (
    DDUFNameError,
    LoadNameError,
    PackNameError,
    ReferenceNameError,
    check_names,
    closest,
)
from dduf_plus.errors import DDUFLoadError, DDUFPackError, DDUFReferenceError, DDUFUsageError

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"
COMPONENTS = ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]


# --- the helper ------------------------------------------------------------------------------------------
def test_one_unknown_name_says_the_closest_and_lists_the_components() -> None:
    with pytest.raises(DDUFNameError) as err:
        check_names(["vea"], COMPONENTS, what="--exclude", where="tiny-sd")
    assert str(err.value) == ("--exclude vea: not a component of tiny-sd (did you mean vae?); its components: "
                              "scheduler, text_encoder, tokenizer, unet, vae")
    assert err.value.names == ["vea"] and err.value.suggestions == {"vea": "vae"}
    assert isinstance(err.value, DDUFUsageError)  # the CLI exits 2, as for any bad argument


def test_several_unknown_names_each_with_its_suggestion_and_none_when_nothing_is_close() -> None:
    with pytest.raises(DDUFNameError, match=r"unte \(did you mean unet\?\), qqqqqq: not components"):
        check_names(["unet", "unte", "qqqqqq"], COMPONENTS, what="--dtype")
    assert closest("VAE", COMPONENTS) == "vae" and closest("text_encoder_2", COMPONENTS) == "text_encoder"
    assert closest("zzzz", COMPONENTS) is None


def test_known_names_and_wildcards_pass() -> None:
    check_names(["unet", "*", "default"], COMPONENTS, what="refs", wildcards=("*", "default"))
    with pytest.raises(DDUFNameError):
        check_names(["*"], COMPONENTS, what="refs")  # a wildcard only where the caller allows it


def test_each_api_keeps_its_error_class() -> None:
    for cls, base in ((PackNameError, DDUFPackError), (ReferenceNameError, DDUFReferenceError),
                      (LoadNameError, DDUFLoadError)):
        with pytest.raises(base) as err:
            check_names(["vea"], COMPONENTS, what="x", error=cls)
        assert isinstance(err.value, DDUFUsageError)


# --- pack ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, said", [
    ({"exclude": ["vea"]}, "--exclude vea: not a component"),
    ({"exclude": ["vae"], "refs": {"vea": str(TINY_SD)}}, "--ref vea: not a component"),
    ({"refs": {"vea": str(TINY_SD)}}, "--ref vea: not a component"),
    ({"dtype": {"unte": "bfloat16"}}, "--dtype unte: not a component"),
])
def test_pack_refuses_typos_and_writes_nothing(tmp_path: Path, kwargs: dict, said: str) -> None:
    from dduf_plus.packing import pack

    with pytest.raises(PackNameError, match=said + ".*did you mean"):
        pack(TINY_SD, tmp_path / "x.dduf", quiet=True, **kwargs)
    assert list(tmp_path.iterdir()) == []


# --- references: load, dduf refs, complete -------------------------------------------------------------------
@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dduf_plus.packing.partial import pack_partial

    out = tmp_path_factory.mktemp("names") / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=["vae"], refs={"*": str(TINY_SD)}, quiet=True)
    return out


def test_check_ref_names_refuses_typos_and_stored_components(partial: Path) -> None:
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.refs.resolve import check_ref_names

    with DDUFArchive(partial) as archive:
        components, references = archive.components, archive.references
    check_ref_names({"vae": "x", "*": "y"}, components, references)
    with pytest.raises(ReferenceNameError, match="vea: not a component .*did you mean vae"):
        check_ref_names({"vea": "x"}, components, references)
    with pytest.raises(ReferenceNameError, match="unet: not referenced .*referenced components: vae"):
        check_ref_names({"unet": "x"}, components, references)


def test_complete_refuses_a_ref_typo_instead_of_blaming_the_component(partial: Path, tmp_path: Path) -> None:
    from dduf_plus.packing.complete import complete_archive

    with pytest.raises(ReferenceNameError, match="--ref vea: not a component"):
        complete_archive(partial, tmp_path / "full.dduf", refs={"vea": "/nowhere"}, quiet=True)
    assert not (tmp_path / "full.dduf").exists()


def test_load_dduf_refuses_dtype_and_refs_typos(partial: Path) -> None:
    from dduf_plus import load_dduf

    with pytest.raises(LoadNameError, match=r"torch_dtype=\{\.\.\.\} key unte: not a component .*did you mean unet"):
        load_dduf(partial, torch_dtype={"unte": "float16"})
    with pytest.raises(LoadNameError, match=r"device_map=\{\.\.\.\} key unte: not a component .*did you mean unet"):
        load_dduf(partial, device_map={"unte": "cpu", "default": "cpu"})
    with pytest.raises(ReferenceNameError, match=r"refs=\{\.\.\.\} key vea: not a component .*did you mean vae"):
        load_dduf(partial, refs={"vea": str(TINY_SD)})
    with pytest.raises(ReferenceNameError, match="unet: not referenced"):
        load_dduf(partial, refs={"unet": str(TINY_SD)})


def test_load_dduf_accepts_real_names(partial: Path) -> None:
    import torch

    from dduf_plus import load_dduf

    pipe = load_dduf(partial, torch_dtype={"unet": "float32", "default": "auto"}, refs={"vae": str(TINY_SD)},
                     device_map={"unet": "cpu", "": "cpu"})
    assert pipe.unet.dtype == torch.float32 and pipe.vae is not None


def test_a_misspelt_component_keyword_is_refused_and_other_keywords_only_warned(partial: Path, caplog) -> None:
    from dduf_plus import load_dduf

    with pytest.raises(LoadNameError, match=r"load_dduf\(vea=\.\.\.\): vea is not a component of StableDiffusionPipeline \(did you mean vae=\?\); its "):
        load_dduf(partial, vea=None)
    with caplog.at_level("WARNING"):
        pipe = load_dduf(partial, use_safetensors=True)  # a from_pretrained keyword that changes nothing: quiet
    assert pipe.vae is not None and "use_safetensors" not in caplog.text
    with caplog.at_level("WARNING"):
        pipe = load_dduf(partial, mirror_of_nothing=1)  # a keyword no one knows: ignored, as diffusers does
    assert pipe.vae is not None and "mirror_of_nothing" in caplog.text


def test_save_dduf_refuses_a_dtype_typo(tmp_path: Path) -> None:
    from dduf_plus import load_dduf, save_dduf

    pipe = load_dduf(_packed_tiny_sd(tmp_path))
    with pytest.raises(PackNameError, match=r"save_dduf\(dtype=\{\.\.\.\}\) key unte: not a component .*did you mean unet"):
        save_dduf(pipe, tmp_path / "out.dduf", dtype={"unte": "float16"})
    assert not (tmp_path / "out.dduf").exists()


def _packed_tiny_sd(tmp_path: Path) -> Path:
    from dduf_plus.packing import pack

    pack(TINY_SD, tmp_path / "sd.dduf", quiet=True)
    return tmp_path / "sd.dduf"
