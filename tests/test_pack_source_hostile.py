"""``dduf pack`` of a folder someone else wrote (a downloaded tarball, a shared snapshot): FIFOs, devices, links
leading out of the folder, huge sparse small files, files that change while they are packed, a hostile output
path. Each gets a DDUFError naming the file and the rule, never a hang, never unbounded memory, never a file
from outside the folder in the archive. Cases that would hang run in a daemon thread with a deadline: a
regression fails the test (and the FIFO is opened for writing to release the stuck thread) instead of hanging
the suite."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFPackError
from dduf_plus.format import spec
from dduf_plus.format.pack import pack_folder, plan_folder, write_archive

DEADLINE = 60.0  # seconds: far above a tiny pack (well under one), far below a CI job's limit
BIG = 10 << 30  # a sparse 10 GB file: reading it whole would take 10 GB of memory
SECRET = b"root:x:0:0:secret the user never meant to publish\n"

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX links and FIFOs")


def _tiny(tmp_path: Path) -> Path:
    root = tmp_path / "tiny-dit"
    shutil.copytree(PIPELINES / "tiny-dit", root)
    return root


def _secret(tmp_path: Path) -> Path:
    outside = tmp_path / "home" / ".ssh"
    outside.mkdir(parents=True)
    (outside / "id_rsa").write_bytes(SECRET)
    return outside / "id_rsa"


def _within_deadline(fn: Callable[[], Any], fifos: Sequence[Path] = ()) -> Any:
    """``fn()``'s result (or its exception, raised here) if it ends within :data:`DEADLINE`; else the test fails,
    and each FIFO is opened for writing once so a thread stuck opening it to read gets an empty file and ends."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(DEADLINE)
    if worker.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        worker.join(5)
        pytest.fail(f"still running after {DEADLINE} s (blocked on a FIFO or reading without bound)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _no_output(out: Path) -> None:
    assert not out.exists() and not out.is_symlink()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _entries(archive: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(archive) as z:
        return {n: z.read(n) for n in z.namelist()}


# --- special files: FIFOs, devices, folders named like files ------------------------------------------------
def test_fifo_in_a_component_is_refused_at_planning(tmp_path: Path) -> None:
    """Bug on main: the writer's blocking open of the FIFO waited for a writer for ever."""
    root = _tiny(tmp_path)
    fifo = root / "vae" / "extra.json"
    os.mkfifo(fifo)
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=r"vae/extra\.json.*FIFO"):
        _within_deadline(lambda: pack_folder(root, out, quiet=True), [fifo])
    _no_output(out)


def test_fifo_with_a_type_dduf_does_not_store_is_skipped_unopened(tmp_path: Path) -> None:
    """Pin: a FIFO named like a file pack leaves out anyway (README.md) is skipped by name, never opened."""
    root = _tiny(tmp_path)
    fifo = root / "vae" / "notes.md"
    os.mkfifo(fifo)
    os.mkfifo(root / "README.txt")
    result = _within_deadline(lambda: pack_folder(root, tmp_path / "out.dduf", quiet=True), [fifo, root / "README.txt"])
    assert ("vae/notes.md", "file type not allowed in DDUF") in [tuple(s) for s in result.skipped]


def test_model_index_fifo_is_refused_as_not_a_regular_file(tmp_path: Path) -> None:
    root = _tiny(tmp_path)
    (root / spec.MODEL_INDEX).unlink()
    os.mkfifo(root / spec.MODEL_INDEX)
    with pytest.raises(DDUFPackError, match=r"model_index\.json.*(FIFO|not a regular file)"):
        _within_deadline(lambda: plan_folder(root), [root / spec.MODEL_INDEX])


def test_fifo_swapped_in_after_planning_is_refused_by_the_writer(tmp_path: Path) -> None:
    """Bug on main: a file replaced by a FIFO between planning and writing hung the writer's open."""
    root = _tiny(tmp_path)
    plan = plan_folder(root)
    config = root / "vae" / "config.json"
    config.unlink()
    os.mkfifo(config)
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=r"vae/config\.json"):
        _within_deadline(lambda: write_archive(out, plan.model_index, plan.model_index_bytes, plan.sources,
                                               quiet=True), [config])
    _no_output(out)


