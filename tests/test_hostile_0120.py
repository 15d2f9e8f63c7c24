"""0.12.0's new code and the quantized loaders as hostile input.

* ``load_dduf``'s argument checks (:mod:`dduf_plus.loading.arguments`): a generator passed as ``adapters=`` or
  ``model_dirs=`` was used up by the check itself (the load then applied no adapter / searched no folder), an
  endless one never ended it; ``adapter_weights`` took NaN and infinity; a path holding a NUL character was a
  bare ``ValueError`` from ``open``.
* torchao ``Float8Tensor`` weights were not fitted to their parts: int8 bytes stored as ``qdata``, a scale of
  one row, a ``block_size`` that does not tile ``qdata`` validated and loaded, and computed another model.
* a bitsandbytes 4-bit quant state whose ``quant_type`` contradicts its tensor name and the config (``fp4``
  under ``bitsandbytes__nf4``) validated and loaded, dequantized with the other code book.
* pins: :func:`dduf_plus.torchkit.quiet.quiet_imports` (exceptions, re-entrancy, threads, the user's filters),
  :mod:`dduf_plus.storage.fd_io` (no progress is an error, short copies finished), and the checks of SDNQ
  configs and torchao descriptions the brief names.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dduf_plus import load_dduf
from dduf_plus.errors import DDUFError, DDUFUsageError
from dduf_plus.format import quant_bnb, quant_rules
from dduf_plus.format.quant_sdnq import check_sdnq_config
from dduf_plus.format.quant_torchao import torchao_descriptions
from dduf_plus.format.quantization import QuantError
from dduf_plus.format.safetensors_header import SafetensorsHeader, TensorInfo
from dduf_plus.loading import arguments
from dduf_plus.storage import fd_io
from dduf_plus.torchkit import quiet


# --- load_dduf's arguments -----------------------------------------------------------------------------------
def test_a_generator_of_adapter_names_is_read_once_and_kept() -> None:
    """Found on 0.12.0: ``list(adapters)`` in the check used the generator up; the load got an empty one."""
    names = (n for n in ("style", "ink"))
    assert arguments.check_adapters(names, None) == ["style", "ink"]
    assert arguments.check_adapters("ink", None) == "ink"
    assert arguments.check_adapters(None, None) is None and arguments.check_adapters(False, None) is False


def test_a_generator_of_model_dirs_is_read_once_and_kept(tmp_path: Path) -> None:
    """Found on 0.12.0: the check's ``all(...)`` used the generator up; no folder was searched."""
    dirs = (p for p in (tmp_path, str(tmp_path)))
    assert arguments.check_sources(refs=None, model_dirs=dirs, remote=None, max_decompressed=None) == \
        [tmp_path, str(tmp_path)]
    assert arguments.check_sources(refs=None, model_dirs=str(tmp_path), remote=None, max_decompressed=None) == \
        str(tmp_path)


def test_load_dduf_gets_the_listed_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """load_dduf passes on what the checks return (the names, the folders), not the used-up generators."""
    from dduf_plus.loading import pipeline

    seen: dict[str, Any] = {}

    def stop(path: str, *args: Any, **kwargs: Any) -> Any:
        raise DDUFUsageError("stopped")

    real_sources, real_adapters = arguments.check_sources, arguments.check_adapters
    monkeypatch.setattr(pipeline, "check_sources", lambda **kw: seen.setdefault("dirs", real_sources(**kw)))
    monkeypatch.setattr(pipeline, "check_adapters", lambda a, w: seen.setdefault("adapters", real_adapters(a, w)))
    monkeypatch.setattr(pipeline, "_open_source", stop)
    with pytest.raises(DDUFUsageError, match="stopped"):
        load_dduf(tmp_path / "x.dduf", adapters=(n for n in ["a"]), model_dirs=(d for d in [tmp_path]))
    assert seen == {"dirs": [tmp_path], "adapters": ["a"]}


@pytest.mark.parametrize("argument", ["adapters", "model_dirs"])
def test_an_endless_iterable_argument_is_refused_after_a_bounded_count(argument: str) -> None:
    """Found on 0.12.0: ``itertools.repeat("a")`` never ended the check (now: at MAX_ARGUMENT_ITEMS + 1 items)."""
    endless = itertools.repeat("a")
    with pytest.raises(DDUFUsageError, match=f"{argument}=.*more than {arguments.MAX_ARGUMENT_ITEMS} items"):
        if argument == "adapters":
            arguments.check_adapters(endless, None)
        else:
            arguments.check_sources(refs=None, model_dirs=endless, remote=None, max_decompressed=None)
    assert next(endless) == "a"  # bounded: the check stopped after a count


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf, 1e300, 10 ** 400],
                         ids=["nan", "inf", "-inf", "1e300", "10**400"])
