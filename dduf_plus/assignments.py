"""The one parser of repeatable ``[NAME=]VALUE`` arguments (``--ref``, ``--dtype``): a bare ``VALUE`` is
the default for every name, ``NAME=VALUE`` one name's. The same name (or two defaults) twice is refused,
whichever option it is, rather than the later silently winning. And the one check of component names a
caller gives (:func:`check_names`): a name that is not a component is an error naming it, the closest
match and the components, wherever it is given. Standard library only."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence

from .errors import DDUFError, DDUFLoadError, DDUFPackError, DDUFReferenceError, DDUFUsageError

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


# --- names a caller gives ---------------------------------------------------------------------------------
class DDUFNameError(DDUFUsageError):
    """A name the caller gave (``refs={"vea": ...}``, ``dtype={"unte": ...}``, ``--exclude``, ``--ref NAME=``,
    ``--dtype NAME=``) that is not one of the pipeline's components: never ignored. ``names`` are the
    unknown names, ``known`` the components, ``suggestions`` the closest known name of each (or None)."""

    def __init__(self, message: str, *, names: Sequence[str] = (), known: Sequence[str] = (),
                 suggestions: Mapping[str, str | None] | None = None):
        super().__init__(message)
        self.names, self.known = list(names), list(known)
        self.suggestions = dict(suggestions or {})


class PackNameError(DDUFNameError, DDUFPackError):
    """An unknown component name given to ``pack`` (``exclude=``, ``refs=``, ``dtype=``)."""


class ReferenceNameError(DDUFNameError, DDUFReferenceError):
    """An unknown component name in ``refs=`` / ``--ref NAME=`` (load, ``dduf refs``, ``dduf complete``)."""


class LoadNameError(DDUFNameError, DDUFLoadError):
    """An unknown component name in ``load_dduf(torch_dtype={...})``."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (difflib; a case difference counts as none), or None."""
    choices = sorted(set(known))
    lowered = {k.lower(): k for k in choices}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def check_names(given: Iterable[str], known: Iterable[str], *, what: str, where: str = "the pipeline",
                error: type[DDUFNameError] = DDUFNameError, wildcards: Iterable[str] = ()) -> None:
    """Refuse every name in ``given`` that is not in ``known`` (``wildcards``, such as ``"*"`` or
    ``"default"``, are allowed): one error naming each unknown name, the closest match and the components.

    ``what`` is how the user gave the names (``"--exclude"``, ``"load_dduf(dtype=...)"``); ``where`` says
    whose components they are (``"tiny-sd/model_index.json"``).

    Example:
        >>> check_names(["vea"], ["unet", "vae"], what="--exclude")
        Traceback (most recent call last):
        ...
        dduf_plus.assignments.DDUFNameError: --exclude vea: not a component of the pipeline (did you mean vae?); its components: unet, vae
    """
    known_list = sorted(set(known))
    skip = set(wildcards)
    unknown = [n for n in dict.fromkeys(given) if n not in skip and n not in known_list]
    if not unknown:
        return
    suggestions = {n: closest(n, known_list) for n in unknown}
    parts = [f"{n} (did you mean {suggestions[n]}?)" if suggestions[n] else n for n in unknown]
    if len(unknown) == 1:
        head = f"{what} {unknown[0]}: not a component of {where}"
        hint = f" (did you mean {suggestions[unknown[0]]}?)" if suggestions[unknown[0]] else ""
    else:
        head, hint = f"{what} {', '.join(parts)}: not components of {where}", ""
    listed = ", ".join(known_list) if known_list else "none"
    raise error(f"{head}{hint}; its components: {listed}", names=unknown, known=known_list, suggestions=suggestions)