def test_link_swapped_in_after_planning_is_not_followed(tmp_path: Path) -> None:
    """Bug on main: a file replaced by a link leading out between planning and writing was followed and the
    link's target packed. The plan holds real paths, opened without following links (O_NOFOLLOW)."""
    root = _tiny(tmp_path)
    plan = plan_folder(root)
    config = root / "vae" / "config.json"
    config.unlink()
    config.symlink_to(_secret(tmp_path))
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=r"vae/config\.json.*became a link"):
        write_archive(out, plan.model_index, plan.model_index_bytes, plan.sources, quiet=True)
    _no_output(out)


def test_link_to_a_device_is_refused(tmp_path: Path) -> None:
    """Bug on main (an empty entry read from /dev/zero's size 0, refused only by the final check as bad JSON):
    a device is outside the folder (Z008), refused before it is opened."""
    root = _tiny(tmp_path)
    (root / "vae" / "extra.json").symlink_to("/dev/zero")
    with pytest.raises(DDUFPackError, match=r"vae/extra\.json: Z008 is a link to /dev/zero"):
        _within_deadline(lambda: plan_folder(root))


def test_folder_named_like_a_file_is_refused(tmp_path: Path) -> None:
    """Pin: DDUF has no sub-folders; one named like a config is refused, naming it."""
    root = _tiny(tmp_path)
    (root / "vae" / "extra.json").mkdir()
    with pytest.raises(DDUFPackError, match=r"vae/extra\.json.*sub-folders"):
        plan_folder(root)


def test_dangling_link_is_refused_naming_it(tmp_path: Path) -> None:
    root = _tiny(tmp_path)
    (root / "vae" / "extra.json").symlink_to("missing.json")
    with pytest.raises(DDUFPackError, match=r"vae/extra\.json"):
        plan_folder(root)


# --- links leading out of the folder ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vae/notes.txt", "tokenizer/vocab.txt", "vae/config.json",
                                  "tokenizer/chat_template.jinja", spec.MODEL_INDEX])
def test_link_out_of_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    """Bug on main: the link was followed and the secret it points at packed (or, for a template, folded in)."""
    root = _tiny(tmp_path)
    secret = _secret(tmp_path)
    if name == spec.MODEL_INDEX:  # the link's target must parse for the bug to show: a real model_index.json
        secret.write_bytes((root / name).read_bytes())
    (root / name).unlink(missing_ok=True)
    (root / name).symlink_to(secret)
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError) as info:
        pack_folder(root, out, quiet=True)
    message = str(info.value)
    assert "Z008" in message and name in message and str(secret) in message and "copy the file" in message
    _no_output(out)


def test_component_folder_linked_out_is_refused(tmp_path: Path) -> None:
    """Bug on main: ``vae -> ~/elsewhere`` packed whatever that folder holds."""
    root = _tiny(tmp_path)
    elsewhere = tmp_path / "elsewhere" / "vae"
    elsewhere.parent.mkdir()
    shutil.move(root / "vae", elsewhere)
    (root / "vae").symlink_to(elsewhere)
    with pytest.raises(DDUFPackError, match=r"vae/: Z008 is a link to .*elsewhere/vae"):
        plan_folder(root)


def test_links_inside_the_folder_keep_working(tmp_path: Path) -> None:
    """Pin: a link to another file of the same folder (a shared config, a deduplicated tokenizer) is packed."""
    root = _tiny(tmp_path)
    shared = root / "shared"
    shared.mkdir()
    shutil.move(root / "vae" / "config.json", shared / "vae-config.json")
    (root / "vae" / "config.json").symlink_to(Path("..") / "shared" / "vae-config.json")
    result = pack_folder(root, tmp_path / "out.dduf", quiet=True)
    assert _entries(result.path)["vae/config.json"] == (shared / "vae-config.json").read_bytes()