def test_a_non_finite_or_huge_adapter_weight_is_refused(weight: float) -> None:
    """Found on 0.12.0: NaN or inf was taken and fused into every adapted weight (an archive's own adapter
    weight is refused over 1e4 or non-finite: rule A001; the caller's now the same)."""
    with pytest.raises(DDUFUsageError, match="adapter_weights=.*finite weight"):
        arguments.check_adapters(None, {"style": weight})


def test_numpy_adapter_weights_non_finite_refused_finite_taken() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(DDUFUsageError, match="finite weight"):
        arguments.check_adapters(None, {"style": np.float32("inf")})
    arguments.check_adapters(None, {"style": np.float32(0.5), "ink": -2, "x": 1e4})


@pytest.mark.parametrize("path", ["a\x00b.dduf", b"a\x00b.dduf"])
def test_a_path_with_a_nul_is_a_usage_error(path: str | bytes, tmp_path: Path) -> None:
    """Found on 0.12.0: ``load_dduf`` / ``validate`` raised ``ValueError: embedded null byte`` from ``open``."""
    from dduf_plus import validate

    with pytest.raises(DDUFUsageError, match="NUL character"):
        load_dduf(path)
    for source in (path, tmp_path / "a\x00b.dduf"):
        with pytest.raises(DDUFError, match="NUL character"):
            validate(source)
    with pytest.raises(OSError, match="NUL character"):
        fd_io.open_regular(tmp_path / "a\x00b")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"force_download": 0}, "force_download=0"),  # 0 is not False: refused, not taken as "no"
    ({"trust_remote_code": "False"}, "trust_remote_code='False'"),
    ({"low_cpu_mem_usage": "yes"}, "low_cpu_mem_usage='yes'"),
    ({"disable_mmap": 1}, "disable_mmap=1"),
])
def test_from_pretrained_options_of_the_wrong_kind_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Pin: values equal to an allowed one but of another type (0, "False") are refused by identity."""
    with pytest.raises(DDUFUsageError, match=match):
        arguments.from_pretrained_options(dict(kwargs), True)


def test_flags_take_numpy_bools_and_refuse_bool_like_others() -> None:
    np = pytest.importorskip("numpy")
    arguments.check_flags(verify=np.bool_(False), use_mmap=True)
    for value in (0, 1, "no", None, np.int8(0)):
        with pytest.raises(DDUFUsageError, match="verify="):
            arguments.check_flags(verify=value)


def test_dtype_arguments_refuse_non_floating_torch_dtypes() -> None:
    torch = pytest.importorskip("torch")
    arguments.check_dtype_kind(torch.bfloat16, {"unet": torch.float16})
    for bad in (torch.int8, torch.complex64, torch.bool):
        with pytest.raises(DDUFUsageError, match="not a floating dtype"):
            arguments.check_dtype_kind(bad, None)
        with pytest.raises(DDUFUsageError, match="dtype=\\{'vae': ...\\}"):
            arguments.check_dtype_kind(None, {"vae": bad})


# --- quiet_imports -----------------------------------------------------------------------------------------
NOTICE = quiet.IMPORT_NOTICES[2]  # "torchao"


class Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def seen() -> Iterator[Seen]:
    log = logging.getLogger(NOTICE)
    handler, level = Seen(), log.level
    log.addHandler(handler)
    log.setLevel(logging.NOTSET)  # as the library leaves it: quiet_imports applies
    shown = quiet.show_import_notices(False)  # an in-process `dduf -v` run earlier in the session set it
    try:
        yield handler
    finally:
        quiet.show_import_notices(shown)
        log.removeHandler(handler)
        log.setLevel(level)


def test_quiet_imports_leaves_nothing_after_an_exception(seen: Seen) -> None:
    log = logging.getLogger(NOTICE)
    before = list(log.filters)
    with pytest.raises(RuntimeError), quiet.quiet_imports():
        log.warning("held back")
        raise RuntimeError("inside")
    assert log.filters == before
    log.warning("shown after")
    assert seen.messages == ["shown after"]


def test_quiet_imports_nested_and_the_users_filters_stay(seen: Seen) -> None:
    log = logging.getLogger(NOTICE)
    mine = logging.Filter("nothing.matches")  # the user's own filter: drops every record of this logger
    log.addFilter(mine)
    before = list(log.filters)
    try:
        with quiet.quiet_imports():
            with quiet.quiet_imports():
                log.error("an error passes ours")
            log.warning("still held back after the inner block")
        assert log.filters == before
    finally:
        log.removeFilter(mine)
    assert seen.messages == []  # the user's filter dropped even the error: ours never let a record past it
    with quiet.quiet_imports():
        log.error("an error")
        log.info("held back")
    assert seen.messages == ["an error"]


def test_quiet_imports_holds_back_only_its_own_threads_records(seen: Seen) -> None:
    log = logging.getLogger(NOTICE)
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(5)
        log.warning("other thread")
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with quiet.quiet_imports():
        log.warning("this thread")
        inside.set()
        done.wait(5)
    thread.join(5)
    assert seen.messages == ["other thread"]


def test_quiet_imports_many_threads_leave_no_filter(seen: Seen) -> None:
    """Pin: 8 threads entering and leaving 200 times each leave the loggers' filters as they were."""
    before = {n: list(logging.getLogger(n).filters) for n in quiet.IMPORT_NOTICES}

    def work() -> None:
        for _ in range(200):
            with quiet.quiet_imports():
                pass

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {n: list(logging.getLogger(n).filters) for n in quiet.IMPORT_NOTICES} == before


