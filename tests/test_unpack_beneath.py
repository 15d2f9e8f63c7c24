"""``dduf unpack`` writes beneath the output folder's descriptor (``storage/beneath.py``): a folder swapped for a
link leading out between a check and a write is never written through; links inside the output still work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dduf_plus.errors import DDUFPathError, DDUFUsageError
from dduf_plus.format.unpack import unpack
from dduf_plus.storage import beneath
from dduf_plus.storage.beneath import Beneath
from dduf_plus.storage.fd_io import write_all

pytestmark = pytest.mark.skipif(not beneath.AVAILABLE, reason="no descriptor-relative calls on this platform")


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_folder_swapped_for_a_link_just_before_a_file_is_created_gets_nothing_outside(
        packed: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Failed on 0.12.0: its checks resolved the path, then ``mkstemp`` created the temporary file by path, so a
    ``vae`` folder swapped for a link in between put the archive's bytes in a file outside the output (removed
    again when the rename's own check refused it). Now the file is made in the folder the descriptor holds."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    real_open, seen_outside = os.open, []

    def racing_open(path, flags, *args, **kwargs):  # another local user, at the worst moment
        vae = out / "vae"
        if flags & os.O_CREAT and vae.is_dir() and not vae.is_symlink():
            vae.rename(out / "vae-moved")
            vae.symlink_to(outside, target_is_directory=True)
        fd = real_open(path, flags, *args, **kwargs)
        seen_outside.extend(os.listdir(outside))
        return fd

    monkeypatch.setattr(os, "open", racing_open)
    with pytest.raises(DDUFPathError, match="vae is a link to .*outside"):
        unpack(packed["tiny-sd"], out)
    monkeypatch.undo()
    assert seen_outside == [] and _tree(outside) == []
    assert (out / "vae-moved" / "config.json").is_file()  # the one entry begun before the swap: where it began


@pytest.mark.parametrize("link", ["../outside", "inside/../../outside", "ABS_OUTSIDE"])
def test_links_leading_out_are_refused_before_anything_is_written(packed: dict[str, Path], tmp_path: Path,
                                                                 link: str) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (out / "inside").mkdir(parents=True)
    (out / "unet").symlink_to(str(outside) if link == "ABS_OUTSIDE" else link)
    with pytest.raises(DDUFUsageError, match="unet"):
        unpack(packed["tiny-sd"], out)
    assert _tree(outside) == [] and _tree(out) == ["inside", "unet"]


@pytest.mark.parametrize("link", ["inside", "./inside/", "ABS_INSIDE", "hop"])
def test_links_inside_the_output_are_followed(packed: dict[str, Path], tmp_path: Path, link: str) -> None:
    """The user's own layout: relative, absolute and chained links that stay inside the output."""
    out = tmp_path / "out"
    (out / "inside").mkdir(parents=True)
    (out / "hop").symlink_to("inside")
    (out / "unet").symlink_to(str(out / "inside") if link == "ABS_INSIDE" else link)
    unpack(packed["tiny-sd"], out)
    assert (out / "inside" / "config.json").is_file() and (out / "unet").is_symlink()


def test_a_link_loop_and_a_file_in_a_folder_s_place_are_refused(packed: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "unet").symlink_to("loop")
    (out / "loop").symlink_to("unet")
    with pytest.raises(DDUFUsageError, match="more than 40 links"):
        unpack(packed["tiny-sd"], out)
    (out / "unet").unlink()
    (out / "unet").write_text("a file")
    with pytest.raises(DDUFUsageError, match="unet is not a folder"):
        unpack(packed["tiny-sd"], out, force=True)
    assert (out / "unet").read_text() == "a file" and not (out / "model_index.json").exists()


def test_atomic_leaves_nothing_when_the_block_fails_and_applies_the_mode(tmp_path: Path) -> None:
    with Beneath(tmp_path / "o") as out:
        with pytest.raises(RuntimeError), out.atomic("a/b/x.json") as fd:
            write_all(fd, b"half")
            raise RuntimeError("disk gone")
        assert _tree(tmp_path / "o") == ["a", "a/b"]
        with out.atomic("a/b/x.json", mode=0o640) as fd:
            write_all(fd, b"{}")
        assert out.lexists("a/b/x.json") and not out.lexists("a/c/x.json")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "o" / "a" / "b" / "x.json").stat().st_mode & 0o777 == 0o640 & ~umask


def test_without_descriptor_calls_paths_are_checked_then_written(packed: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the platform lacks them (Windows), the path-checked writer: a link leading out is refused, one
    inside is followed, an existing file needs ``force``."""
    monkeypatch.setattr(beneath, "AVAILABLE", False)
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (out / "inside").mkdir(parents=True)
    (out / "unet").symlink_to(outside)
    with pytest.raises(DDUFUsageError, match="unet.*outside"):
        unpack(packed["tiny-sd"], out)
    (out / "unet").unlink()
    (out / "unet").symlink_to("inside")
    unpack(packed["tiny-sd"], out)
    assert (out / "inside" / "config.json").is_file() and _tree(outside) == []
    with pytest.raises(DDUFUsageError, match="exists"):
        unpack(packed["tiny-sd"], out)


def test_a_folder_in_a_file_s_place_is_named(packed: dict[str, Path], tmp_path: Path) -> None:
    """Was ``.model_index.json.be3f7982.partial: Is a directory`` (the temporary name, a raw ``OSError``)."""
    from dduf_plus.errors import DDUFIOError

    out = tmp_path / "out"
    (out / "model_index.json").mkdir(parents=True)
    with pytest.raises(DDUFIOError, match=r"cannot write .*out/model_index\.json: Is a directory"):
        unpack(packed["tiny-sd"], out, force=True)
    assert not [p for p in _tree(out) if "partial" in p]