def _snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """A Hugging Face cache layout built by hand: ``models--org--tiny/blobs/<sha256>`` and
    ``snapshots/<rev>/...`` relative links into ``blobs/`` (what huggingface_hub writes)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    source = PIPELINES / "tiny-dit"
    for path in sorted(source.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            link = snap / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blobs / digest, link.parent))
    return repo, snap


def test_hub_cache_snapshot_packs(tmp_path: Path) -> None:
    """Pin: a snapshot's files are links into the repo's blobs/ (outside the snapshot folder, inside the repo's
    cache folder): packed, byte for byte."""
    _repo, snap = _snapshot(tmp_path)
    result = pack_folder(snap, tmp_path / "out.dduf", quiet=True)
    entries = _entries(result.path)
    assert entries["vae/diffusion_pytorch_model.safetensors"] == \
        (PIPELINES / "tiny-dit" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert entries[spec.MODEL_INDEX] == (PIPELINES / "tiny-dit" / spec.MODEL_INDEX).read_bytes()


def test_pipeline_in_a_snapshot_sub_folder_packs(tmp_path: Path) -> None:
    """A pipeline in a sub-folder of a repo (``snapshots/<rev>/pipe``): its links into the repo's blobs/ stay
    inside the boundary, the repo's cache folder from anywhere inside a snapshot. Bug on main in the folder
    loader (the sub-folder was the boundary: Z008 for every file); the packer now shares that boundary."""
    from dduf_plus.format.source_folder import boundary_of

    repo, snap = _snapshot(tmp_path)
    pipe = snap / "pipe"
    pipe.mkdir()
    for child in sorted(snap.iterdir()):
        if child != pipe:
            shutil.move(child, pipe / child.name)
    for link in sorted(pipe.rglob("*")):  # one level deeper: each relative link gets one more ".."
        if link.is_symlink():
            target = os.readlink(link)
            link.unlink()
            link.symlink_to(os.path.join("..", target))
    assert boundary_of(pipe) == boundary_of(snap) == repo
    result = pack_folder(pipe, tmp_path / "out.dduf", quiet=True)
    assert _entries(result.path)[spec.MODEL_INDEX] == (PIPELINES / "tiny-dit" / spec.MODEL_INDEX).read_bytes()


def test_hub_cache_snapshot_link_out_of_the_repo_is_refused(tmp_path: Path) -> None:
    repo, snap = _snapshot(tmp_path)
    secret = _secret(tmp_path)
    (snap / "tokenizer" / "vocab.txt").symlink_to(secret)
    with pytest.raises(DDUFPackError, match=r"tokenizer/vocab\.txt: Z008 is a link to .*id_rsa") as info:
        plan_folder(snap)
    assert str(repo) in str(info.value)


def test_loader_and_packer_share_one_boundary() -> None:
    """One implementation: the loader's ``boundary_of`` is the format floor's."""
    from dduf_plus.format import source_folder
    from dduf_plus.loading import folder_source

    assert folder_source.boundary_of is source_folder.boundary_of


# --- small files read whole ----------------------------------------------------------------------------------
def _sparse(path: Path, size: int = BIG) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize(("name", "code"), [
    (spec.MODEL_INDEX, "D013"),
    ("vae/config.json", "D013"),
    ("tokenizer/tokenizer_config.json", "D013"),
    ("tokenizer/tokenizer.json", "D014"),
    ("tokenizer/vocab.txt", "D014"),
])
def test_huge_small_file_is_refused_from_its_size(tmp_path: Path, name: str, code: str) -> None:
    """Bug on main: model_index.json was read whole (10 GB of memory), the others copied whole into the archive
    (10 GB of disk) before the final check refused it. Now refused from the size, before a byte is read."""
    root = _tiny(tmp_path)
    _sparse(root / name)
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=rf"{name}: {code} "):
        _within_deadline(lambda: pack_folder(root, out, quiet=True))
    _no_output(out)


def test_huge_chat_template_is_refused_from_its_size(tmp_path: Path) -> None:
    """Bug on main: the template was read whole to be folded into tokenizer_config.json."""
    root = _tiny(tmp_path)
    _sparse(root / "tokenizer" / "chat_template.jinja")
    with pytest.raises(DDUFPackError, match=r"tokenizer/chat_template\.jinja: D013"):
        _within_deadline(lambda: plan_folder(root))


def _with_guider(root: Path) -> Path:
    index = json.loads((root / spec.MODEL_INDEX).read_text())
    index["guider"] = ["diffusers", "ClassifierFreeGuidance"]
    (root / spec.MODEL_INDEX).write_text(json.dumps(index))
    (root / "guider").mkdir()
    guider = root / "guider" / "guider_config.json"
    guider.write_text(json.dumps({"_class_name": "ClassifierFreeGuidance", "guidance_scale": 5.0}))
    return guider


def test_guider_alias_copy_is_planned_and_huge_one_refused(tmp_path: Path) -> None:
    """The guider's config.json copy is read bounded: a 10 GB guider_config.json is refused from its size (bug on
    main: read whole for the copy)."""
    root = _tiny(tmp_path)
    guider = _with_guider(root)
    plan = plan_folder(root)
    copy = next(s for s in plan.sources if s.name == "guider/config.json")
    assert copy.data == guider.read_bytes()
    _sparse(guider)
    with pytest.raises(DDUFPackError, match=r"guider/guider_config\.json: D013"):
        _within_deadline(lambda: plan_folder(root))


def test_bounded_read_never_reads_past_its_limit(tmp_path: Path) -> None:
    """The reader of small files asks for at most limit + 1 bytes, however large the file is now (a file that
    grew after its size was checked is refused, not read on)."""
    from dduf_plus.storage.fd_io import read_at_most

    path = tmp_path / "grown.json"
    path.write_bytes(b"x" * 1000)
    assert read_at_most(path, 100) == b"x" * 101
    assert read_at_most(path, 5000) == b"x" * 1000
    os.mkfifo(tmp_path / "fifo.json")
    assert _within_deadline(lambda: read_at_most(tmp_path / "fifo.json", 100), [tmp_path / "fifo.json"]) is None


# --- names, hidden files, case ------------------------------------------------------------------------------
def test_hidden_files_and_folders_are_skipped_unread(tmp_path: Path) -> None:
    """Pin: ``.git/``, ``.cache/`` and hidden files are never stored (a secret kept there stays there)."""
    root = _tiny(tmp_path)
    (root / ".git").mkdir()
    (root / ".git" / "config.json").write_bytes(SECRET)
    (root / "vae" / ".token.json").write_bytes(SECRET)
    os.mkfifo(root / "vae" / ".pipe.json")
    result = _within_deadline(lambda: pack_folder(root, tmp_path / "out.dduf", quiet=True), [root / "vae" / ".pipe.json"])
    assert all(SECRET not in data for data in _entries(result.path).values())
    reasons = {s.path: s.reason for s in result.skipped}
    assert reasons[".git/"] == "hidden folder" and reasons["vae/.token.json"] == "hidden file"


def test_name_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    """Pin: a name no DDUF reader can decode is refused, shown with its bytes escaped."""
    root = _tiny(tmp_path)
    with open(os.path.join(os.fsencode(root / "vae"), b"extra\xff.json"), "wb") as f:
        f.write(b"{}")
    with pytest.raises(DDUFPackError, match=r"vae/extra\\xff\.json: Z007 file name is not valid UTF-8"):
        plan_folder(root)


def test_more_files_than_an_archive_may_hold_is_refused_before_copying(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug on main: 10,000 small files were all copied, then the finished archive refused (Z005). The cap is
    lowered here so the folder stays small (the check reads it at run time, as the validator does)."""
    monkeypatch.setattr(spec, "MAX_ENTRIES", 40)
    root = _tiny(tmp_path)
    for i in range(40):
        (root / "vae" / f"n{i}.txt").write_bytes(b"")
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=r"vae: Z005 \d+ entries is more than the 40"):
        pack_folder(root, out, quiet=True)
    _no_output(out)
    for i in range(25):  # spread over components: the whole archive's count
        (root / "vae" / f"n{i}.txt").unlink()
        (root / "transformer" / f"n{i}.txt").write_bytes(b"")
    with pytest.raises(DDUFPackError, match=r"tiny-dit: Z005 \d+ entries is more than the 40"):
        pack_folder(root, out, quiet=True)