# --- fd_io ---------------------------------------------------------------------------------------------------
def test_writes_that_make_no_progress_are_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pin: a file system whose write / pwrite returns 0 is an error, not a loop for ever."""
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setattr(os, "write", lambda fd, data: 0)
        monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
        with pytest.raises(DDUFError, match="wrote nothing"):
            fd_io.write_all(fd, b"abc")
        with pytest.raises(DDUFError, match="wrote nothing"):
            fd_io.pwrite_all(fd, b"abc", 5)
    finally:
        os.close(fd)


def test_copy_range_finishes_a_kernel_copy_that_stops_part_way(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Pin: copy_file_range copying 3 bytes and then failing: the rest goes through a buffer."""
    (tmp_path / "src").write_bytes(bytes(range(256)) * 40)
    src, dst = os.open(tmp_path / "src", os.O_RDONLY), os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    calls = []

    def stingy(s: int, d: int, count: int, offset_src: int, offset_dst: int | None) -> int:
        calls.append(count)
        if len(calls) > 1:
            raise OSError(18, "EXDEV")
        return os.pwrite(d, os.pread(s, 3, offset_src), offset_dst or 0)

    monkeypatch.setattr(os, "copy_file_range", stingy, raising=False)
    try:
        fd_io.copy_range(src, dst, 100, 10_000)
        assert os.pread(dst, 9_900, 100) == (bytes(range(256)) * 40)[100:10_000]
        assert fd_io.kernel_copy(src, dst, -5, 0) == 0  # nothing asked, nothing copied
    finally:
        os.close(src)
        os.close(dst)


def test_open_regular_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    os.mkfifo(tmp_path / "fifo")
    assert fd_io.open_regular(tmp_path / "fifo") is None
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "file", tmp_path / "link")
    with pytest.raises(OSError):
        fd_io.open_regular(tmp_path / "link", follow_links=False)


# --- quantization states, torch-free (what validate and the loader check first) ------------------------------
def _header(metadata: dict[str, str] | None = None, **tensors: tuple[str, tuple[int, ...], int]) -> SafetensorsHeader:
    infos, at = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        infos[name.replace("__", ".")] = TensorInfo(name.replace("__", "."), dtype, shape, at, at + nbytes)
        at += nbytes
    return SafetensorsHeader(100, infos, metadata)


def _torchao(kind: str, qdata: str = "float8_e4m3fn", block: list[int] | None = None,
             scale: tuple[int, ...] = (32, 1), scheme: str = "Float8WeightOnlyConfig",
             zero_point: tuple[str, tuple[int, ...]] | None = None, **data: Any) -> list[Any]:
    """A one-layer torchao component (``l.weight`` [32, 32]) as diffusers saves it: its config, its header."""
    import json

    description: dict[str, Any] = {"_type": kind, "_data": {"block_size": block or [1, 32], "dtype": {
        "_type": "torch.dtype", "_data": "bfloat16"}}, "_tensor_data_names": ["qdata", "scale"]}
    description["_data"].update(data)
    parts = {"l___weight_qdata": (qdata, (32, 32), 1024), "l___weight_scale": ("float32", scale, 4 * 32)}
    if zero_point is not None:  # IntxUnpackedToInt8Tensor (IntxWeightOnlyConfig) as torchao 0.18 describes it
        description["_data"]["target_dtype"] = {"_type": "torch.dtype", "_data": "int4"}
        description["_tensor_data_names"].append("zero_point")
        parts["l___weight_zero_point"] = (*zero_point, 64)
    metadata = {"tensor_names": json.dumps(["l.weight", "l.bias"]), "l.weight": json.dumps(description),
                "l.bias": json.dumps({"_type": "Tensor"})}
    header = _header(metadata, **parts, l__bias=("bfloat16", (32,), 64))
    config = {"quantization_config": {"quant_method": "torchao", "quant_type": {"default": {"_type": scheme}}}}
    return [config, header]


