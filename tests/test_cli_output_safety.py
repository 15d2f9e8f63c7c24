"""Terminal injection: class names, entry names, reference sources and finding messages come from the archive
and must reach the terminal as inert text. Human-readable output escapes every non-printable character; JSON
output stays JSON (and ASCII-only, so U+009B or U+202E cannot be raw in it either)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import PIPELINES, load_make_hostile
from dduf_plus.cli import main
from dduf_plus.cli._common import printable

mh = load_make_hostile()

# OSC retitle (ESC ] ... BEL), CSI clear screen, a bare CR, the one-character C1 CSI, a bidi override, DEL, a
# line separator, a zero-width joiner (format character)
EVIL = "A\x1b]0;pwned\x07B\x1b[2JC\rD\u009b2JE\u202eF\x7fG\u2028H\u200dI"
RAW_MARKERS = ("\x1b", "\x07", "\r", "\u009b", "\u202e", "\x7f", "\u2028", "\u200d")


def assert_inert(text: str) -> None:
    """Nothing a terminal would act on: every character printable, or a line break."""
    bad = sorted({f"U+{ord(ch):04X}" for ch in text if not (ch.isprintable() or ch == "\n")})
    assert not bad, f"raw non-printable characters reached the terminal: {bad}\n{text!r}"


def assert_inert_bytes(data: bytes) -> None:
    text = data.decode("utf-8")  # also: what was written is valid UTF-8 (no lone surrogates)
    assert_inert(text)


# --- archives -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("evil")
    made: dict[str, Path] = {}
    # class names: the pipeline's and a component's
    mi = dict(mh.MODEL_INDEX, _class_name="Pipe" + EVIL, unet=["diffusers", "UNet2DModel" + EVIL])
    made["classes"] = mh.write_valid(out / "classes.dduf", model_index=mi)
    # a reference whose recorded source (and type hint) carry escapes
    entries = {k: v for k, v in mh.base_entries().items() if not k.startswith("unet/")}
    files = {"config.json": {"sha256": "0" * 64, "size": 10}, "diffusion_pytorch_model.safetensors":
             {"sha256": "1" * 64, "size": 20}}
    for source in ("org/repo" + EVIL, "./folder" + EVIL):
        reference = {"files": files, "pretrained_model_name_or_path": source, "revision": None,
                     "subfolder": "unet" + EVIL, "type_hint": ["diffusers", "UNet2DModel" + EVIL], "variant": None}
        mi = dict(mh.MODEL_INDEX, _dduf_plus_references={"unet": reference})
        name = "ref-hub" if source.startswith("org") else "ref-folder"
        made[name] = mh.write_valid(out / f"{name}.dduf", entries, model_index=mi)
    # entry names with control characters (the reader refuses them, Z007; the finding names the entry)
    with zipfile.ZipFile(out / "entries.dduf", "w") as zf:
        zf.writestr("model_index.json", json.dumps(mh.MODEL_INDEX))
        for name, data in mh.base_entries().items():
            zf.writestr(name, data)
        zf.writestr("unet/x" + EVIL.replace("\x00", "") + ".json", b"{}")
    made["entries"] = out / "entries.dduf"
    # a component *name* with escapes (D012 refuses it on open: the error message quotes it)
    mi = dict(mh.MODEL_INDEX)
    mi["un" + EVIL] = mi.pop("unet")
    made["component-name"] = mh.write_valid(out / "component-name.dduf", model_index=mi)
    return made


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- the helper -----------------------------------------------------------------------------------------------


def test_printable_escapes_every_control_and_format_character():
    assert printable("plain text, é, 中文, ✓") == "plain text, é, 中文, ✓"
    escaped = printable(EVIL)
    assert_inert(escaped)
    assert escaped == ("A\\x1b]0;pwned\\x07B\\x1b[2JC\\rD\\x9b2JE\\u202eF\\x7fG\\u2028H\\u200dI")
    assert printable("a\nb") == "a\\nb" and printable("a\nb", newlines=True) == "a\nb"
    assert printable("\t\x00\udcff\U000e0001") == "\\t\\x00\\udcff\\U000e0001"  # tab, NUL, lone surrogate, tag
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2069]:
        assert_inert(printable(chr(code)))


# --- every command's human output ----------------------------------------------------------------------------


def test_info_escapes_class_names(evil, capsys):
    code, out, err = run_cli(capsys, "info", str(evil["classes"]))
    assert code == 0, err
    assert_inert(out + err)
    assert "Pipe" + printable(EVIL) in out and "UNet2DModel" + printable(EVIL) in out


def test_info_json_stays_json_and_ascii(evil, capsys):
    code, out, _ = run_cli(capsys, "info", "--json", str(evil["classes"]))
    assert code == 0
    assert out.isascii() and not any(m in out for m in RAW_MARKERS)
    info = json.loads(out)
    assert info["pipeline"] == "Pipe" + EVIL  # machine-readable: the exact string, escaped only by JSON
    assert info["components"]["unet"]["class"] == "UNet2DModel" + EVIL


@pytest.mark.parametrize("case", ["ref-hub", "ref-folder"])
def test_refs_and_info_escape_reference_sources(evil, capsys, case, hf_env):
    code, out, err = run_cli(capsys, "refs", str(evil[case]))
    assert_inert(out + err)
    assert printable(EVIL) in out + err  # shown, escaped
    code, out, err = run_cli(capsys, "info", str(evil[case]))
    assert_inert(out + err)
    code, out, _ = run_cli(capsys, "refs", "--json", str(evil[case]))
    if out:
        assert out.isascii()
        json.loads(out)


def test_validate_escapes_entry_names_and_messages(evil, capsys):
    code, out, err = run_cli(capsys, "validate", str(evil["entries"]))
    assert code == 1
    assert_inert(out + err)
    assert "Z007" in out and "pwned" in out
    code, out, _ = run_cli(capsys, "validate", "--json", str(evil["entries"]))
    assert code == 1 and out.isascii()
    entries = {f["entry"] for f in json.loads(out)["files"][0]["errors"]}
    assert any(e and "pwned" in e for e in entries)  # the finding names the entry (the validator quotes it)


def test_error_messages_are_escaped(evil, capsys):
    for command in ("info", "refs", "unpack"):
        args = [command, str(evil["component-name"])] + (["-o", str(evil["component-name"].parent / "u")]
                                                          if command == "unpack" else [])
        code, out, err = run_cli(capsys, *args)
        assert code == 1, (command, err)
        assert_inert(out + err)
        assert "error:" in err and printable("un" + EVIL) in err
    code, out, err = run_cli(capsys, "info", str(evil["entries"]))
    assert code == 1 and "Z007" in err
    assert_inert(out + err)


def test_pack_escapes_file_names_of_the_folder(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(PIPELINES / "tiny-sd", src)
    (src / ("notes" + EVIL + ".txt")).write_text("x")
    code, out, err = run_cli(capsys, "pack", str(src), "-o", str(tmp_path / "a.dduf"))
    assert code == 0, err
    assert_inert(out + err)
    assert "skipped notes" + printable(EVIL) + ".txt" in out


def test_real_stdout_and_stderr_bytes(evil):
    """In a real process (with the CLI's own logging handler): the bytes written hold nothing raw."""
    for args in (["info", str(evil["classes"])], ["refs", str(evil["ref-hub"])], ["refs", str(evil["ref-folder"])],
                 ["validate", str(evil["entries"])], ["info", str(evil["component-name"])],
                 ["-v", "info", "--variant", "fp16", str(evil["classes"])]):
        done = subprocess.run([sys.executable, "-m", "dduf_plus.cli", *args], capture_output=True)
        assert b"Traceback" not in done.stderr, done.stderr
        assert_inert_bytes(done.stdout)
        assert_inert_bytes(done.stderr)
