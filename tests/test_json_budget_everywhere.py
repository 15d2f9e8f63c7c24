"""One JSON budget, everywhere: every JSON an archive (or a reference folder) supplies goes through one reader
(dduf_plus/format/json_budget.py), so `validate`, `validate --verify` and `load_dduf` refuse the same entries
with the same rule code (D013), in bounded time and memory.

Variants per class, built from a real tiny DDPMPipeline written without checks: configs (size, values,
depth, a 5000-digit integer, 1e400, a 101-digit integer), sharded-weight indexes (size, values, depth,
numbers), settings files the loader parses (generation_config.json, quanto_qmap.json), tokenizer JSON
handed to transformers by path, reference folders. Decisions tested too: NaN/Infinity and duplicate keys
are accepted by both, like Python's parser and the writers that emit them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from dduf_plus.errors import DDUFError
from dduf_plus.format.json_budget import (
    DATA_JSON_BUDGET,
    MAX_NUMBER_CHARS,
    SHARD_INDEX_JSON_BUDGET,
    budget_for,
    json_budget_problem,
    read_json,
)
from dduf_plus.format.spec import CONFIG_JSON_BUDGET, MAX_JSON_DEPTH
from dduf_plus.format.validate import load_findings, validate
from dduf_plus.format.writer import DDUFWriter

ROOT = Path(__file__).resolve().parent.parent
SHARD = "diffusion_pytorch_model-00001-of-00001.safetensors"
SHARD_INDEX = "unet/diffusion_pytorch_model.safetensors.index.json"
DEEP = "[" * (MAX_JSON_DEPTH + 20) + "]" * (MAX_JSON_DEPTH + 20)


def _ddpm_folder(root: Path) -> Path:
    path = ROOT / "fixtures" / "hostile_loading" / "make_hostile_loading.py"
    module_spec = importlib.util.spec_from_file_location("make_hostile_loading", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.tiny_ddpm(root / "ddpm")


@pytest.fixture(scope="module")
def ddpm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The entries of a real tiny DDPMPipeline: {archive name: bytes}."""
    folder = _ddpm_folder(tmp_path_factory.mktemp("json-budget"))
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in (".json", ".safetensors")}


def write(path: Path, entries: dict[str, bytes]) -> Path:
    """An archive of ``entries`` (model_index.json first), written with no check: the hostile bytes as they are."""
    with DDUFWriter(path) as writer:
        for name in sorted(entries, key=lambda n: n != "model_index.json"):
            writer.add_bytes(name, entries[name])
    return path


def with_junk(raw: bytes, junk: str) -> bytes:
    """A JSON object's bytes with one more member ``"junk": <junk>`` (raw JSON text)."""
    text = raw.decode().rstrip().removesuffix("}")
    return (text + ', "junk": ' + junk + "}").encode()


def sharded(entries: dict[str, bytes], junk: str | None = None, pad: int = 0) -> dict[str, bytes]:
    """The unet's weights as one shard plus an index naming every tensor (and ``junk``, ``pad`` spaces)."""
    out = dict(entries)
    weights = out.pop("unet/diffusion_pytorch_model.safetensors")
    out[f"unet/{SHARD}"] = weights
    header = json.loads(weights[8 : 8 + int.from_bytes(weights[:8], "little")])
    index = json.dumps({"metadata": {}, "weight_map": {n: SHARD for n in header if n != "__metadata__"}}).encode()
    out[SHARD_INDEX] = (with_junk(index, junk) if junk else index) + b" " * pad
    return out


def empty_objects(values: int) -> str:
    return "[" + ",".join(["{}"] * values) + "]"