def _codes(config: dict[str, Any], header: SafetensorsHeader) -> list[str]:
    return [f.code for f in quant_rules.findings_for("unet", config, [header])]


def test_torchao_float8_control_is_consistent() -> None:
    config, header = _torchao("Float8Tensor")
    assert _codes(config, header) == []
    record = quant_rules.analyse(config, [header])
    assert record is not None and record["tensor_types"] == ["Float8Tensor"] and record["quantized"] == 1


@pytest.mark.parametrize(("change", "code"), [
    ({"qdata": "int8"}, "Q003"),  # int8 bytes read as float8 values: loaded and ran as another model
    ({"scale": (1, 1)}, "Q007"),  # one scale broadcast over every output row
    ({"block": [1, 7]}, "Q007"),  # does not tile qdata
    ({"block": [1, 16]}, "Q007"),  # per-group over a per-row scale
    ({"scheme": "Int8WeightOnlyConfig"}, "Q004"),
])
def test_torchao_float8_parts_that_do_not_fit_are_refused(change: dict[str, Any], code: str) -> None:
    """Found on 0.12.0 (all but the scheme, which Int8Tensor had): only Int8Tensor's parts were fitted."""
    config, header = _torchao("Float8Tensor", **change)
    assert _codes(config, header) == [code]


def test_a_float8_scheme_storing_int8_tensors_is_refused() -> None:
    """Found on 0.12.0: a float8 scheme's config over Int8Tensor weights (only int8 schemes were matched)."""
    config, header = _torchao("Int8Tensor", qdata="int8", scheme="Float8DynamicActivationFloat8WeightConfig")
    assert _codes(config, header) == ["Q004"]
    config, header = _torchao("Int8Tensor", qdata="int8", scheme="Int8DynamicActivationInt8WeightConfig")
    assert _codes(config, header) == []


def test_a_per_tensor_float8_scale_of_one_value_fits() -> None:
    config, header = _torchao("Float8Tensor", block=[32, 32], scale=(1, 1))
    assert _codes(config, header) == []


ROWS = {"_type": "QuantizeTensorToFloat8Kwargs", "_data": {"granularity": {"_type": "PerRow", "_data": {"dim": -1}}}}


@pytest.mark.parametrize(("data", "scheme", "code"), [
    ({"dtype": {"_type": "torch.dtype", "_data": "int8"}}, "Float8WeightOnlyConfig", "Q005"),  # raw RuntimeError
    ({"act_quant_kwargs": ROWS}, "Float8WeightOnlyConfig", "Q004"),  # weight only, yet quantizes its inputs
    ({"act_quant_kwargs": {"_type": "QuantizeTensorToFloat8Kwargs", "_data": {"granularity": {
        "_type": "PerRow", "_data": {"dim": "x"}}}}}, "Float8DynamicActivationFloat8WeightConfig", "Q005"),
    ({"act_quant_kwargs": ROWS}, "Float8DynamicActivationFloat8WeightConfig", None),  # as torchao saves it
])
def test_torchao_description_fields_torchao_computes_with(data: dict[str, Any], scheme: str, code: str | None) -> None:
    """Found on 0.12.0: a Float8Tensor whose ``dtype`` is int8 validated and failed in load_state_dict (a bare
    RuntimeError from the component loader); a weight-only scheme's weights carrying activation quantization,
    or ``PerRow(dim="x")``, validated and loaded, and the first forward raised a bare TypeError."""
    assert _codes(*_torchao("Float8Tensor", scheme=scheme, **data)) == ([code] if code else [])


def test_torchao_intx_weights_as_diffusers_saves_them_validate() -> None:
    """Found on 0.12.0: IntxWeightOnlyConfig(weight_dtype=torch.int4) (IntxUnpackedToInt8Tensor, whose
    description names torch.int4) was refused as Q005 "dtype 'int4' is not a torch dtype": a valid archive
    that diffusers reloads. Now taken, and its parts fitted as Int8Tensor's are."""
    intx = {"kind": "IntxUnpackedToInt8Tensor", "qdata": "int8", "block": [1, 16], "scale": (32, 2),
            "scheme": "IntxWeightOnlyConfig", "zero_point": ("int8", (32, 2))}
    assert _codes(*_torchao(**intx)) == []
    assert _codes(*_torchao(**{**intx, "scale": (32, 1)})) == ["Q007"]
    assert _codes(*_torchao(**{**intx, "qdata": "uint8"})) == ["Q003"]
    assert _codes(*_torchao(**{**intx, "zero_point": ("uint8", (32, 2))})) == ["Q003"]