def test_case_collision_is_packed_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pin: ``Config.json`` beside ``config.json`` is two entries on Linux, one file on macOS/Windows: packed
    (nothing is lost) and said (Z010, a warning ``--strict`` refuses)."""
    root = _tiny(tmp_path)
    (root / "vae" / "Config.json").write_bytes((root / "vae" / "config.json").read_bytes())
    with caplog.at_level(logging.WARNING):
        result = pack_folder(root, tmp_path / "out.dduf", quiet=True)
    assert {"vae/Config.json", "vae/config.json"} <= set(_entries(result.path))
    assert "Z010" in caplog.text


# --- files that change while packing ------------------------------------------------------------------------
def _hashed_then(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Run ``change()`` once, in the writer's hashing worker after the source was opened and before it is hashed:
    whether the copy ran before or after it, the bytes copied and the bytes hashed may differ (no sleeps)."""
    import dduf_plus.format.writer as writer_mod

    original, done = writer_mod._hash_fd, threading.Event()

    def change_then_hash(*args: Any, **kwargs: Any) -> Any:
        if not done.is_set():
            done.set()
            change()
        return original(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "_hash_fd", change_then_hash)


def test_file_rewritten_while_packing_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug on main: a source rewritten in place (same size) while it was packed was published with the CRC-32 and
    sha256 of one version over the bytes of another when the copy ran first (an archive every CRC check refuses)."""
    from dduf_plus.format.writer import DDUFWriter

    source = tmp_path / "config.json"
    source.write_bytes(b'{"a": 1}')
    os.utime(source, ns=(10**18, 10**18))  # written earlier (a downloaded file): a rewrite now moves its mtime
    out = tmp_path / "out" / "w.dduf"
    out.parent.mkdir()
    _hashed_then(monkeypatch, lambda: source.write_bytes(b'{"b": 2}'))

    def write() -> None:
        with DDUFWriter(out, fsync=False) as w:
            w.add_bytes(spec.MODEL_INDEX, b"{}")
            w.hash_ahead([("vae/config.json", source)])
            w.add_file("vae/config.json", source)

    with pytest.raises(DDUFPackError, match=r"vae/config\.json.*changed while"):
        _within_deadline(write)
    _no_output(out)


def test_file_that_shrinks_while_packing_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin: a source truncated while it is packed leaves no archive (atomic output)."""
    root = _tiny(tmp_path)
    weights = root / "vae" / "diffusion_pytorch_model.safetensors"
    _hashed_then(monkeypatch, lambda: os.truncate(weights, 1000))
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFError):
        _within_deadline(lambda: pack_folder(root, out, quiet=True))
    _no_output(out)


