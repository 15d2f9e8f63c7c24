"""What a new user meets first, tried as one would (docs/cli.md's promises): a failed write names the output
given, never the atomic writer's temporary file; a mistyped flag is reported by the command's own parser;
`-v` after the command says where it goes; `compress --level` states both ends of zstd's range; every
argument of `dduf unpack --help` says what it is."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

import pytest

from conftest import PIPELINES
from dduf_plus.cli import EXIT_USAGE, build_parser, main
from dduf_plus.cli._common import os_error_text
from dduf_plus.cli.suggest import command_parser
from dduf_plus.format.archive import DDUFArchive as DDUFArchiveReader

TINY_SD = PIPELINES / "tiny-sd"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def read_only_mkstemp(real=tempfile.mkstemp):
    """tempfile.mkstemp as on a read-only file system (tests may run as root, where chmod stops nothing)."""
    def mkstemp(suffix: str = "", prefix: str = "tmp", dir: str | None = None, text: bool = False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(str(dir), f"{prefix}x1y2z3ab{suffix}"))
    return mkstemp


def test_a_failed_export_names_the_output_not_its_temporary_file(capsys, packed, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import dduf_plus.storage.confined as confined  # the one atomic writer every command writes through

    monkeypatch.setattr(confined.tempfile, "mkstemp", read_only_mkstemp())
    out = tmp_path / "model.safetensors"
    code, err = run_cli(capsys, "export", str(packed["tiny-sd"]), "-o", str(out))
    assert code == EXIT_USAGE
    assert err.strip() == f"dduf export: error: cannot write {out}: {os.strerror(errno.EROFS)}", err
    assert ".tmp" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("failed", "output", "expected"), [
    ("out/.m.dduf.k2j4h5g6.tmp", "out/m.dduf", "cannot write out/m.dduf: Read-only file system"),
    ("out/.m.dduf.k2j4h5g6.tmp", "out/", "cannot write into out/: Read-only file system"),
    ("dir/unet/config.json", "dir", "cannot write dir/unet/config.json: Read-only file system"),
    ("dir", "dir", "cannot write dir: Read-only file system"),
    ("elsewhere/in.dduf", "out/m.dduf", "elsewhere/in.dduf: Read-only file system"),
])
def test_an_os_error_is_said_as_what_could_not_be_written(failed: str, output: str, expected: str) -> None:
    error = OSError(errno.EROFS, "Read-only file system", failed)
    assert os_error_text(error, output) == expected


@pytest.mark.parametrize(("output", "expected"), [
    ("out/m.dduf", "cannot write out/m.dduf: No space left on device"),
    ("out/", "cannot write into out/: No space left on device"),
    (None, "No space left on device"),
])
def test_a_full_disk_names_the_output(output: str | None, expected: str) -> None:
    """os.write() on a descriptor raises ENOSPC with no file name: was "dduf pack: error: No space left on device"."""
    assert os_error_text(OSError(errno.ENOSPC, "No space left on device"), output) == expected
    assert os_error_text(OSError(errno.EIO, "Input/output error"), output) == "Input/output error"


def short_writes(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """``module``'s os.write and os.pwrite as on a file system that fills up: the first write takes half its
    bytes (a short count, as write(2) returns), the next raises ENOSPC; copy_file_range is unavailable."""
    calls = []
    real_write, real_pwrite = os.write, os.pwrite

    def write(fd: int, data, *offset: int) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        half = bytes(data)[: max(1, len(data) // 2)]
        return real_pwrite(fd, half, *offset) if offset else real_write(fd, half)

    monkeypatch.setattr(module.os, "write", write)
    monkeypatch.setattr(module.os, "pwrite", write)
    monkeypatch.delattr(module.os, "copy_file_range", raising=False)


def test_unpack_on_a_full_disk_never_leaves_a_truncated_file(capsys, packed, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import dduf_plus.format.unpack as unpack_module

    short_writes(monkeypatch, unpack_module)
    target = tmp_path / "unpacked"
    code, err = run_cli(capsys, "unpack", str(packed["tiny-sd"]), "-o", str(target))
    monkeypatch.undo()
    with DDUFArchiveReader(packed["tiny-sd"]) as archive:
        truncated = [str(f) for f in target.rglob("*") if f.is_file()
                     and f.stat().st_size != archive.entries[f.relative_to(target).as_posix()].length]
    assert truncated == [] and code == EXIT_USAGE, (code, err, truncated)


def test_unpack_into_a_read_only_place_says_cannot_write(capsys, packed, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Was "Read-only file system: DIR", the reason first, unlike every other command's message."""
    import dduf_plus.storage.beneath as beneath
    import dduf_plus.storage.confined as confined

    monkeypatch.setattr(confined.tempfile, "mkstemp", read_only_mkstemp())  # where paths are written (Windows)
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):  # new files made beneath a folder descriptor
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(beneath.os, "open", read_only_open)
    target = tmp_path / "unpacked"
    code, err = run_cli(capsys, "unpack", str(packed["tiny-sd"]), "-o", str(target))
    assert code == EXIT_USAGE
    assert err.startswith(f"dduf unpack: error: cannot write {target}{os.sep}"), err
    assert err.rstrip().endswith(os.strerror(errno.EROFS)) and len(err.strip().splitlines()) == 1, err


