"""A reference's source, in one place: the SPEC syntax ``SOURCE[@REVISION][:SUBFOLDER]`` users write
(``--ref vae=org/repo@v1:vae``, ``load_dduf(..., refs=...)``), the source an archive's reference record names
(:func:`reference_spec`), and the one text that describes it (:func:`describe_reference`). Finding the files a
reference names on this machine is :mod:`.resolve`'s."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ..assignments import ReferenceNameError, check_names, parse_assignments
from ..errors import DDUFError, DDUFReferenceError
from ..remote.hub import is_repo_id

SpecLike = str | os.PathLike

# --- SPEC syntax ---------------------------------------------------------------------------------------
_SUBFOLDER = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


class Spec(NamedTuple):
    """A parsed SPEC: ``SOURCE[@REVISION][:SUBFOLDER]``.

    kind: ``"hub"`` (location is a repo id), ``"folder"`` or ``"dduf"`` (location is an absolute path),
    ``"url"`` (location is the URL of a hosted ``.dduf``: ``https://``, ``hf://org/repo/file.dduf``, ...).
    subfolder: component folder inside the source; None means "the component's own name"."""

    kind: str
    location: str
    revision: str | None = None
    subfolder: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sub = f":{self.subfolder}" if self.subfolder else ""
        return f"{self.location}{rev}{sub}"


def parse_spec(spec: SpecLike) -> Spec:
    """Parse ``SOURCE[@REVISION][:SUBFOLDER]``.

    SOURCE is the URL of a hosted ``.dduf`` (``https://host/base.dduf``, ``hf://org/repo/base.dduf``: only
    the component's entries are fetched, by range reads), a path ending in ``.dduf``, an existing folder
    (or any path starting with ``/``, ``.`` or ``~``), else a Hub repo id. ``@REVISION`` (branch, tag or commit) applies to repo ids only;
    ``:SUBFOLDER`` names the component's folder in the source when it differs from the component name
    (``org/sdxl:text_encoder_2``). A local path wins over a repo id of the same spelling, as in
    ``from_pretrained``.

    Raises:
        DDUFReferenceError: SPEC is none of these.
    """
    text = os.fspath(spec).strip()
    if not text:
        raise DDUFReferenceError("empty reference SPEC")
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return _url_spec(text)
    source, subfolder = text, None
    head, sep, tail = text.rpartition(":")
    if sep and len(head) > 1 and _SUBFOLDER.match(tail):  # len > 1: "C:dir" is a Windows drive
        source, subfolder = head, tail
    if source.endswith(".dduf"):
        return Spec("dduf", _abspath(source), None, subfolder)
    if os.path.isdir(os.path.expanduser(source)) or source.startswith(("/", ".", "~", "\\")) or os.path.isabs(source):
        return Spec("folder", _abspath(source), None, subfolder)
    repo, _, revision = source.partition("@")
    if not is_repo_id(repo, namespaced=False) or (_ and not revision):
        raise DDUFReferenceError(f"reference {text!r} is not an existing folder, a .dduf file or a Hub repo id "
                                 "(SPEC syntax: SOURCE[@REVISION][:SUBFOLDER])")
    return Spec("hub", repo, revision or None, subfolder)


def _url_spec(text: str) -> Spec:
    """``URL[:SUBFOLDER]``: a ``:`` suffix is a subfolder only after ``.dduf`` (``http://h:8080/x.dduf`` has
    a port, not a subfolder)."""
    from ..storage.urls import check_url, is_url

    url, subfolder = text, None
    head, sep, tail = text.rpartition(":")
    if sep and head.endswith(".dduf") and "/" not in tail and _SUBFOLDER.match(tail):
        url, subfolder = head, tail
    if not (is_url(url) and url.endswith(".dduf")):
        raise DDUFReferenceError(f"reference {text!r}: a URL SOURCE must name a hosted .dduf archive "
                                 "(https://host/base.dduf[:SUBFOLDER], hf://org/repo/base.dduf)")
    try:
        check_url(url)
    except DDUFError as e:
        raise DDUFReferenceError(f"reference {text!r}: {e}") from None
    return Spec("url", url, None, subfolder)


def _abspath(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def parse_ref_args(values: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """CLI ``--ref`` values to a refs mapping: ``SPEC`` -> ``{"*": SPEC}``, ``NAME=SPEC`` -> ``{NAME: SPEC}``
    (``NAME=`` when NAME is a component-like identifier, no ``/``); a name given twice is refused. One parser
    for ``--ref`` and ``--dtype``: :func:`dduf_plus.assignments.parse_assignments`."""
    return parse_assignments(values, "--ref", default_key="*", value_name="SPEC", error=DDUFReferenceError)


def check_ref_names(refs: Mapping[str, Any] | None, components: Iterable[str], references: Iterable[str], *,
                    what: str = "refs=", where: str = "the archive") -> None:
    """Every name in ``refs`` (but ``"*"``) must be a referenced component: a typo (``vea``) is an error naming
    it, the closest component and the components; a component the archive stores (or that is null) is
    refused too: a source for it would be ignored. ``what`` is how the names were given (``"--ref"``)."""
    if not refs:
        return
    names = [n for n in refs if n != "*"]
    check_names(names, components, what=what, where=where, error=ReferenceNameError)
    referenced = sorted(set(references))
    stored = [n for n in names if n not in referenced]
    if stored:
        raise ReferenceNameError(
            f"{what} {', '.join(stored)}: not referenced by {where} (stored in it, or null), so a source for "
            f"{'it' if len(stored) == 1 else 'them'} would be ignored; referenced components: "
            f"{', '.join(referenced) or 'none'}", names=stored, known=referenced)


def reference_spec(reference: Mapping[str, Any]) -> Spec | None:
    """The source a reference records, as a Spec (subfolder filled in); None when it records none."""
    location = reference.get("pretrained_model_name_or_path")
    if not location:
        return None
    location = str(location)
    sub = reference.get("subfolder") or None
    rev = reference.get("revision") or None
    if "://" in location and location.endswith(".dduf") and not location.startswith("file://"):
        return Spec("url", location, None, sub)  # a hosted archive; any other URL is never fetched
    if location.endswith(".dduf"):
        return Spec("dduf", location, None, sub)
    if os.path.isabs(location) or location.startswith((".", "~")) or not is_repo_id(location, namespaced=False):
        return Spec("folder", location, None, sub)
    return Spec("hub", location, rev, sub)


REFERENCE_KINDS = {"hub": "Hub repo", "url": "hosted archive", "dduf": "archive", "folder": "folder"}


def describe_reference(name: str, reference: Any) -> str:
    """Where the referenced component ``name`` comes from, in words: the one text ``dduf info``, the serve page
    and every reference error show. ``org/repo@rev:vae (Hub repo)``, ``https://host/base.dduf:vae (hosted
    archive)``, ``/data/base.dduf:vae (archive)``; ``no source recorded`` when the record names none. The record
    is untrusted: one of any shape is described, never a crash."""
    try:
        spec = reference_spec(reference) if isinstance(reference, Mapping) else None
    except Exception:  # noqa: BLE001 - an untrusted record of any shape
        spec = None
    if spec is None:
        return "no source recorded"
    rev = f"@{spec.revision}" if spec.revision else ""
    return f"{spec.location}{rev}:{spec.subfolder or name} ({REFERENCE_KINDS[spec.kind]})"