# --- the output --------------------------------------------------------------------------------------------
def test_force_over_a_link_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    """Pin: ``--force`` over an output that is a link writes a new file there; the link's target is untouched."""
    from dduf_plus.cli import main

    root = _tiny(tmp_path)
    victim = _secret(tmp_path)
    out = tmp_path / "out.dduf"
    out.symlink_to(victim)
    assert main(["pack", str(root), "-o", str(out), "--force", "--quiet"]) == 0
    assert victim.read_bytes() == SECRET
    assert not out.is_symlink() and zipfile.is_zipfile(out)


@pytest.mark.parametrize("name", ["vae/config.json", spec.MODEL_INDEX])
def test_output_that_is_a_source_file_is_refused(tmp_path: Path, name: str) -> None:
    """Bug on main: ``-o FOLDER/vae/config.json --force`` replaced the source file with the archive (lost)."""
    from dduf_plus.cli import main

    root = _tiny(tmp_path)
    before = (root / name).read_bytes()
    assert main(["pack", str(root), "-o", str(root / name), "--force", "--quiet"]) != 0
    assert (root / name).read_bytes() == before
    with pytest.raises(DDUFPackError, match=r"a file of the folder being packed"):
        pack_folder(root, root / "vae" / ".." / name, quiet=True)


def test_force_over_a_fifo_replaces_it_without_blocking(tmp_path: Path) -> None:
    from dduf_plus.cli import main

    root = _tiny(tmp_path)
    out = tmp_path / "out.dduf"
    os.mkfifo(out)
    assert _within_deadline(lambda: main(["pack", str(root), "-o", str(out), "--force", "--quiet"]), [out]) == 0
    assert out.is_file() and zipfile.is_zipfile(out)


