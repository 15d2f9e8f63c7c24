"""Untrusted archives in every command: `dduf info`, `dduf refs`, `dduf complete`, `dduf unpack` and
`load_dduf` run on every case of both hostile corpora (fixtures/hostile: validation; fixtures/hostile_loading:
archives that validate but try to make the loader build, fetch, run, read or write what they should not).

Around each run: canary folders (and the corpus itself) must not change, the only connections allowed are to
HF_ENDPOINT (a local recorder) and only for cases that declare a Hub reference, nothing may ask on stdin, and
the only exceptions are DDUFErrors (the CLI returns 0/1/2; load_dduf raises the case's error class)."""

from __future__ import annotations

import builtins
import hashlib
import http.server
import json
import os
import socket
import threading
from pathlib import Path

import pytest

import dduf_plus.errors as errors
from conftest import HOSTILE
from dduf_plus.cli import main
from dduf_plus.errors import DDUFError

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "fixtures" / "hostile_loading" / "make_hostile_loading.py"
VALIDATION_CASES = sorted(json.loads((HOSTILE / "cases.json").read_text()))
OUTSIDE_TARGETS = [Path("/tmp/evil"), Path("/etc/evil.json")]  # absolute names the validation corpus uses


def _load_generator():
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("make_hostile_loading", GENERATOR)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hostile-loading")
    canary = root / "canary"
    (canary / "sentinel").mkdir(parents=True)
    (canary / "sentinel" / "keep.txt").write_text("must not change")
    cases = _load_generator().build(root / "corpus", canary)
    return {"root": root, "canary": canary, "corpus": root / "corpus", "cases": cases}


def tree_state(*folders: Path) -> dict[str, str]:
    """Every path under ``folders`` with its content hash or link target: what 'unchanged' means."""
    state: dict[str, str] = {}
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    state[str(p)] = "-> " + os.readlink(p)
                elif p.is_file():
                    state[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
                else:
                    state[str(p)] = "dir"
    return state


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self) -> None:
        _Recorder.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()


@pytest.fixture
def guarded(sandbox: dict, endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Online (HF_HUB_OFFLINE off) against the local recorder; every other connection is refused and
    recorded; stdin prompts fail the test; a private HF_HOME and dduf_plus cache."""
    import huggingface_hub.constants as constants

    home = tmp_path / "home"
    url = f"http://{endpoint[0]}:{endpoint[1]}"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(home / "dduf_plus"))
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    foreign: list[object] = []
    real_connect = socket.socket.connect

    def connect(self, address):
        if address != endpoint and address[:2] != endpoint:
            foreign.append(address)
            raise OSError(f"test sandbox: connection to {address} refused")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)

    def no_prompt(*args: object) -> str:
        raise AssertionError(f"something asked on stdin: {args}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    _Recorder.seen.clear()
    before = tree_state(sandbox["canary"], sandbox["corpus"], HOSTILE)
    outside = {p: p.exists() for p in OUTSIDE_TARGETS}
    yield {"out": tmp_path / "out", "home": home, "foreign": foreign, "seen": _Recorder.seen}
    assert tree_state(sandbox["canary"], sandbox["corpus"], HOSTILE) == before, "a canary or the corpus changed"
    assert {p: p.exists() for p in OUTSIDE_TARGETS} == outside, "something was written outside the sandbox"
    assert foreign == [], f"connections outside HF_ENDPOINT: {foreign}"
    written = {p.relative_to(home).parts[0] for p in home.rglob("*")} if home.exists() else set()
    assert written <= {"dduf_plus", "hub"}, written


def run_commands(archive: Path, out: Path) -> dict[str, int]:
    """Every command on ``archive``; returns exit codes (a non-DDUFError escapes and fails the test)."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        "info": main(["info", str(archive)]),
        "info --json": main(["info", "--json", str(archive)]),
        "refs": main(["refs", str(archive)]),
        "complete": main(["complete", str(archive), "-o", str(out / "complete.dduf")]),
        "unpack": main(["unpack", str(archive), "-o", str(out / "unpacked")]),
        # no structural check: names are still confined to the output folder (raw-byte traversal names)
        "unpack --no-check": main(["unpack", "--no-check", str(archive), "-o", str(out / "unchecked")]),
    }