def test_a_mistyped_flag_is_reported_by_the_command(capsys) -> None:
    """Was the top-level usage and `dduf: error:`, though docs/cli.md promises `dduf COMMAND: error: ...`."""
    code, err = run_cli(capsys, "validate", "x.dduf", "--jsn")
    assert code == EXIT_USAGE
    assert err.startswith("usage: dduf validate "), err
    assert err.strip().splitlines()[-1] == "dduf validate: error: unrecognized arguments: --jsn; did you mean --json?"


@pytest.mark.parametrize("flag", ["-v", "-vv", "--verbose"])
def test_verbose_after_the_command_says_where_it_goes(capsys, flag: str) -> None:
    code, err = run_cli(capsys, "info", "x.dduf", flag)
    assert code == EXIT_USAGE
    assert err.rstrip().endswith(f"{flag} goes before the command: dduf {flag} info ..."), err


@pytest.mark.parametrize("level", ["-200000", "23", "99"])
def test_compress_level_out_of_range_gives_both_ends(capsys, tmp_path: Path, level: str) -> None:
    """Was "zstd level -200000 is out of range (max 22)", after the input and output were checked."""
    code, err = run_cli(capsys, "compress", str(tmp_path / "missing.dduf"), "--level", level)
    assert code == EXIT_USAGE
    assert f"argument --level: {level} is out of range: -131072 (fastest) to 22 (smallest)" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("level", ["-131072", "-5", "0", "22"])
def test_compress_accepts_zstds_whole_range(level: str) -> None:
    args = build_parser("compress").parse_args(["compress", "x.dduf", "--level", level])
    assert args.level == int(level)


def test_every_unpack_argument_has_a_help_text() -> None:
    parser = command_parser(build_parser("unpack"), "unpack")
    assert parser is not None and parser.description
    assert [a.dest for a in parser._actions if not a.help] == []


def documented_everywhere() -> list[tuple[str, str]]:
    """(page, command line) for every `dduf ...` of docs/*.md: inline code and code-block lines (a `$ ` prompt,
    a trailing comment and a line-continuing backslash dropped). tests/test_docs_cli.py checks README.md and
    docs/cli.md's synopsis to their defaults; the other pages' examples name flags that must exist too."""
    from test_docs_cli import INLINE

    from conftest import ROOT

    found = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for i, part in enumerate(doc.read_text().replace("\\|", "|").split("```")):
            if i % 2 == 0:
                found += [(doc.name, m[1]) for m in INLINE.finditer(part)]
                continue
            for line in part.splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("dduf "):
                    found.append((doc.name, line.split("  #")[0].rstrip("\\ ").strip()))
    return found


def unknown_flags(line: str) -> list[str]:
    """The command (when not one) or the flags of ``line`` that `dduf COMMAND` does not have."""
    from test_docs_cli import TOP_LEVEL, flag_values, options

    from dduf_plus.cli import COMMANDS

    command = line.split()[1]
    if command.endswith(":") or command.isupper():  # a quoted message (`dduf validate: error:`), a placeholder
        return []
    if command.startswith("-"):
        return [] if command in TOP_LEVEL else [command]
    if command not in COMMANDS:
        return [command]
    known = options(command)
    return [flag for flag, _ in flag_values(line) if flag not in known and flag not in TOP_LEVEL]


