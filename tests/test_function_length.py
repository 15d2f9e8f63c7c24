"""House rule: no function in dduf_plus/ is longer than MAX_LINES lines (its docstring not counted) unless a
``# long: <why>`` comment on its ``def`` line, a decorator line or the line just above says why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dduf_plus"
MAX_LINES = 60
_REASON = re.compile(r"#\s*long:\s*\S")  # a reason, not just the marker


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def long_functions(source: str, filename: str = "<string>", max_lines: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function of ``source`` over ``max_lines`` lines, from its
    ``def`` line to its last, docstring excluded, that carries no ``# long: <why>`` comment."""
    lines = source.splitlines()
    offenders: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1 - _docstring_lines(node)
        if length <= max_lines:
            continue
        top = min([node.lineno] + [d.lineno for d in node.decorator_list])
        marked = range(max(top - 1, 1), node.lineno + 1)  # the line above, decorators, the def line
        if not any(_REASON.search(lines[n - 1]) for n in marked):
            offenders.append((node.lineno, f"{filename}:{node.lineno} {node.name} ({length} lines)"))
    return [text for _, text in sorted(offenders)]


def _body(n: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(n))


def test_the_check_finds_a_long_function_and_accepts_a_reason():
    doc = '    """A docstring\n    that does not count."""\n'
    at_limit = f"def at_limit():\n{doc}{_body(59)}"  # 60 lines without its docstring
    source = f"{at_limit}\n\ndef too_long(a,\n             b):\n{doc}{_body(59)}"  # 61
    assert long_functions(source, "made_up.py") == ["made_up.py:65 too_long (61 lines)"]
    assert long_functions(source, max_lines=59) == ["<string>:1 at_limit (60 lines)", "<string>:65 too_long (61 lines)"]
    assert long_functions(source.replace("def too_long(a,", "def too_long(a,  # long: a table, read as data")) == []
    above = source.replace("\n\ndef too_long(", "\n# long: one state machine, kept whole\ndef too_long(")
    assert long_functions(above) == []
    decorated = source.replace("\n\ndef too_long(", "\n# long: generated\n@staticmethod\ndef too_long(")
    assert long_functions(decorated) == []
    # the marker needs a reason, and a comment two lines up is not the function's
    assert long_functions(source.replace("def too_long(a,", "def too_long(a,  # long:")) != []
    far = source.replace("\n\ndef too_long(", "# long: too far away\n\n\ndef too_long(")
    assert long_functions(far) != []
    nested = "async def outer():\n    def inner():\n" + _body(61, " " * 8)
    assert [o.split(" ")[1] for o in long_functions(nested)] == ["outer", "inner"]


def test_no_unexplained_long_function_in_the_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offenders += long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not offenders, (f"functions over {MAX_LINES} lines (docstring excluded): split them into named "
                           "steps, or say why on the def line with '# long: <why>':\n  " + "\n  ".join(offenders))
