"""The one parser of repeatable ``[NAME=]VALUE`` arguments (``--ref``, ``--dtype``): a bare ``VALUE`` is
the default for every name, ``NAME=VALUE`` one name's. The same name (or two defaults) twice is refused,
whichever option it is, rather than the later silently winning. Standard library only."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import DDUFError, DDUFUsageError

# a component-like identifier: "text_encoder_2", "vae" (no "/", so "org/repo=..." stays a VALUE)
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def parse_assignments(values: Iterable[str] | None, option: str, *, default_key: str, value_name: str = "VALUE",
                      error: type[DDUFError] = DDUFUsageError) -> dict[str, str]:
    """``["org/base", "vae=./vae"]`` -> ``{default_key: "org/base", "vae": "./vae"}``.

    ``option`` (``"--ref"``) and ``value_name`` (``"SPEC"``) are named in the errors: a missing VALUE
    after ``NAME=``, or a name given twice (``error``: :class:`DDUFUsageError` unless the caller's API
    promises another class; the CLI turns any of them into a usage error)."""
    out: dict[str, str] = {}
    for value in values or ():
        name, sep, rest = value.partition("=")
        key, text = (name, rest) if sep and NAME.match(name) else (default_key, value)
        if not text.strip():
            raise error(f"{option} {value}: expected COMPONENT={value_name}" if sep
                        else f"{option}: empty {value_name}")
        if key in out:
            whom = "the default (no NAME=)" if key == default_key else repr(key)
            raise error(f"{option} given twice for {whom}: {out[key]!r} and {text!r}; give each name once")
        out[key] = text
    return out