def test_every_docs_page_names_only_flags_that_exist() -> None:
    found = documented_everywhere()
    assert len({page for page, _ in found}) >= 8 and len(found) > 200  # the scan reads the pages
    wrong = [(page, line, bad) for page, line in found if (bad := unknown_flags(line))]
    assert wrong == []
    assert unknown_flags("dduf pack S -o O --exlude vae") == ["--exlude"]
    assert unknown_flags("dduf pakc S") == ["pakc"]


def test_info_help_names_every_kind_of_source_it_reads() -> None:
    """`dduf info CKPT.safetensors` and `dduf info LORA.safetensors` work (docs/cli.md), but the help's SOURCE
    named archives, folders and repos only."""
    parser = command_parser(build_parser("info"), "info")
    assert parser is not None
    source = next(a for a in parser._actions if a.dest == "source")
    assert all(word in (source.help or "") for word in (".dduf", "folder", "Hub repo", "checkpoint", "LoRA"))


@pytest.mark.parametrize("command", ["pack", "complete"])
@pytest.mark.parametrize("name", ["model.dduf.zst", "model.zst"])
def test_an_archive_is_never_written_under_a_zst_name(capsys, packed, tmp_path: Path, command: str,
                                                      name: str) -> None:
    """Was a plain archive named .zst, which `dduf validate` then refused (Z021: not a zstd stream)."""
    source = str(TINY_SD) if command == "pack" else str(packed["tiny-sd"])
    code, err = run_cli(capsys, command, source, "-o", str(tmp_path / name), "-q")
    assert code == EXIT_USAGE
    suggested = tmp_path / "model.dduf"
    assert err.strip() == (f"dduf {command}: error: {tmp_path / name}: this writes a plain archive, not a .zst; "
                           f"write {suggested}, then `dduf compress {suggested}` makes {suggested}.zst"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("name", "suggested"), [("model", "model.dduf"), ("model.zip", "model.dduf")])
def test_an_archive_without_the_dduf_name_is_written_with_a_warning(capsys, caplog, tmp_path: Path, name: str,
                                                                    suggested: str) -> None:
    """Was silent: such an archive on the Hub is found by no load_dduf("org/repo") (nor dduf_file=)."""
    caplog.set_level(logging.WARNING, logger="dduf_plus")
    code, _ = run_cli(capsys, "pack", str(TINY_SD), "-o", str(tmp_path / name), "-q")
    assert code == 0 and (tmp_path / name).is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / name} does not end in .dduf: the archive is valid, but load_dduf('org/repo') and dduf_file= "
        f"find a Hub repo's archive by that name; consider -o {tmp_path / suggested}"]
    caplog.clear()
    assert run_cli(capsys, "pack", str(TINY_SD), "-o", str(tmp_path / "fine.dduf"), "-q")[0] == 0
    assert caplog.records == []


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a LoRA file, a LoRA archive holding adapters pixel and ink) on the tiny-sd fixture."""
    from lora_files import diffusers_lora

    out = tmp_path_factory.mktemp("loras")
    pixel = diffusers_lora(TINY_SD, out / "pixel", {"unet": ["to_q", "to_v"]})
    ink = diffusers_lora(TINY_SD, out / "ink", {"unet": ["to_k"]}, rank=2, seed=3)
    archive = out / "styles.dduf"
    assert main(["pack", f"pixel={pixel}@0.8", "--lora", f"ink={ink}@0.5", "--base", str(TINY_SD),
                 "-o", str(archive), "-q"]) == 0
    return pixel, archive


def test_a_mistyped_adapter_gets_the_closest_name(capsys, two_adapters, tmp_path: Path) -> None:
    """Was exit 1, "no adapter 'inc' (it has: pixel, ink)": a name the user gives is checked like a component's."""
    _, archive = two_adapters
    code, err = run_cli(capsys, "export", str(archive), "--adapter", "inc", "-o", str(tmp_path / "x.safetensors"))
    assert code == EXIT_USAGE
    assert err.strip() == (f"dduf export: error: --adapter inc: not an adapter of {archive} (did you mean ink?); "
                           "its adapters: pixel, ink"), err
    assert list(tmp_path.iterdir()) == []
    assert run_cli(capsys, "export", str(archive), "--adapter", "ink", "-o", str(tmp_path / "ink.safetensors"),
                   "-q")[0] == 0


