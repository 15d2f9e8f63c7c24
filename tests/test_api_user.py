"""The Python API as a diffusers user meets it: from a fresh interpreter, from a script, with the keywords
``DiffusionPipeline.from_pretrained`` takes, with wrong values, and with what a user does with the pipeline
afterwards. Each test here was a finding first (old behaviour in its docstring)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dduf_plus import load_dduf
from dduf_plus.errors import DDUFError, DDUFLoadError, DDUFReferenceError, DDUFUsageError
from dduf_plus.format.pack import pack_folder

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, offline, with no verbosity variables the test runner may carry."""
    environ = {k: v for k, v in os.environ.items() if k not in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY")}
    environ.update({"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "", **env})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=environ, cwd=ROOT)


# --- a first load prints nothing from other libraries --------------------------------------------------------
@pytest.mark.parametrize("quantize", [None, "sdnq-int8"])
def test_a_first_load_in_a_fresh_interpreter_prints_nothing(packed: dict[str, Path], tmp_path: Path,
                                                            quantize: str | None) -> None:
    """Was: torchao's two "Failed to load ..._C_*.so" lines, torch pytree's two Enum warnings and diffusers'
    "Unable to import `torchao` Tensor objects" on stderr (where torchao's compiled parts do not load); an
    SDNQ archive added "SDNQ: OpenVINO MM kernels are not available! ..." (where openvino is not installed);
    ``validate(..., load_check=True)`` printed the same five lines."""
    archive = packed["tiny-sd"]
    if quantize is not None:
        pytest.importorskip(quantize.split("-")[0])
        from dduf_plus.packing import pack

        archive = pack(TINY_SD, tmp_path / "q.dduf", quantize={"unet": quantize}, quiet=True)[0].path
    done = run_python(f"""
        from dduf_plus import load_dduf, validate
        assert validate({str(archive)!r}, load_check=True).valid  # imports diffusers first (was: the notices)
        pipe = load_dduf({str(archive)!r})
        assert type(pipe).__name__ == "StableDiffusionPipeline"
    """)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_the_users_logging_and_warnings_stay_as_they_were(packed: dict[str, Path]) -> None:
    """Only the import notices of loggers nobody configured are held back, and only during the imports: a
    level the user gave (here torchao's, DEBUG) still shows its records, the user's warnings filters and
    handlers are untouched, and the loggers dduf_plus held back are as they were afterwards."""
    done = run_python(f"""
        import json, logging, warnings
        warnings.simplefilter("error", DeprecationWarning)
        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.name)
        logging.getLogger("torchao").setLevel(logging.DEBUG)
        logging.getLogger("torchao").addHandler(Keep())
        filters = list(warnings.filters)
        from dduf_plus import load_dduf
        from dduf_plus.torchkit.quiet import IMPORT_NOTICES
        load_dduf({str(packed["tiny-sd"])!r})
        blanket = [f for f in warnings.filters if f[0] == "ignore" and f[1:4] == (None, Warning, None)]
        kept = all(f in warnings.filters for f in filters) and not blanket  # libraries add their own
        print(json.dumps({{"seen": seen, "filters_kept": kept,
                           "levels": {{n: logging.getLogger(n).level for n in IMPORT_NOTICES}}}}))
    """)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["filters_kept"]
    assert result["levels"] == {**{n: 0 for n in result["levels"]}, "torchao": logging.DEBUG}
    if importlib_has("torchao"):
        assert "torchao" in result["seen"]  # torchao logs its extensions at DEBUG: asked for, so shown


def importlib_has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_quiet_imports_drops_only_the_importing_threads_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one thread imports, another thread's records on the same loggers still show; errors always do;
    afterwards nothing of ours is left on the loggers (no filter, no level)."""
    from dduf_plus.torchkit.quiet import IMPORT_NOTICES, ImportNotices, quiet_imports, show_import_notices

    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):  # an in-process CLI run sets them
        monkeypatch.delenv(name, raising=False)
    logger = logging.getLogger("torchao")
    monkeypatch.setattr(logger, "level", logging.NOTSET)  # an in-process CLI run may have set it
    shown = show_import_notices(False)  # ... or asked for -v
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep(logging.DEBUG)
    logger.addHandler(keep)
    try:
        with quiet_imports():
            logger.warning("ours, dropped")
            logger.error("an error, shown")
            other = threading.Thread(target=logger.warning, args=("another thread's, shown",))
            other.start()
            other.join()
    finally:
        logger.removeHandler(keep)
        show_import_notices(shown)
    assert seen == ["an error, shown", "another thread's, shown"]
    assert not [f for n in IMPORT_NOTICES for f in logging.getLogger(n).filters if isinstance(f, ImportNotices)]


def test_a_lora_archive_loads_without_progress_bars(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Was: transformers' "Loading weights: 100%|...| 16/16" bar on stderr when the adapter reached the text
    encoder (diffusers' load_lora_weights through transformers)."""
    from lora_files import diffusers_lora, fp32_copy

    from dduf_plus.packing.lora import pack_lora

    base = fp32_copy(TINY_SD, tmp_path / "sd")
    style = diffusers_lora(base, tmp_path / "style", {"unet": ["to_q", "to_v"], "text_encoder": ["q_proj"]})
    pack_lora([f"style={style}@0.7"], tmp_path / "one.dduf", base=str(base), quiet=True)
    capfd.readouterr()
    pipe = load_dduf(tmp_path / "one.dduf")
    assert pipe.get_active_adapters() == ["style"]
    out, err = capfd.readouterr()
    assert "Loading weights" not in err and (out, err) == ("", "")


# --- a variant the archive lacks -------------------------------------------------------------------------------
def test_a_missing_variant_fails_first_naming_the_archives_variants(tmp_path: Path) -> None:
    """Was: diffusers, transformers and torchao imported (their notices printed) before the error, which
    said "(variants present: none)". Now it fails before diffusers is imported, from the listing alone."""
    plain = pack_folder(TINY_SD, tmp_path / "plain.dduf", quiet=True).path
    fp16 = pack_folder(TINY_SD, tmp_path / "fp16.dduf", variant="fp16", quiet=True).path
    done = run_python(f"""
        import logging, sys
        logging.basicConfig(level=logging.DEBUG)
        from dduf_plus import load_dduf, DDUFLoadError
        for path in ({str(plain)!r}, {str(fp16)!r}):
            try:
                load_dduf(path, variant="fp17")
            except DDUFLoadError as e:
                print(e)
        print("diffusers imported:", "diffusers" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr
    first, second, imported = done.stdout.splitlines()
    assert "variant 'fp17'" in first and "no variant weights" in first and "without variant=" in first
    assert "variant 'fp17'" in second and "it holds variant fp16" in second
    assert imported == "diffusers imported: False"
    assert not [line for line in done.stderr.splitlines() if not line.startswith("DEBUG:dduf_plus")]


# --- offline, a reference the cache lacks ----------------------------------------------------------------------
def test_offline_reference_says_offline_mode_and_how_to_allow_it(tmp_path: Path, hf_env: Path) -> None:
    """Was: "not downloaded: HF_HUB_OFFLINE is set" and a fix naming the archive's recorded repo
    (hf download org/tiny-sd) though refs= pointed elsewhere."""
    from dduf_plus.packing.partial import pack_partial

    partial = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, partial, exclude=["vae"], refs={"*": "org/tiny-sd"}, quiet=True)
    with pytest.raises(DDUFReferenceError) as err:
        load_dduf(partial, refs={"vae": "nope/nope"})
    message = str(err.value)
    assert "'vae'" in message and "nope/nope" in message
    assert "offline mode" in message and "HF_HUB_OFFLINE=0" in message
    assert "hf download nope/nope" in message and "hf download org/tiny-sd" not in message
    with pytest.raises(DDUFReferenceError, match=r"local_files_only=False lets it download"):
        load_dduf(partial, local_files_only=True)


def test_offline_hub_repo_path_says_which_setting_and_how_to_allow_it(hf_env: Path) -> None:
    """Was: "... not in the Hugging Face cache and offline (HF_HUB_OFFLINE or local_files_only): download it
    once online": which of the two, and how to turn it off, left to guess."""
    from dduf_plus.errors import DDUFNotFoundError

    with pytest.raises(DDUFNotFoundError, match=r"nope/nope .*offline mode: HF_HUB_OFFLINE is set \(unset it, or "
                                                r"HF_HUB_OFFLINE=0, to let it download\)"):
        load_dduf("nope/nope")
    with pytest.raises(DDUFNotFoundError, match=r"x\.dduf of the Hub repo nope/nope .*HF_HUB_OFFLINE=0"):
        load_dduf("nope/nope", dduf_file="x.dduf")
    with pytest.raises(DDUFNotFoundError, match=r"offline: local_files_only=True \(local_files_only=False lets"):
        load_dduf("nope/nope", local_files_only=True)


# --- wrong kinds of values: a DDUFError naming the argument -----------------------------------------------------
WRONG: list[tuple[dict[str, Any], str]] = [
    ({"torch_dtype": "float17"}, r"torch_dtype='float17' is not a floating torch dtype"),
    ({"dtype": {"unet": "float17"}}, r"dtype\['unet'\]='float17'"),
    ({"torch_dtype": torch.int8}, r"torch_dtype=torch.int8\): not a floating dtype"),
    ({"device_map": [1]}, r"device_map=\[1\] is not a torch device"),
    ({"device": "bogus"}, r"device='bogus' is not a torch device"),
    ({"adapters": [1]}, r"adapters=\[1\]\): expected None, True, False, an adapter name or a list of names"),
    ({"adapter_weights": [1]}, r"adapter_weights=\[1\]\): expected a dict"),
    ({"adapter_weights": {"pixel": "high"}}, r"adapter_weights="),
    ({"fuse_lora": "yes"}, r"fuse_lora='yes'\): expected True or False"),
    ({"verify": "no"}, r"verify='no'\): expected True or False"),
    ({"use_mmap": None}, r"use_mmap=None\)"),
    ({"prefetch": 1}, r"prefetch=1\)"),
    ({"allow_missing_weights": 2}, r"allow_missing_weights=2\)"),
    ({"local_files_only": "x"}, r"local_files_only='x'\)"),
    ({"variant": 16}, r"variant=16\): expected a variant name"),
    ({"refs": 5}, r"refs=5\)"),
    ({"refs": "org/repo"}, r"refs='org/repo'\)"),
    ({"token": 5}, r"token=5\)"),
    ({"revision": 5}, r"revision=5\)"),
    ({"cache_dir": 5}, r"cache_dir=5\)"),
    ({"model_dirs": 5}, r"model_dirs=5\)"),
    ({"model_dirs": [5]}, r"model_dirs=\[5\]\)"),
    ({"remote": 5}, r"remote=5\)"),
    ({"max_decompressed": "x"}, r"max_decompressed='x'"),
    ({"max_decompressed": 1.5}, r"max_decompressed=1.5\)"),
    ({"dduf_file": 5}, r"dduf_file=5\)"),
]


@pytest.mark.parametrize(("kwargs", "match"), WRONG, ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                                                          for k, _ in WRONG])
def test_wrong_kinds_of_values_are_ddufErrors_naming_the_argument(packed: dict[str, Path], kwargs: dict[str, Any],
                                                                  match: str) -> None:
    """Was: raw TypeErrors (adapter_weights=[1], refs=5), silently accepted values (verify="no" verified,
    token=5, cache_dir=5, model_dirs=5, remote=5 and max_decompressed="x" ignored for a local archive), or
    a message about fp8 storage at the first component (torch_dtype=torch.int8)."""
    with pytest.raises(DDUFError, match=match):
        load_dduf(packed["tiny-sd"], **kwargs)


@pytest.mark.parametrize("path", [123, None, 1.5])
def test_a_path_that_is_no_path_is_a_usage_error(path: Any) -> None:
    """Was: ``TypeError: expected str, bytes or os.PathLike object, not int``."""
    with pytest.raises(DDUFUsageError, match=r"^load_dduf\(path=\.\.\.\): expected a path \(str or os.PathLike\), got "
                                             r"(int|NoneType|float)"):
        load_dduf(path)


def test_a_bytes_path_loads_as_its_str(packed: dict[str, Path]) -> None:
    """Was: ``TypeError: endswith first arg must be bytes`` (os.fspath keeps bytes)."""
    assert type(load_dduf(os.fsencode(packed["tiny-sd"]))).__name__ == "StableDiffusionPipeline"


def test_the_other_exports_refuse_a_path_that_is_no_path(packed: dict[str, Path], tmp_path: Path) -> None:
    """Was: ``AttributeError: 'int' object has no attribute 'name'`` (validate, DDUFArchive, read_dduf_file),
    ``TypeError: expected str, bytes or os.PathLike object`` (inspect_dtypes, pack, pack_folder, save_dduf's
    path) and ``AttributeError: 'int' object has no attribute 'to_json_string'`` (save_dduf(5, ...))."""
    import dduf_plus

    out = tmp_path / "out.dduf"
    calls = {
        r"^validate\(source=\.\.\.\): expected a path": lambda: dduf_plus.validate(5),
        r"^DDUFArchive\(path=\.\.\.\): expected a path": lambda: dduf_plus.DDUFArchive(5),
        r"^DDUFArchive\(path=\.\.\.\): expected a path.*got NoneType": lambda: dduf_plus.read_dduf_file(None),
        r"^inspect_dtypes\(source=\.\.\.\): expected a path": lambda: dduf_plus.inspect_dtypes(5),
        r"^pack_folder\(folder=\.\.\.\): expected a path": lambda: dduf_plus.pack_folder(5, out),
        r"^pack\(output=\.\.\.\): expected a path": lambda: dduf_plus.pack(TINY_SD, 5),
        r"^save_dduf\(pipeline=\.\.\.\): expected a diffusers DiffusionPipeline, got int": lambda: dduf_plus.save_dduf(5, out),
        r"^save_dduf\(path=\.\.\.\): expected a path": lambda: dduf_plus.save_dduf(object(), 5),
    }
    for match, call in calls.items():
        with pytest.raises(DDUFUsageError, match=match):
            call()
    assert dduf_plus.validate(os.fsencode(packed["tiny-sd"])).valid  # bytes, as open() takes them
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for a torch without CUDA")
def test_an_int_device_map_names_the_argument(packed: dict[str, Path]) -> None:
    with pytest.raises(DDUFLoadError, match=r"^device_map=5: CUDA is not available"):
        load_dduf(packed["tiny-sd"], device_map=5)


# --- DiffusionPipeline.from_pretrained's own keywords --------------------------------------------------------
REFUSED: list[tuple[str, Any, str]] = [
    ("force_download", True, "checked by their content"),
    ("custom_pipeline", "my_pipeline", "never runs code"),
    ("custom_revision", "main", "custom pipelines"),
    ("trust_remote_code", True, "never runs code"),
    ("quantization_config", object(), "dduf pack --quantize"),
    ("max_memory", {0: "1GB"}, "device_map="),
    ("offload_folder", "/tmp/offload", "memory map"),
    ("offload_state_dict", True, "memory map"),
    ("use_safetensors", False, "only .safetensors"),
    ("proxies", {"https": "http://proxy"}, "HTTPS_PROXY"),
    ("provider", "CPUExecutionProvider", "ONNX"),
    ("use_onnx", True, "ONNX"),
    ("load_connected_pipeline", True, "connected pipelines"),
    ("use_flashpack", True, "FlashPack"),
]


@pytest.mark.parametrize(("name", "value", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_from_pretrained_options_load_dduf_cannot_honour_are_refused(packed: dict[str, Path], name: str,
                                                                      value: Any, why: str) -> None:
    """Was: "keyword arguments [...] are not expected by StableDiffusionPipeline and are ignored" (a warning
    the user may never see): a quantization_config or a custom pipeline silently not applied."""
    with pytest.raises(DDUFUsageError, match=rf"^load_dduf\({name}=.*\) is not supported: .*{why}"):
        load_dduf(packed["tiny-sd"], **{name: value})


def test_from_pretrained_options_that_change_nothing_are_taken_quietly(packed: dict[str, Path],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The values a ported script passes that mean what load_dduf does anyway: no warning, same pipeline."""
    with caplog.at_level(logging.WARNING):
        pipe = load_dduf(packed["tiny-sd"], use_safetensors=True, low_cpu_mem_usage=False, force_download=False,
                         trust_remote_code=False, proxies=None, quantization_config=None, local_files_only=None)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert not [r for r in caplog.records if "not expected" in r.getMessage()]
    with pytest.raises(DDUFUsageError, match=r"low_cpu_mem_usage='no'\): expected True or False"):
        load_dduf(packed["tiny-sd"], low_cpu_mem_usage="no")


def test_disable_mmap_is_use_mmap_false(packed: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: warned about and ignored: the archive was mapped anyway (a network file system user's reason to
    pass it)."""
    import mmap

    def no_map(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("disable_mmap=True mapped the archive")

    monkeypatch.setattr(mmap, "mmap", no_map)
    pipe = load_dduf(packed["tiny-sd"], disable_mmap=True)
    monkeypatch.undo()
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    with pytest.raises(DDUFUsageError, match=r"disable_mmap=False, use_mmap=False\) disagree"):
        load_dduf(packed["tiny-sd"], disable_mmap=False, use_mmap=False)
    with pytest.raises(DDUFUsageError, match=r"disable_mmap='yes'\): expected True or False"):
        load_dduf(packed["tiny-sd"], disable_mmap="yes")


# --- components passed by the caller, as from_pretrained takes them --------------------------------------------
def test_passed_components_are_used_or_refused_like_diffusers(packed: dict[str, Path]) -> None:
    """Was: ``unet=5`` failed inside the pipeline's __init__ ("cannot create StableDiffusionPipeline:
    AttributeError: 'int' object has no attribute 'config'"); diffusers refuses it naming the kind expected."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(steps_offset=1, clip_sample=False)
    pipe = load_dduf(packed["tiny-sd"], scheduler=scheduler, safety_checker=None, requires_safety_checker=False)
    assert pipe.scheduler is scheduler and pipe.safety_checker is None
    with pytest.raises(DDUFUsageError, match=r"load_dduf\(unet=\.\.\.\): got int, but unet is a "
                                             r"UNet2DConditionModel \(diffusers\): pass a ModelMixin or None"):
        load_dduf(packed["tiny-sd"], unet=5)
    with pytest.raises(DDUFUsageError, match=r"got DDIMScheduler, but vae is a AutoencoderKL"):
        load_dduf(packed["tiny-sd"], vae=scheduler)
    with pytest.raises(DDUFUsageError, match=r"got UNet2DConditionModel, but text_encoder is a CLIPTextModel "
                                             r"\(transformers\): pass a PreTrainedModel"):
        load_dduf(packed["tiny-sd"], text_encoder=pipe.unet)


# --- what a diffusers user does with the pipeline afterwards --------------------------------------------------
def test_a_loaded_pipeline_round_trips_through_diffusers(packed: dict[str, Path], tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    pipe = load_dduf(packed["tiny-sd"], torch_dtype=torch.float32)
    assert pipe.to("cpu") is pipe
    assert set(pipe.components) == {"unet", "vae", "text_encoder", "tokenizer", "scheduler", "safety_checker",
                                    "feature_extractor", "image_encoder"}
    assert pipe.config["_name_or_path"] == str(packed["tiny-sd"])
    pipe.save_pretrained(tmp_path / "saved")
    again = DiffusionPipeline.from_pretrained(tmp_path / "saved")
    for name in ("unet", "vae", "text_encoder"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(again, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    second = load_dduf(packed["tiny-sd"], torch_dtype=torch.float32)  # the same file again, same process
    assert second.unet is not pipe.unet and torch.equal(next(second.unet.parameters()),
                                                        next(pipe.unet.parameters()))


def test_loading_inside_inference_mode_and_threads(packed: dict[str, Path]) -> None:
    with torch.inference_mode():
        pipe = load_dduf(packed["tiny-sd"])
    out = pipe("a cat", num_inference_steps=1, height=32, width=32, output_type="np",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 32, 32, 3)
    results: dict[str, Any] = {}

    def load(name: str) -> None:
        try:
            results[name] = type(load_dduf(packed[name])).__name__
        except Exception as e:  # reported below
            results[name] = e

    threads = [threading.Thread(target=load, args=(n,)) for n in ("tiny-sd", "tiny-dit")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"tiny-sd": "StableDiffusionPipeline", "tiny-dit": "PixArtAlphaPipeline"}


# --- a user's mypy ---------------------------------------------------------------------------------------------
USER_SCRIPT = """
    from pathlib import Path

    import torch

    from dduf_plus import DDUFError, inspect_dtypes, load_dduf, save_dduf, validate

    try:
        pipe = load_dduf(Path("tiny-sd.dduf"), torch_dtype=torch.float16, device="cpu", variant=None,
                         local_files_only=None, adapter_weights={"pixel": 0.7}, scheduler=None)
    except DDUFError as e:
        raise SystemExit(str(e)) from e
    pipe = load_dduf("tiny-sd.dduf", dtype="auto", device_map={"unet": "cpu"}, use_mmap=False)
    pipe.to("cpu")
    again = load_dduf(b"tiny-sd.dduf", unet=pipe.components["unet"], disable_mmap=True)
    print(pipe.components, pipe.config, again.components)
    save_dduf(pipe, "out.dduf")
    print(validate("tiny-sd.dduf"), inspect_dtypes("tiny-sd.dduf"))
"""


def test_a_users_script_type_checks(tmp_path: Path) -> None:
    """py.typed: a user's mypy reads load_dduf's hints (local_files_only=None, diffusers' default, and a
    bytes path were errors). dduf_plus is found through MYPYPATH with its own modules' errors ignored, as an
    installed package's are. (Calling a pipeline, ``pipe("a cat")``, is a mypy error with diffusers' own
    ``from_pretrained`` too: diffusers' ``__call__`` decorators hide it from mypy.)"""
    if shutil.which("mypy") is None and not importlib_has("mypy"):
        pytest.skip("mypy is not installed")
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_SCRIPT))
    (tmp_path / "mypy.ini").write_text("[mypy]\n[mypy-dduf_plus.*]\nignore_errors = True\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
                           "--cache-dir", str(tmp_path / "cache"), str(tmp_path / "user.py")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "MYPYPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr


def test_sdnq_notices_are_held_back_on_the_logger_sdnq_is_told_to_use() -> None:
    """SDNQ logs on the logger SDNQ_LOGGER_NAME names (sdnq/common.py): the quieted list follows it."""
    code = ("import os; os.environ['SDNQ_LOGGER_NAME'] = 'my.sdnq'; "
            "from dduf_plus.torchkit.quiet import IMPORT_NOTICES; print(IMPORT_NOTICES[-1])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "my.sdnq"


def test_a_dtype_that_cannot_apply_fails_before_the_source_is_opened(tmp_path: Path) -> None:
    """Was checked after the archive was opened: a missing file said "not found", a URL was connected to first."""
    with pytest.raises(DDUFLoadError, match=r"torch_dtype='int8' is not a floating torch dtype"):
        load_dduf(tmp_path / "missing.dduf", torch_dtype="int8")
    with pytest.raises(DDUFLoadError, match=r"dtype\['unet'\]='bool'"):
        load_dduf("http://127.0.0.1:9/never-connected.dduf", dtype={"unet": "bool"})


def test_messages_about_huge_arguments_are_built_in_bounded_memory() -> None:
    """Was ``repr`` of the whole value, then cut: a 10**7-item list built a 50 MB string for a one-line message."""
    import tracemalloc

    huge = list(range(10**7))
    tracemalloc.start()
    try:
        with pytest.raises(DDUFUsageError, match=r"expected a path .*got list \[0, 1, 2, 3, 4, 5, \.\.\.\]"):
            load_dduf(huge)  # type: ignore[arg-type]
        with pytest.raises(DDUFUsageError, match=r"fuse_lora=\[0, 1, 2, 3, 4, 5, \.\.\.\]\): expected True or False"):
            load_dduf("x.dduf", fuse_lora=huge)  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