SCHEDULER = "scheduler/scheduler_config.json"
OVER_CONFIG_VALUES = empty_objects(CONFIG_JSON_BUDGET.values + 10)
# name -> (edit of the entries, the D013 entry, or None when every reader must accept it)
VARIANTS: dict[str, tuple[Callable[[dict[str, bytes]], dict[str, bytes]], str | None]] = {
    "config-size": (lambda e: {**e, SCHEDULER: e[SCHEDULER] + b" " * CONFIG_JSON_BUDGET.bytes}, SCHEDULER),
    "config-values": (lambda e: {**e, SCHEDULER: with_junk(e[SCHEDULER], OVER_CONFIG_VALUES)}, SCHEDULER),
    "config-depth": (lambda e: {**e, "unet/config.json": with_junk(e["unet/config.json"], DEEP)}, "unet/config.json"),
    "config-10**5000": (lambda e: {**e, SCHEDULER: with_junk(e[SCHEDULER], "1" * 5000)}, SCHEDULER),
    "config-101-digits": (lambda e: {**e, SCHEDULER: with_junk(e[SCHEDULER], "-" + "9" * 101)}, SCHEDULER),
    "config-1e400": (lambda e: {**e, SCHEDULER: with_junk(e[SCHEDULER], "[1.5, -1e400]")}, SCHEDULER),
    "shard-index-size": (lambda e: sharded(e, pad=SHARD_INDEX_JSON_BUDGET.bytes), SHARD_INDEX),
    "shard-index-values": (lambda e: sharded(e, empty_objects(SHARD_INDEX_JSON_BUDGET.values)), SHARD_INDEX),
    "shard-index-depth": (lambda e: sharded(e, DEEP), SHARD_INDEX),
    "shard-index-1e999": (lambda e: sharded(e, "1e999"), SHARD_INDEX),
    "generation-config-values": (lambda e: {**e, "unet/generation_config.json": OVER_CONFIG_VALUES.encode()},
                                 "unet/generation_config.json"),
    "quanto-qmap-depth": (lambda e: {**e, "unet/quanto_qmap.json": DEEP.encode()}, "unet/quanto_qmap.json"),
    # accepted by every reader: the decisions
    "shard-index-nan-infinity": (lambda e: sharded(e, "[NaN, Infinity, -Infinity, 1e308, 1e-400]"), None),
    "shard-index-duplicate-key": (lambda e: sharded(e, '1, "junk": 2'), None),
    "shard-index-99-digits": (lambda e: sharded(e, "9" * 99), None),
    "shard-index-valid": (lambda e: sharded(e), None),
}


def load_error(path: Path) -> DDUFError | None:
    from dduf_plus import load_dduf

    try:
        load_dduf(path)
    except DDUFError as e:
        return e
    return None


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_validate_verify_and_load_agree(name: str, ddpm: dict[str, bytes], tmp_path: Path) -> None:
    edit, refused_entry = VARIANTS[name]
    archive = write(tmp_path / f"{name}.dduf", edit(ddpm))
    structural, verified = validate(archive), validate(archive, verify=True)
    error = load_error(archive)
    if refused_entry is None:
        assert structural.valid and verified.valid, (structural, verified)
        assert error is None, f"{name}: validate accepts it, load_dduf refused: {error}"
        return
    for report in (structural, verified):
        assert [(f.code, f.entry) for f in report.errors] == [("D013", refused_entry)], report
    assert error is not None, f"{name}: validate refuses it (D013), load_dduf loaded it"
    assert error.codes == ["D013"] and "D013" in str(error) and refused_entry in str(error), error


def test_read_json_is_the_reader_and_names_the_rule() -> None:
    assert read_json(b'{"a": [1, 2.5, NaN]}', "unet/config.json")["a"][:2] == [1, 2.5]
    with pytest.raises(DDUFError) as info:
        read_json(DEEP.encode(), "unet/config.json", where="x.dduf")
    assert info.value.code == "D013" and str(info.value).startswith("x.dduf: D013 [unet/config.json]: nests deeper")
    with pytest.raises(DDUFError) as info:
        read_json(b"{", "unet/config.json")
    assert info.value.code == "D007"
    assert budget_for("unet/config.json") == CONFIG_JSON_BUDGET
    assert budget_for("unet/generation_config.json") == CONFIG_JSON_BUDGET
    assert budget_for("unet/model.fp16.safetensors.index.json") == SHARD_INDEX_JSON_BUDGET
    assert budget_for("tokenizer/tokenizer.json") == DATA_JSON_BUDGET


