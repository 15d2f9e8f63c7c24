"""A mistyped command or flag gets the closest one (``dduf pakc``: "did you mean pack?")."""

from __future__ import annotations

import pytest

from dduf_plus.cli import main as cli_main


@pytest.mark.parametrize(("argv", "hint"), [
    (["pakc", "x"], "did you mean pack?"),
    (["valdiate", "x.dduf"], "did you mean validate?"),
    (["pack", "folder", "-o", "x.dduf", "--exlude", "vae"], "did you mean --exclude?"),
    (["pack", "folder", "-o", "x.dduf", "--exlude=vae"], "did you mean --exclude?"),
    (["info", "x.dduf", "--jsn"], "did you mean --json?"),
    (["compress", "x.dduf", "--levle", "3"], "did you mean --level?"),
])
def test_a_typo_gets_the_closest_name(capsys, argv: list[str], hint: str) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(hint), err


def test_nothing_close_gets_no_guess(capsys) -> None:
    assert cli_main(["zzzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err
    assert cli_main(["info", "x.dduf", "--qqqqqqq"]) == 2
    assert "did you mean" not in capsys.readouterr().err