def _bnb_state(quant_type: str = "nf4", **extra: Any) -> dict[str, Any]:
    return {"quant_type": quant_type, "blocksize": 64, "dtype": "float16", "shape": [32, 32], **extra}


def _bnb_parts(kind: str = "nf4") -> dict[str, TensorInfo]:
    return {"data": TensorInfo("l.weight", "uint8", (512, 1), 0, 512),
            "absmax": TensorInfo("l.weight.absmax", "float32", (16,), 0, 64),
            "quant_map": TensorInfo("l.weight.quant_map", "float32", (16,), 0, 64),
            "quant_state": TensorInfo(f"l.weight.quant_state.bitsandbytes__{kind}", "uint8", (100,), 0, 100)}


def test_a_bnb_quant_state_whose_type_contradicts_its_name_is_refused() -> None:
    """Found on 0.12.0: ``quant_type: fp4`` under ``bitsandbytes__nf4`` (the config: nf4) was taken, and
    bitsandbytes dequantizes with the JSON's type: the fp4 code book, another model."""
    quant_bnb.check_quant_state(_bnb_state(), "l.weight", _bnb_parts())  # the control
    with pytest.raises(QuantError, match="quant state says 'fp4'.*say 'nf4'") as caught:
        quant_bnb.check_quant_state(_bnb_state("fp4"), "l.weight", _bnb_parts("nf4"))
    assert caught.value.code == "Q004"


@pytest.mark.parametrize(("state", "code"), [
    ({"quant_type": "nf8"}, "Q005"), ({"blocksize": -64}, "Q005"), ({"blocksize": 1 << 40}, "Q005"),
    ({"blocksize": 64.0}, "Q005"), ({"shape": [-1, 32]}, "Q005"), ({"shape": [1 << 41, 1]}, "Q005"),
    ({"nested_blocksize": 0}, "Q005"), ({"nested_dtype": "Tensor"}, "Q005"), ({"nested_offset": 1e400}, "Q005"),
])
def test_bnb_quant_state_fields_out_of_range_are_refused(state: dict[str, Any], code: str) -> None:
    """Pins: negative, huge, non-integer block sizes and shapes, non-finite offsets, torch attributes as dtypes."""
    import json

    raw = json.dumps({**_bnb_state(), **state}).encode()
    with pytest.raises(QuantError) as caught:
        quant_bnb.parse_quant_state(raw, "l.weight.quant_state.bitsandbytes__nf4")
    assert caught.value.code == code


def test_a_bnb_quant_state_over_budget_is_refused_before_parsing() -> None:
    raw = b"[" * (quant_bnb.MAX_QUANT_STATE_BYTES + 1)
    with pytest.raises(QuantError, match="over 4096") as caught:
        quant_bnb.parse_quant_state(raw, "q")
    assert caught.value.code == "Q005"


@pytest.mark.parametrize("config", [
    {"weights_dtype": "int99"}, {"weights_dtype": "quantum"}, {"weights_dtype": 8}, {"group_size": -3},
    {"group_size": 1 << 20}, {"svd_rank": 0}, {"use_svd": "yes"}, {"modules_to_not_convert": ["a(b)+"]},
    {"modules_to_not_convert": 5}, {"modules_quant_config": {"a": {"modules_quant_config": {"b": {}}}}},
    {"modules_dtype_dict": {"int99": ["a"]}}, {"scale_dtype": "float128"},
])
def test_sdnq_configs_sdnq_cannot_parse_safely_are_refused(config: dict[str, Any]) -> None:
    """Pins: unknown quant types, out-of-range sizes, regex syntax in module names, nested overrides."""
    with pytest.raises(QuantError) as caught:
        check_sdnq_config(config)
    assert caught.value.code == "Q005"