@pytest.mark.parametrize("literal, refused", [("1" * (MAX_NUMBER_CHARS + 1), True), ("1" * MAX_NUMBER_CHARS, False),
                                              ("1e400", True), ("-1e309", True), ("1e308", False), ("1e-400", False),
                                              ("0." + "0" * 97 + "1", False), ("0." + "0" * 98 + "1", True),
                                              ('"' + "1" * 500 + '"', False), ('"x1e999"', False)])
def test_number_literals(literal: str, refused: bool) -> None:
    raw = ('{"vocab": {"a": 1}, "n": ' + literal + "}").encode()
    assert (json_budget_problem(raw, "tokenizer/vocab.json") is not None) == refused
    try:
        read_json(raw, "tokenizer/vocab.json")
    except DDUFError as e:
        assert refused and e.code == "D013", e
    else:
        assert not refused


@pytest.mark.parametrize("filename", ["vocab.json", "chat_template.json"])
def test_json_given_to_a_library_by_path_is_budgeted(filename: str, tmp_path: Path) -> None:
    """A tokenizer's or processor's files are handed to transformers by path: the loader checks every JSON one
    on its bytes first, as validate does (structurally too: over 256 KiB on the bytes, without parsing)."""
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.files import ArchiveComponentFiles, FolderComponentFiles

    model_index = json.dumps({"_class_name": "X", "tokenizer": ["transformers", "CLIPTokenizer"]}).encode()
    vocab = {f"tok{i}": i for i in range(30_000)}  # ~400 KB: over the structural parse limit
    cases = {"deep": json.dumps(vocab)[:-1] + ', "x": ' + DEEP + "}",
             "number": json.dumps(vocab)[:-1] + ', "x": 1e400}',
             "fine": json.dumps(vocab)}
    for case, text in cases.items():
        entries = {"model_index.json": model_index, "tokenizer/tokenizer_config.json": b"{}",
                   f"tokenizer/{filename}": text.encode()}
        archive_path = write(tmp_path / f"{case}.dduf", entries)
        for verify in (False, True):
            report = validate(archive_path, verify=verify)
            assert [f.code for f in report.errors] == ([] if case == "fine" else ["D013"]), report
        folder = tmp_path / case / "tokenizer"
        folder.mkdir(parents=True)
        (folder / filename).write_text(text)
        with DDUFArchive(archive_path) as archive:
            assert [f.code for f in load_findings(archive) if f.severity == "error"] == \
                ([] if case == "fine" else ["D013"])
            for files in (ArchiveComponentFiles(archive, "tokenizer"), FolderComponentFiles(folder)):
                if case == "fine":
                    assert Path(files.local_dir()).is_dir()
                    continue
                with pytest.raises(DDUFError) as info:
                    files.local_dir()
                assert info.value.code == "D013" and f"tokenizer/{filename}" in str(info.value)


def test_reference_folder_configs_are_budgeted(tmp_path: Path) -> None:
    """A component resolved from a reference is a folder on disk: its JSON passes the same reader."""
    from dduf_plus.loading.files import FolderComponentFiles

    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "AutoencoderKL", "x": ' + DEEP + "}")
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {}, "n": 1e999}')
    files = FolderComponentFiles(folder)
    for name in ("config.json", "diffusion_pytorch_model.safetensors.index.json"):
        with pytest.raises(DDUFError) as info:
            files.read_json(name)
        assert info.value.code == "D013" and f"vae/{name}" in str(info.value)