# --- JSON the packer parses itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vae/quanto_qmap.json", "transformer/config.json"])
def test_deeply_nested_json_the_packer_parses_is_refused(tmp_path: Path, name: str) -> None:
    """Bug on main: ``json.loads`` of 100,000 nested brackets (a quanto map, a config naming a quantization)
    raised a bare RecursionError. Now the budgeted reader refuses it (D013), naming the file."""
    from dduf_plus.packing.pack import pack

    root = _tiny(tmp_path)
    deep = b"[" * 100_000 + b"]" * 100_000
    if name.endswith("config.json"):  # the packer parses a config only when it names a quantization
        deep = b'{"quantization_config": {"quant_method": "bitsandbytes"}, "x": ' + deep + b"}"
    (root / name).write_bytes(deep)
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFPackError, match=rf"{name}: D013 nests deeper"):
        pack(root, out, quiet=True)
    _no_output(out)


def test_a_deeply_nested_config_given_to_quantize_is_refused(tmp_path: Path) -> None:
    """``--quantize`` parses the component's config.json itself: the budgeted reader refuses 100,000 nested
    brackets (D013, naming the entry) where ``json.loads`` raised a bare RecursionError."""
    from dduf_plus.errors import DDUFError
    from dduf_plus.packing.pack import pack

    pytest.importorskip("bitsandbytes")
    root = _tiny(tmp_path)
    (root / "transformer" / "config.json").write_bytes(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    out = tmp_path / "out.dduf"
    with pytest.raises(DDUFError, match=r"transformer/config.json.*D013|D013.*transformer/config.json"):
        pack(root, out, quiet=True, quantize={"transformer": "bnb-int8"})
    _no_output(out)


def test_the_identity_check_never_waits_on_a_fifo(tmp_path: Path) -> None:
    """``pack --base`` maps each compared file (the folder's and BASE's): one that became a FIFO since it was
    listed is refused by name (DDUFPackError), where a plain ``open()`` waited for a writer for ever. Conversion
    and quantization open their sources through the same function (format/writer.py ``open_source_file``)."""
    from dduf_plus.packing.identity import ComponentBytes

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)

    def compare() -> None:
        with ComponentBytes.from_paths("vae", {"config.json": fifo}) as copy:
            copy.buffer("config.json")

    with pytest.raises(DDUFPackError, match=r"config.json.*not a regular file"):
        _within_deadline(compare, [fifo])
