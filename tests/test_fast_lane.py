"""The fast lane (`pytest -m "not slow"`): tests/slow_tests.txt lists what it leaves out, tests/conftest.py marks
each match `slow`. Every line must still name a test file or a test in it (a renamed test would silently come back
into the lane, or a stale line stay forever), and the marker is registered."""

from __future__ import annotations

import re

from conftest import ROOT, is_slow, slow_prefixes


def test_every_line_names_a_test() -> None:
    stale = []
    for prefix in slow_prefixes():
        path, _, name = prefix.partition("::")
        file = ROOT / path
        if not file.is_file() or (name and not re.search(rf"^def {re.escape(name.split('[')[0])}\(", file.read_text(),
                                                             re.MULTILINE)):
            stale.append(prefix)
    assert stale == [], f"tests/slow_tests.txt names no test: {stale}"


def test_matching_is_by_file_test_or_parameters() -> None:
    prefixes = ["tests/test_a.py", "tests/test_b.py::test_x"]
    assert is_slow("tests/test_a.py::test_anything[p]", prefixes)
    assert is_slow("tests/test_b.py::test_x", prefixes) and is_slow("tests/test_b.py::test_x[1-2]", prefixes)
    assert not is_slow("tests/test_b.py::test_x_other", prefixes)  # a longer name is another test
    assert not is_slow("tests/test_ab.py::test_y", prefixes)


def test_the_marker_is_registered() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'markers = \[\s*"slow:', text)