def try_load(archive: Path):
    from dduf_plus import load_dduf

    try:
        return load_dduf(archive), None
    except DDUFError as e:
        return None, e


# --- the loading corpus ------------------------------------------------------------------------------------
def loading_cases() -> list[str]:
    # the names are fixed by the generator; listing them here keeps collection free of torch imports
    return ["automodel-factory.dduf", "config-name-or-path.dduf", "ddpm-valid.dduf", "diffusers-missing-weights.dduf",
            "huge-config-tiny-weights.dduf", "library-builtins.dduf", "library-subprocess.dduf",
            "library-unknown.dduf", "modular-blocks.dduf", "modular-pipeline-component.dduf",
            "pipeline-class-modular.dduf", "processor-auto-map.dduf", "reference-hub.dduf",
            "reference-local-differs.dduf", "reference-local-folder.dduf", "reference-missing-dduf.dduf",
            "reference-url-source.dduf", "tokenizer-auto-map.dduf", "transformers-missing-weights.dduf"]


def test_generator_lists_every_case(sandbox: dict) -> None:
    assert sorted(sandbox["cases"]) == loading_cases()
    assert all(c["expect"] in ("loads", "refused") for c in sandbox["cases"].values())


@pytest.mark.parametrize("file", loading_cases())
def test_loading_case(file: str, sandbox: dict, guarded: dict) -> None:
    case = sandbox["cases"][file]
    archive = sandbox["corpus"] / file
    codes = run_commands(archive, guarded["out"])
    assert set(codes.values()) <= {0, 1, 2}, codes
    assert codes["info --json"] == 0, "info reads configs only: it must describe every one of these archives"
    pipe, error = try_load(archive)
    if case["expect"] == "loads":
        assert error is None, f"{file}: {error}"
        assert pipe is not None
    else:
        assert error is not None, f"{file} loaded; expected {case['error']}"
        assert isinstance(error, getattr(errors, case["error"])), f"{file}: {type(error).__name__}: {error}"
    if not case["network"]:
        assert guarded["seen"] == [], f"{file} reached the network: {guarded['seen']}"
    else:  # online, the declared Hub reference is the one thing that reaches HF_ENDPOINT (the recorder works)
        assert guarded["seen"], "the recorder saw nothing: the sandbox is not online"
        assert all(r.split()[1].startswith(("/api/models/evil-org/not-cached", "/evil-org/not-cached"))
                   for r in guarded["seen"]), guarded["seen"]


def test_refused_classes_say_which_component_and_class(sandbox: dict, guarded: dict) -> None:
    _, error = try_load(sandbox["corpus"] / "automodel-factory.dduf")  # a model class with no weights: D016 first
    assert error.code == "D016" and "D016 unet" in str(error) and "AutoModel" in str(error)
    _, error = try_load(sandbox["corpus"] / "modular-blocks.dduf")
    assert "'scheduler'" in str(error) and "StableDiffusionXLAutoBlocks" in str(error)


def test_missing_weights_are_an_error_unless_asked_for(sandbox: dict, guarded: dict, caplog) -> None:
    from dduf_plus import load_dduf

    archive = sandbox["corpus"] / "transformers-missing-weights.dduf"
    _, error = try_load(archive)
    assert "final_layer_norm" in str(error) and "allow_missing_weights" in str(error)
    pipe = load_dduf(archive, allow_missing_weights=True)
    assert pipe.text_encoder is not None
    assert "randomly initialised" in caplog.text