BOUNDED = textwrap.dedent("""
    import json, resource, sys, time
    import torch, diffusers  # before the baseline: library imports are not the archive's cost
    from dduf_plus import load_dduf
    from dduf_plus.errors import DDUFError
    from dduf_plus.format.validate import load_findings, validate
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for path in sys.argv[1:]:
        started = time.process_time()  # this process' CPU: what the parse costs, whatever the machine's load
        codes = [[f.code for f in validate(path, verify=verify).errors] for verify in (False, True)]
        try:
            load_dduf(path)
            codes.append("loaded")
        except DDUFError as e:
            codes.append(e.codes)
        out[path] = [codes, time.process_time() - started]
    out["rss_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps(out))
""")


def test_bombs_are_refused_in_bounded_time_and_memory(ddpm: dict[str, bytes], tmp_path: Path) -> None:
    """A 7.9 MB config of 2.6 M empty objects (under the byte cap: it is read, then refused by its value
    count) and a 15 MB shard index of 5 M: before, `validate` parsed the shard index (reported valid) and
    `load_dduf` both, ~0.4 GB and seconds each; now all three refuse them from a count on the bytes."""
    config = with_junk(ddpm[SCHEDULER], empty_objects((CONFIG_JSON_BUDGET.bytes - 200_000) // 3))
    assert len(config) < CONFIG_JSON_BUDGET.bytes
    archives = [write(tmp_path / "config.dduf", {**ddpm, SCHEDULER: config}),
                write(tmp_path / "index.dduf", sharded(ddpm, empty_objects(5_000_000)))]
    run = subprocess.run([sys.executable, "-c", BOUNDED, *map(str, archives)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for path in map(str, archives):
        codes, seconds = result[path]
        assert codes == [["D013"], ["D013"], ["D013"]], (path, codes)
        assert seconds < 5, (path, seconds)  # CPU seconds: ~1 here; the parse it replaces took several
    print(result)
    assert result["rss_mb"] < 150, result  # 15 MB of bytes and a copy; the parse it replaces: ~400 MB


@pytest.mark.parametrize("name", ["config-values", "shard-index-values", "shard-index-valid"])
def test_remote_load_refuses_with_the_same_code(name: str, ddpm: dict[str, bytes], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dduf(URL) runs the same checks once the fetch brings what they read (in build order)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from servers import FileServer

    from dduf_plus import load_dduf

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    edit, refused_entry = VARIANTS[name]
    (tmp_path / "www").mkdir()
    write(tmp_path / "www" / f"{name}.dduf", edit(ddpm))
    with FileServer(tmp_path / "www") as server:
        if refused_entry is None:
            assert load_dduf(server.url(f"{name}.dduf")).unet is not None
            return
        with pytest.raises(DDUFError) as info:
            load_dduf(server.url(f"{name}.dduf"))
    assert info.value.codes == ["D013"] and refused_entry in str(info.value), info.value


def test_a_lone_surrogate_is_refused_in_a_folder_and_an_archive_alike(ddpm: dict[str, bytes], tmp_path: Path) -> None:
    """The folder loader and the archive loader refuse a config holding half a UTF-16 pair with one code, and
    say which of the two they read (a folder is no "DDUF archive")."""
    entries = dict(ddpm)
    config = json.loads(entries["scheduler/scheduler_config.json"])
    entries["scheduler/scheduler_config.json"] = json.dumps({**config, "note": "\udc80"}).encode()
    folder = tmp_path / "folder"
    for name, data in entries.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    archive = write(tmp_path / "a.dduf", entries)
    assert [(f.code, f.entry) for f in validate(archive).errors] == [("D007", "scheduler/scheduler_config.json")]
    for source, kind in ((folder, "pipeline folder"), (archive, "DDUF archive")):
        error = load_error(source)
        assert error is not None and error.codes == ["D007"], (source, error)
        assert f"is not a valid {kind}:" in str(error) and "scheduler/scheduler_config.json" in str(error), error