@pytest.mark.parametrize("description", [
    '{"_type": "os.system"}', '{"_type": "Int8Tensor", "_data": {"dtype": {"_type": "torch.dtype", "_data": "load"}}}',
    '{"_type": "Int8Tensor", "_tensor_data_names": ["__class__"]}', "[" * 10_000, '{"_type": 5}',
    '{"_type": "Int8Tensor", "_data": {"m": {"_type": "MappingType", "_data": "__init__"}}}',
    # unhashable class names and dtypes (found by the loader fuzzer: a TypeError from the allow-list lookup)
    '{"_type": []}', '{"_type": {"a": 1}}', '{"_type": "Int8Tensor", "_data": {"dtype": {"_type": "torch.dtype", "_data": []}}}',
    '{"_type": "Int8Tensor", "_tensor_data_names": ["qdata"], "_data": [{"block_size": [1, 32]}]}',  # fields not an object
])
def test_torchao_descriptions_outside_the_allow_list_are_refused(description: str) -> None:
    with pytest.raises(QuantError) as caught:
        torchao_descriptions({"tensor_names": '["l.weight"]', "l.weight": description})
    assert caught.value.code == "Q005"


# --- end to end: validate, load_dduf and the component loader, in a child process ----------------------------
def _torchao_folder(root: Path, config: Any) -> Path:
    import shutil

    import torch
    from diffusers import TorchAoConfig, UNet2DConditionModel
    from test_quant_native_safety import TINY_SD

    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", torch_dtype=torch.bfloat16,
                                                quantization_config=TorchAoConfig(config))
    unet.save_pretrained(root / "unet")
    return root


def _float8_folder(root: Path) -> Path:
    quantization = pytest.importorskip("torchao.quantization")  # the quant extra; the callers skip without it

    return _torchao_folder(root, quantization.Float8WeightOnlyConfig())


def _intx_folder(root: Path) -> Path:
    import torch

    quantization = pytest.importorskip("torchao.quantization")
    granularity = pytest.importorskip("torchao.quantization.granularity")
    return _torchao_folder(root, quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                   granularity=granularity.PerGroup(16)))


def _cases() -> dict[str, tuple[Callable[[Path], Path], dict[str, tuple[Any, str]]]]:
    import test_quant_native_safety as native
    import torch

    q = f"{native.LAYER}._weight"
    float8 = {
        "control": (lambda t, m: None, ""),
        "qdata int8 bytes": (native._set(f"{q}_qdata", lambda t: t.view(torch.int8)), "Q003"),
        "scale one row": (native._set(f"{q}_scale", lambda t: t[:1]), "Q007"),
        "block_size not tiling": (native._description(native.LAYER, lambda d: d["_data"].update(block_size=[1, 7])),
                                  "Q007"),
    }
    bnb4 = {
        "control": (lambda t, m: None, ""),
        "fp4 state under nf4": (native._state(native.LAYER, lambda s: s.update(quant_type="fp4")), "Q004"),
    }
    intx = {  # the control: refused on 0.12.0 (Q005 "dtype 'int4'")
        "control": (lambda t, m: None, ""),
        "zero_point uint8": (native._set(f"{q}_zero_point", lambda t: t.view(torch.uint8)), "Q003"),
        "scale one column": (native._set(f"{q}_scale", lambda t: t[:, :1]), "Q007"),
    }
    return {"torchao-float8": (_float8_folder, float8), "torchao-intx": (_intx_folder, intx),
            "bnb4": (native.BUILDERS["bnb4"], bnb4)}