def test_refs_reports_a_differing_copy_as_differs(sandbox: dict, guarded: dict, capsys) -> None:
    archive = sandbox["corpus"] / "reference-local-differs.dduf"
    # without --verify nothing is hashed: sizes match, so it is not called verified either
    assert main(["refs", "--json", str(archive)]) == 0
    rows = json.loads(capsys.readouterr().out)["references"]
    assert [(r["status"], r["verified"]) for r in rows] == [("ok", False)]
    assert main(["refs", "--json", "--verify", str(archive)]) == 1
    rows = json.loads(capsys.readouterr().out)["references"]
    assert [r["status"] for r in rows] == ["differs"]
    assert str(sandbox["canary"] / "sentinel") not in rows[0]["reason"]  # nothing outside its folder is listed
    # the hash is remembered now: a plain `dduf refs` knows it differs too
    assert main(["refs", str(archive)]) == 1
    assert "DIFFERS" in capsys.readouterr().out



def test_offline_a_hub_reference_reaches_no_network(sandbox: dict, guarded: dict, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _, error = try_load(sandbox["corpus"] / "reference-hub.dduf")
    assert isinstance(error, errors.DDUFReferenceError)
    assert guarded["seen"] == []


# --- the validation corpus through every command ---------------------------------------------------------
@pytest.mark.parametrize("file", VALIDATION_CASES)
def test_validation_case_in_every_command(file: str, guarded: dict) -> None:
    codes = run_commands(HOSTILE / file, guarded["out"])
    assert set(codes.values()) <= {0, 1, 2}, codes
    unchecked = guarded["out"] / "unchecked"
    if unchecked.exists():  # whatever --no-check wrote stays inside the output folder
        resolved = unchecked.resolve()
        assert all(p.resolve().is_relative_to(resolved) for p in unchecked.rglob("*"))
    pipe, error = try_load(HOSTILE / file)
    assert pipe is None and error is not None  # none of them is a loadable pipeline
    assert guarded["seen"] == []


@pytest.mark.parametrize("file", ["path-traversal.dduf", "absolute-name.dduf", "backslash-name.dduf"])
def test_unpack_without_checks_still_confines_raw_traversal_names(file: str, guarded: dict) -> None:
    out = guarded["out"] / "unchecked"
    main(["unpack", "--no-check", str(HOSTILE / file), "-o", str(out)])  # the escaping entry is dropped or refused
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert all(p.resolve().is_relative_to(out.resolve()) for p in written)
    assert not any(p.name.startswith("evil") or "\\" in p.name for p in written), written
    assert not list(guarded["out"].parent.rglob("evil*"))


@pytest.mark.parametrize("component_record", [7, None, ["x"], {"storage_dtype": "float8_e4m3fn"}])
def test_info_survives_any_shape_of_index_component_record(tmp_path: Path, component_record, capsys) -> None:
    """Found by the loader fuzzer: index component records that are not objects, or fp8 storage without a
    compute dtype, made `dduf info` raise KeyError/TypeError."""
    from conftest import load_make_hostile

    mh = load_make_hostile()

    def forge(index: dict) -> dict:
        index["components"]["unet"] = component_record
        return index

    path = mh.write_valid(tmp_path / "forged.dduf", index=forge)
    assert main(["info", str(path)]) in (0, 1)
    assert main(["info", "--json", str(path)]) in (0, 1)


def test_weightless_config_sizes_are_bounded(tmp_path: Path, guarded: dict) -> None:
    """Found by the loader fuzzer: scheduler solver_order 2**31 was a MemoryError inside from_config."""
    import shutil

    from dduf_plus.format.pack import pack_folder

    folder = tmp_path / "p"
    shutil.copytree(ROOT / "fixtures" / "pipelines" / "tiny-sd", folder)
    cfg = folder / "scheduler" / "scheduler_config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"num_train_timesteps": 2**31}))
    _, error = try_load(pack_folder(folder, tmp_path / "p.dduf", quiet=True, check=False).path)  # pack refuses it (D015)
    # refused before anything is built, with validate's code (D015), as validate refuses it
    assert isinstance(error, errors.DDUFValidationError) and error.codes == ["D015"] and "num_train_timesteps" in str(error)
