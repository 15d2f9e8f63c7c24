"""Every file dduf_plus creates, renames or removes goes through the confined writers (``storage/confined.py``
for paths, ``storage/beneath.py`` for output folders walked by descriptor), or through one of the few places
listed here with the reason they may not. A new writer elsewhere fails this test (a planted one is checked)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dduf_plus"
WRITERS = {"storage/confined.py", "storage/beneath.py"}
ALLOWED = {  # (file, what): why it writes without the confined writers
    ("format/findings.py", "path.write_text"): "regenerates docs/validation.md's rule table (a developer's tool)",
    ("serve/app.py", "mkdtemp"): "the server's private temporary folder, made by the standard library exclusively",
    ("serve/app.py", "shutil.rmtree"): "that folder, removed when the server stops",
    ("serve/uploads.py", "mkstemp"): "an upload spooled to an exclusively created file in that folder",
    ("serve/uploads.py", "os.unlink"): "that spooled file, removed when the upload is done",
    ("serve/jobs.py", "os.unlink"): "the same, from the validation job",
}
RECEIVERS = ("box", "cache", "store", "self.box", "self.cache", "self._root", "out_root")  # Confined objects


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for each call that creates, renames or removes a file outside the confined writers."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        what = None
        if name == "open" and owner in ("", "io"):
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                 None)
            if isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wxa+"):
                what = f"open(..., {mode.value!r})"
        elif owner == "os" and name in ("replace", "rename", "unlink", "remove", "rmdir", "symlink", "link"):
            what = f"os.{name}"
        elif owner == "os" and name == "open" and "O_CREAT" in ast.unparse(node):
            what = "os.open(O_CREAT)"
        elif name in ("mkstemp", "mkdtemp", "NamedTemporaryFile"):
            what = name
        elif owner == "shutil" and name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree"):
            what = f"shutil.{name}"
        elif name in ("write_text", "write_bytes") and owner not in RECEIVERS and "Confined(" not in owner:
            what = f"{owner}.{name}"
        if what:
            found.append((node.lineno, what))
    return sorted(found)


def test_no_writer_outside_the_confined_ones() -> None:
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in WRITERS:
            continue
        for line, what in writes(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, what) not in ALLOWED:
                stray.append(f"{rel}:{line}: {what}")
    assert stray == [], "write through storage/confined.py (or add the place to ALLOWED with its reason):\n" + \
        "\n".join(stray)


def test_the_check_finds_a_planted_writer() -> None:
    planted = ast.parse('tmp = out.with_name(".x.tmp")\nwith open(tmp, "wb") as f:\n    f.write(b"")\n'
                        'os.replace(tmp, out)\nPath("x").write_bytes(b"")\nbox.write_bytes(p, b"")\n')
    assert [w for _, w in writes(planted)] == ["open(..., 'wb')", "os.replace", "Path('x').write_bytes"]