@pytest.mark.parametrize("backend", ["torchao-float8", "torchao-intx", "bnb4"])
def test_quantized_states_that_contradict_themselves_are_refused_everywhere(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on 0.12.0: each case validated and loaded (a different model). Now a validate error, and a
    DDUFError with the same rule from load_dduf and from the component loader on the folder, before the
    backend builds a tensor; the unedited control still loads everywhere."""
    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    import test_quant_native_safety as native

    build, cases = _cases()[backend]
    base = build(tmp_path / "base" / "tiny-sd")
    specs = []
    for i, (name, (edit, _code)) in enumerate(cases.items()):
        folder, archive = native._hostile(base, tmp_path / f"case{i}", edit, monkeypatch)
        specs.append({"name": name, "archive": str(archive), "folder": str(folder), "component": "unet"})
    results = native._run_worker(specs, tmp_path)
    wrong = []
    for name, (_edit, code) in cases.items():
        got = results[name]
        errors = [f for f in got["validate"] if f[1] == "error"]
        if not code:
            if errors or got["load_dduf"] != {"kind": "loaded"} or got["loader"] != {"kind": "loaded"}:
                wrong.append((name, got))
            continue
        if [code, "error"] not in got["validate"]:
            wrong.append((name, "validate", got["validate"]))
        wrong += [(name, how, got[how]) for how in ("load_dduf", "loader")
                  if got[how]["kind"] != "DDUFError" or code not in got[how]["codes"]]
    assert not wrong, wrong


# --- optimum-quanto states ---------------------------------------------------------------------------------
def _quanto_layers(qtype_name: str) -> tuple[Any, dict[str, Any]]:
    """Layers quanto quantizes with each layout (grouped by 128, per row, odd rows, a conv), frozen, and their
    state dict."""
    torch = pytest.importorskip("torch")
    quanto = pytest.importorskip("optimum.quanto")
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(100, 33), torch.nn.Conv2d(4, 8, 3))
    quanto.quantize(model, weights=getattr(quanto, qtype_name))
    quanto.freeze(model)
    return model, dict(model.state_dict())


def _dt(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _quanto_problems(model: Any, state: dict[str, Any]) -> list[str | None]:
    from dduf_plus.loading.quant import quanto_weight_problem

    return [quanto_weight_problem(m, m.weight_qtype, f"{n}.", state) for n, m in model.named_children()]


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8", "qint4", "qint2"])
def test_quanto_weights_as_quanto_saves_them_fit(qtype: str) -> None:
    model, state = _quanto_layers(qtype)
    assert _quanto_problems(model, state) == [None, None, None]


@pytest.mark.parametrize(("qtype", "key", "change", "match"), [
    ("qint8", "0.weight._data", lambda t: t.view(_dt("uint8")), "_data uint8 .*needs int8"),
    ("qint8", "1.weight._data", lambda t: t.float(), "_data float32 .*needs int8"),
    ("qint8", "0.weight._scale", lambda t: t.to(_dt("int8")), "_scale int8"),
    ("qint4", "0.weight._data._data", lambda t: t[: t.shape[0] // 2], r"_data uint8 \[32, 128\].*\[64, 128\]"),
    ("qint4", "1.weight._data._data", lambda t: t.view(_dt("int8")), "_data int8"),
    ("qint4", "0.weight._scale", lambda t: t[:1], r"_scale float32 \[1, 1\], one float scale per row \[128, 1\]"),
    ("qint4", "2.weight._scale", lambda t: t.repeat(2, 1, 1, 1), r"per row \[8, 1, 1, 1\]"),
    ("qint2", "1.weight._data._data", lambda t: t[:-1], r"\[9, 100\]"),
], ids=["qint8-data-uint8", "qint8-data-float32", "qint8-scale-int8", "qint4-packed-half", "qint4-packed-int8",
        "qint4-one-scale", "qint4-conv-scale-doubled", "qint2-packed-row-short"])
def test_quanto_weights_that_do_not_fit_their_layer_are_refused(qtype: str, key: str, change: Callable[[Any], Any],
                                                                match: str) -> None:
    """Found on 0.12.0: a qint8 weight's bytes stored as uint8 loaded (values over 127 read as positive: another
    model); a 4-bit packed weight of half its rows, or one scale for the whole layer, loaded and failed in the
    first forward or computed with a scale broadcast over every row. Now Q006 before quanto wraps them."""
    model, state = _quanto_layers(qtype)
    state[key] = change(state[key])
    problems = [p for p in _quanto_problems(model, state) if p is not None]
    assert len(problems) == 1 and re.search(match, problems[0]), problems


def test_a_quanto_packed_weight_of_half_its_rows_is_refused_everywhere(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end (found on 0.12.0: validate took it, it loaded, and the first forward raised a bare
    RuntimeError). Now validate and load_dduf say Q003 (the map says qint4: 16 packed rows for 32 scales), the
    component loader on the folder Q006 (the layer's own shape); pack refuses to write it."""
    import importlib
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    quanto = pytest.importorskip("optimum.quanto")
    from diffusers import PixArtTransformer2DModel

    from conftest import PIPELINES
    from dduf_plus import validate
    from dduf_plus.errors import DDUFPackError
    from dduf_plus.loading import quant
    from dduf_plus.loading.files import FolderComponentFiles
    from dduf_plus.packing.pack import pack

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer")
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    root = tmp_path / "tiny-dit"
    shutil.copytree(PIPELINES / "tiny-dit", root)
    folder = root / "transformer"
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    quant.save_quanto_component(model, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - its API
    key = "caption_projection.linear_1.weight._data._data"
    tensors[key] = tensors[key][: tensors[key].shape[0] // 2].contiguous()
    save_file(tensors, str(weights), metadata=metadata)
    with pytest.raises(DDUFPackError, match="Q003"):
        pack(root, tmp_path / "half.dduf", quiet=True)
    monkeypatch.setattr(importlib.import_module("dduf_plus.format.pack"), "check_written", lambda tmp, o: None)
    pack(root, tmp_path / "half.dduf", quiet=True)  # as a foreign writer would
    report = validate(tmp_path / "half.dduf")
    assert [f.code for f in report.errors] == ["Q003"] and "caption_projection.linear_1" in report.errors[0].message
    with pytest.raises(DDUFError, match="Q003.*caption_projection.linear_1: qint4 scale"):
        load_dduf(tmp_path / "half.dduf", torch_dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(DDUFError, match=r"Q006: caption_projection.linear_1 \(qint4\).*weight._data uint8 \[8, 32\]") \
            as caught:
        quant.load_quanto_component(PixArtTransformer2DModel, config, FolderComponentFiles(folder))
    assert getattr(caught.value, "code", None) == "Q006"


def test_quanto_parts_against_the_map_torch_free() -> None:
    """validate's side (no torch, no model): the map's qtype against the stored dtypes and row counts."""
    def header(**tensors: tuple[str, tuple[int, ...]]) -> SafetensorsHeader:
        return SafetensorsHeader(100, {n: TensorInfo(n, d, s, 0, 1) for n, (d, s) in tensors.items()}, None)

    qmap = {"l": {"weights": "qint4", "activations": "none"}, "m": {"weights": "qint8", "activations": "none"}}
    good = {"l.weight._data._data": ("uint8", (64, 128)), "l.weight._scale": ("float32", (128, 1)),
            "l.weight._shift": ("float32", (128, 1)), "m.weight._data": ("int8", (33, 100)),
            "m.weight._scale": ("bfloat16", (33, 1))}
    assert quant_rules.quanto_findings("t", qmap, [header(**good)]) == []
    for change, expected in [({"l.weight._data._data": ("uint8", (32, 128))}, "qint4 scale"),
                             ({"l.weight._data._data": ("int8", (64, 128))}, "is int8, not uint8"),
                             ({"l.weight._shift": ("float32", (1, 1))}, "qint4 shift"),
                             ({"m.weight._data": ("uint8", (33, 100))}, "is uint8, not int8"),
                             ({"m.weight._scale": ("float32", (1, 1))}, "qint8 scale"),
                             ({"m.weight._scale": ("int8", (33, 1))}, "qint8 scale int8")]:
        found = quant_rules.quanto_findings("t", qmap, [header(**{**good, **change})])
        assert [f.code for f in found] == ["Q003"] and expected in found[0].message, (change, found)
    assert quant_rules.quanto_findings("t", {"m": {"weights": "qint8"}}, [header()]) == []  # missing: the loader's
    assert quant_rules.quanto_findings("t", ["not", "a", "map"], [header(**good)]) == []


@pytest.mark.parametrize("value", [["qint8"], {"qint8": 1}, 5])
def test_a_quanto_map_entry_of_another_type_is_refused_naming_it(value: Any) -> None:
    """Found on 0.12.0: a list or object as a qtype was a bare ``TypeError: unhashable type`` from the component
    loader (``load_dduf`` wrapped it as "cannot build ...: TypeError")."""
    quanto = pytest.importorskip("optimum.quanto")
    from dduf_plus.loading.quant import check_qmap

    for key in ("weights", "activations"):
        with pytest.raises(DDUFError, match=f"quanto_qmap.json entry 'proj': {key}"):
            check_qmap({"proj": {key: value}}, quanto, "unet")
    assert check_qmap({"proj": {"weights": "qint8", "activations": "none"}}, quanto, "unet")


def _bnb4_component(compute_dtype: Any) -> tuple[dict[str, Any], SafetensorsHeader]:
    """A one-layer bitsandbytes 4-bit component (``l.weight`` [32, 32], nf4, blocks of 64)."""
    qs = "l.weight.quant_state.bitsandbytes__nf4"
    parts = _bnb_parts()
    tensors = {info.name: info for info in parts.values()}
    tensors[qs] = TensorInfo(qs, "uint8", (100,), 0, 100)
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
          "bnb_4bit_compute_dtype": compute_dtype}
    return {"quantization_config": qc}, SafetensorsHeader(100, tensors, None)


@pytest.mark.parametrize("compute_dtype", ["int8", "bool", "float8_e4m3fn", "load", 5])
def test_a_bnb_compute_dtype_that_is_no_float_is_refused(compute_dtype: Any) -> None:
    """Found on 0.12.0: diffusers resolves any torch dtype name and each Linear4bit casts its input to it:
    ``int8`` loaded and truncated the activations (another image), ``float8_e4m3fn`` gave NaN, ``bool`` a bare
    NotImplementedError in the first forward. Now Q005 in validate, pack and the loader (one check)."""
    assert _codes(*_bnb4_component("float16")) == [] and _codes(*_bnb4_component(None)) == []
    assert _codes(*_bnb4_component(compute_dtype)) == ["Q005"]
