"""Pipeline kinds whose diffusers folder layout does not map one-to-one onto DDUF's (docs/loading.md,
"Pipeline kinds"), as data and torch-free rules shared by ``dduf pack``, ``save_dduf``, validation and the loader.

- **Lists of models** (Multi-ControlNet, Multi-ControlNet-Union, Multi-Adapter): diffusers saves the list
  component ``controlnet`` as one folder per model, ``controlnet``, ``controlnet_1``, ``controlnet_2``...,
  names only ``controlnet`` in model_index.json, and rebuilds the list on load from the consecutive folders
  that exist. DDUF readers refuse a folder model_index.json does not name (huggingface_hub's
  ``read_dduf_file``: "Missing required entry"), so the archive's model_index.json also names each further
  part, with the class the list is made of (``"controlnet_1": ["diffusers", "ControlNetModel"]``). diffusers
  ignores those keys (a warning, when the folder is unpacked); every DDUF reader sees a component with a config.
- **Configs under another name** (guiders: ``guider_config.json``): DDUF wants one of four config names in
  every folder, so the folder also holds ``config.json``, a byte-identical copy. diffusers reads
  ``guider_config.json`` (it ignores the copy); other readers find a config. Copies that differ are refused
  (D019): two readers would otherwise see two configs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from .findings import Finding, finding

# list class -> the class of each part (what diffusers' from_pretrained of the list builds from each folder)
LIST_CLASSES = {
    "MultiControlNetModel": "ControlNetModel",
    "MultiControlNetUnionModel": "ControlNetUnionModel",
    "MultiAdapter": "T2IAdapter",
}
LIST_LIBRARY = "diffusers"
# config file names outside DDUF's four that diffusers components use; stored with a config.json copy
ALIAS_CONFIGS = ("guider_config.json",)
COPY_NAME = "config.json"
_PART = re.compile(r"^(?P<owner>.+)_(?P<index>[1-9][0-9]{0,3})$")


def part_name(owner: str, index: int) -> str:
    """diffusers' folder name of part ``index`` of list ``owner`` (``controlnet``, ``controlnet_1``...)."""
    return owner if index == 0 else f"{owner}_{index}"


def list_owners(model_index: Mapping[str, Any]) -> dict[str, str]:
    """{list component: its part class} for the components model_index.json names with a list class."""
    return {name: LIST_CLASSES[value[1]] for name, value in model_index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2
            and value[0] == LIST_LIBRARY and isinstance(value[1], str) and value[1] in LIST_CLASSES}


def list_parts(model_index: Mapping[str, Any], stored: Collection[str]) -> dict[str, list[str]]:
    """{list component: [its parts in order]}: the component itself, then ``name_1``, ``name_2``... while a
    folder of that name is ``stored`` (diffusers stops at the first missing one, as here)."""
    out = {}
    for owner in list_owners(model_index):
        parts = [owner]
        while part_name(owner, len(parts)) in stored:
            parts.append(part_name(owner, len(parts)))
        out[owner] = parts
    return out


def part_owner(model_index: Mapping[str, Any], name: str) -> str | None:
    """The list component ``name`` would be a further part of (``controlnet`` for ``controlnet_2``), or None."""
    match = _PART.match(name)
    if match is None:
        return None
    owner = match.group("owner")
    return owner if owner in list_owners(model_index) else None


def with_parts(model_index: Mapping[str, Any], parts: Mapping[str, list[str]]) -> tuple[dict[str, Any], bytes] | None:
    """model_index.json naming every further list part (``"controlnet_1": ["diffusers", "ControlNetModel"]``),
    written as diffusers writes it (sorted keys, 2-space indent); None when it already does."""
    owners = list_owners(model_index)
    added = {part: [LIST_LIBRARY, owners[owner]] for owner, names in parts.items() for part in names[1:]
             if model_index.get(part) != [LIST_LIBRARY, owners[owner]]}
    if not added:
        return None
    updated = {**model_index, **added}
    return updated, (json.dumps(updated, indent=2, sort_keys=True) + "\n").encode("utf-8")


def list_findings(model_index: Mapping[str, Any], folders: Collection[str]) -> list[Finding]:
    """D018: each further part of a list component is named with the list's part class, and parts are
    consecutive (``controlnet_2`` without ``controlnet_1`` is a folder no loader reads: diffusers stops at
    the gap)."""
    owners = list_owners(model_index)
    if not owners:
        return []
    parts = list_parts(model_index, folders)
    out = []
    for name, value in model_index.items():
        owner = part_owner(model_index, name)
        if owner is None or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue
        library, cls = value
        if name not in parts[owner]:
            out.append(finding("D018", name, f"is named as a part of list component {owner!r} but is not "
                               f"stored, or comes after a part that is not (parts stored: "
                               f"{', '.join(parts[owner])}); diffusers stops at the first missing folder"))
        elif [library, cls] != [LIST_LIBRARY, owners[owner]]:
            out.append(finding("D018", name, f"is part {name.rsplit('_', 1)[1]} of list component {owner!r} "
                               f"({model_index[owner][1]}), so must be [{LIST_LIBRARY!r}, {owners[owner]!r}], "
                               f"not [{library!r}, {cls!r}]"))
    return out


def alias_config(files: Iterable[str]) -> str | None:
    """The config of a component folder holding none of DDUF's four names, under a name diffusers uses
    (``guider_config.json``), or None."""
    names = set(files)
    return next((n for n in ALIAS_CONFIGS if n in names), None)


def config_copy_findings(entries: Iterable[str], read: Callable[[str], bytes]) -> list[Finding]:
    """D019: in a folder holding ``guider_config.json`` (a config name outside DDUF's four), ``config.json``
    must be its byte-identical copy: DDUF readers read the copy, diffusers the original."""
    by_folder: dict[str, set[str]] = {}
    for name in entries:
        folder, sep, file = name.partition("/")
        if sep:
            by_folder.setdefault(folder, set()).add(file)
    out = []
    for folder, files in sorted(by_folder.items()):
        alias = alias_config(files)
        if alias is None or COPY_NAME not in files:
            continue
        if read(f"{folder}/{alias}") != read(f"{folder}/{COPY_NAME}"):
            out.append(finding("D019", f"{folder}/{COPY_NAME}", f"differs from {folder}/{alias}: DDUF readers "
                               f"read {COPY_NAME}, diffusers reads {alias}; store the same bytes in both"))
    return out


def mark_parts(model_index: Mapping[str, Any], components: dict[str, dict[str, Any]]) -> None:
    """``dduf info``'s records: a list component gets ``parts`` (its folders in order), each further part
    ``part_of`` (the list it belongs to)."""
    for owner, parts in list_parts(model_index, list(components)).items():
        if owner in components:
            components[owner]["parts"] = parts
        for part in parts[1:]:
            components[part]["part_of"] = owner


def unsaved_for_info(model_index: Mapping[str, Any], name: str) -> str:
    """What ``dduf info FOLDER`` says of a component model_index.json names without a folder (``dduf pack``
    asks diffusers whether the pipeline loads without it, and refuses the folder if not)."""
    return "no folder (dduf pack says whether diffusers loads the pipeline without it)"
