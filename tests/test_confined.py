"""dduf_plus.storage.confined: the one place writes and removals go through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dduf_plus.errors import DDUFError, DDUFFormatError, DDUFPathError
from dduf_plus.storage.confined import (
    Confined,
    component_name_problem,
    name_problem,
    plain_name,
)


@pytest.mark.parametrize("name", ["", " ", ".", "..", "a/b", "/abs", "a\\b", "C:evil", "x\x1b[2J", "x\x00y",
                                  "bidi\u202etxt", "line\u2028sep", "a" * 256, 7, None])
def test_not_plain(name: object) -> None:
    assert name_problem(name) is not None
    with pytest.raises(DDUFFormatError, match="refusing"):
        plain_name(name, "component")


@pytest.mark.parametrize("name", ["unet", "text_encoder_2", "config.json", "model.fp16.safetensors", "vae-1", "ünet"])
def test_plain(name: str) -> None:
    assert plain_name(name) == name


def test_component_names_are_identifiers() -> None:
    assert component_name_problem("text_encoder") is None
    assert "identifier" in component_name_problem("vae-1")
    assert component_name_problem("../x") is not None


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Confined, Path]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    return Confined(tmp_path / "cache"), outside


def test_paths_stay_inside(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    assert cache.path("views", "abc", "vae") == cache.root / "views" / "abc" / "vae"
    for parts in (("..", "outside"), ("/tmp",), ("a/../../outside",)):
        with pytest.raises(DDUFError):
            cache.path(*parts)
    with pytest.raises(DDUFPathError):
        cache.check(cache.root)  # the root itself is never a target
    with pytest.raises(DDUFPathError):
        cache.check(outside / "keep.txt")


def test_a_symlinked_folder_does_not_lead_outside(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    os.symlink(outside, cache.root / "views")
    with pytest.raises(DDUFPathError):
        cache.path("views", "x")
    with pytest.raises(DDUFPathError):
        cache.remove_tree(cache.root / "views" / "keep.txt")
    with pytest.raises(DDUFPathError):
        cache.write_bytes(cache.root / "views" / "evil.txt", b"x")
    cache.remove_tree(cache.root / "views")  # the link itself, never what it points to
    assert (outside / "keep.txt").read_text() == "keep" and not (cache.root / "views").exists()


def test_temp_files_are_exclusive_and_cleaned_up(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    with pytest.raises(RuntimeError), cache.temp_file() as (fd, tmp):
        assert tmp.parent == cache.root and tmp.name.startswith(".tmp-")
        os.write(fd, b"x")
        raise RuntimeError("fail")
    assert not tmp.exists()
    with cache.temp_dir() as folder:
        (folder / "f").write_text("x")
    assert not folder.exists()


def test_write_bytes_is_atomic_and_replaces(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    target = cache.path("memo.json")
    cache.write_bytes(target, b"1")
    cache.write_bytes(target, b"2")
    assert target.read_bytes() == b"2" and sorted(p.name for p in cache.root.iterdir()) == ["memo.json"]


def test_replace_never_follows_a_planted_link(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    planted = cache.root / "entry"
    os.symlink(outside / "keep.txt", planted)
    with cache.temp_file() as (fd, tmp):
        os.write(fd, b"new")
        os.close(fd)
        cache.replace(tmp, planted)  # replaces the link, not the file it points at
    assert planted.read_bytes() == b"new" and not planted.is_symlink()
    assert (outside / "keep.txt").read_text() == "keep"


def test_atomic_file_appears_whole_or_not_at_all(layout: tuple[Confined, Path]) -> None:
    """The one temp-file-then-rename writer (writer, zst, zst cache, unpack, quanto save, caches use it)."""
    cache, outside = layout
    target = cache.root / "sub" / "archive.dduf"
    with pytest.raises(RuntimeError), cache.atomic(target, mode=0o644) as out:
        out.file.write(b"half")
        raise RuntimeError("Ctrl-C, a full disk...")
    assert not target.exists() and list((cache.root / "sub").iterdir()) == []
    with cache.atomic(target, mode=0o644) as out:
        assert out.tmp.parent == target.parent and out.tmp.name.startswith(".archive.dduf.")
        out.file.write(b"whole")  # buffered: flushed (and fsynced) before the rename
    assert target.read_bytes() == b"whole" and out.fd == -1
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o644 & ~umask
    cache.write_bytes(cache.root / "secret", b"s")  # mode None: mkstemp's private 0600
    assert (cache.root / "secret").stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="already finished"):
        out.commit()
    out.abort()  # a no-op once finished: the committed file stays
    assert target.read_bytes() == b"whole"


def test_atomic_file_refuses_outside_and_never_follows_a_planted_link(layout: tuple[Confined, Path]) -> None:
    cache, outside = layout
    with pytest.raises(DDUFPathError):
        cache.atomic(outside / "evil")
    planted = cache.root / "entry"
    os.symlink(outside / "keep.txt", planted)
    with cache.atomic(planted, fsync=False) as out:
        out.file.write(b"new")
    assert planted.read_bytes() == b"new" and not planted.is_symlink()
    assert (outside / "keep.txt").read_text() == "keep"