@pytest.mark.parametrize("weight", ["abc", "0,8"])
def test_a_lora_weight_that_is_no_number_is_said_so(capsys, two_adapters, tmp_path: Path, weight: str) -> None:
    """Was "SRC pixel=FILE@abc does not exist": the whole text was taken for a folder."""
    lora, _ = two_adapters
    source = f"pixel={lora}@{weight}"
    code, err = run_cli(capsys, "pack", source, "--base", str(TINY_SD), "-o", str(tmp_path / "p.dduf"))
    assert code == EXIT_USAGE
    assert err.strip() == (f"dduf pack: error: {source}: weight {weight!r} is not a number ([NAME=]FILE[@WEIGHT], "
                           f"e.g. {lora}@0.8)"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--queue", "-5"], "argument --queue: -5: at least 0"),
    (["--time-limit", "0"], "argument --time-limit: 0: a positive number of seconds"),
    (["--time-limit", "-1"], "argument --time-limit: -1: a positive number of seconds"),
    (["--time-limit", "nan"], "argument --time-limit: nan: a positive number of seconds"),
])
def test_serve_refuses_limits_that_cannot_work(capsys, argv: list[str], message: str) -> None:
    """Were taken: a negative --queue silently as 0, a --time-limit of 0 or less made every validation a 504."""
    code, err = run_cli(capsys, "serve", *argv)
    assert code == EXIT_USAGE
    assert err.strip().splitlines()[-1] == f"dduf serve: error: {message}", err


def test_serve_accepts_a_queue_of_zero() -> None:
    args = build_parser("serve").parse_args(["serve", "--queue", "0", "--time-limit", "0.5"])
    assert (args.queue, args.time_limit) == (0, 0.5)


def test_export_component_typo_gets_the_closest_name(capsys, packed, tmp_path: Path) -> None:
    """Was exit 2 with the list alone; a component the family has but the pipeline lacks was exit 1."""
    code, err = run_cli(capsys, "export", str(packed["tiny-sd"]), "-o", str(tmp_path / "u.safetensors"),
                        "--component", "unte")
    assert code == EXIT_USAGE and "(did you mean unet?)" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["compress", "decompress"])
@pytest.mark.parametrize("threads", ["-7", "100000", "two"])
def test_threads_out_of_range_are_refused_at_once(capsys, packed, tmp_path: Path, command: str, threads: str) -> None:
    """Were taken silently (-7 as one per CPU; 100000 handed to zstd)."""
    code, err = run_cli(capsys, command, str(packed["tiny-sd"]), "-o", str(tmp_path / "x"), "--threads", threads)
    assert code == EXIT_USAGE and "--threads" in err and ("out of range" in err or "not an integer" in err), err
    assert list(tmp_path.iterdir()) == []


def test_unpack_force_replaces_a_linked_file_and_refuses_a_linked_folder(capsys, packed, tmp_path: Path) -> None:
    """A link in the output folder: the file link is replaced (never written through; it was refused as if the
    archive's entry escaped, exit 1); a folder link leading out is refused naming it (exit 2), nothing written."""
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model_index.json").symlink_to(victim)
    code, err = run_cli(capsys, "unpack", str(packed["tiny-sd"]), "-o", str(out), "--force", "-q")
    assert code == 0, err
    assert victim.read_text() == "keep" and not (out / "model_index.json").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "unet").symlink_to(elsewhere, target_is_directory=True)
    code, err = run_cli(capsys, "unpack", str(packed["tiny-sd"]), "-o", str(fresh), "-q")
    assert code == EXIT_USAGE and "unet is a link to" in err and "outside" in err, err
    assert list(elsewhere.iterdir()) == [] and [p.name for p in fresh.iterdir()] == ["unet"]
