"""DDUF-level rules over a list of entry names and the parsed model_index.json."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..storage.confined import component_name_problem
from . import spec
from .findings import Finding, finding
from .json_budget import parse_json_entry
from .pipeline_kinds import list_findings
from .references import reference_findings


def parse_json(raw: bytes, entry: str, *, code: str = "D007") -> tuple[object, list[Finding]]:
    """Parse a JSON entry of an untrusted archive through the one archive JSON reader
    (:func:`~dduf_plus.format.json_budget.parse_json_entry`): the budget of its kind is checked on its bytes
    first (D013: size, values, nesting depth, numbers), so the parser's memory and stack stay bounded
    whatever the recursion limit. ``code`` names a parse failure."""
    value, problem_code, why = parse_json_entry(raw, entry, parse_code=code)
    if problem_code is not None:
        return None, [finding(problem_code, entry, why or "")]
    return value, []


def model_index_object(raw: bytes, where: str, error: type[Exception]) -> dict[str, Any]:
    """The one model_index.json parser outside an archive's validation (``dduf pack``, ``inspect_dtypes``):
    its object, budget-checked as an archive's is (so a pack never writes what validate refuses), or
    ``error`` naming ``where`` (the file) and the rule."""
    value, code, why = parse_json_entry(raw, spec.MODEL_INDEX, parse_code="D002")
    if code == "D013":
        raise error(f"{where}: {why}")
    if code is not None:
        raise error(f"{where}: not valid JSON ({(why or '').removeprefix('does not parse as JSON: ')})")
    if not isinstance(value, dict):
        raise error(f"{where}: must hold a JSON object")
    return value


def component_specs(model_index: Mapping[str, Any]) -> dict[str, tuple[str | None, str | None]]:
    """Components model_index.json names: {name: (library, class)}; (None, None) for null components."""
    out: dict[str, tuple[str | None, str | None]] = {}
    for key, value in model_index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, cls = value
        if (library is None or isinstance(library, str)) and (cls is None or isinstance(cls, str)):
            out[key] = (library, cls)
    return out


def check_structure(names: Sequence[str], model_index: object, *, first_entry: str | None, parsed: bool = True) -> list[Finding]:
    """Spec rules: allowed types, one folder level, folders ↔ model_index.json components, configs.
    ``parsed`` is False when model_index.json did not parse (already reported): folder checks are skipped."""
    findings: list[Finding] = []
    folders: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        if len(parts) > 2:
            findings.append(finding("D004", name, "DDUF allows one folder level"))
            continue
        if not name.endswith(spec.ALLOWED_EXTENSIONS):
            hint = " (pickle: convert to safetensors)" if name.endswith(spec.PICKLE_EXTENSIONS) else ""
            findings.append(finding("D003", name, f"file type not allowed{hint}"))
        elif not name.endswith(spec.NPM_CHECKER_EXTENSIONS):
            findings.append(finding("D009", name, "the npm @huggingface/dduf checker rejects this extension"))
        if len(parts) == 2:
            folders.setdefault(parts[0], []).append(parts[1])
    if spec.MODEL_INDEX not in names:
        return findings + [finding("D001", None, "model_index.json is missing from the archive root")]
    if first_entry != spec.MODEL_INDEX:
        findings.append(finding("D010", spec.MODEL_INDEX, f"first entry is {first_entry!r}"))
    if not parsed:
        return findings
    if not isinstance(model_index, dict):
        return findings + [finding("D002", spec.MODEL_INDEX, f"is a JSON {type(model_index).__name__}, not an object")]
    components = component_specs(model_index)
    for name in components:
        why = component_name_problem(name)
        if why is not None:
            findings.append(finding("D012", spec.MODEL_INDEX, f"component name {name!r} {why}"))
    for folder, files in sorted(folders.items()):
        if folder not in model_index:
            findings.append(finding("D005", folder + "/", "folder is not named in model_index.json"))
        if not any(f in spec.CONFIG_FILES for f in files):
            findings.append(finding("D006", folder + "/", f"needs one of {', '.join(spec.CONFIG_FILES)}"))
    findings.extend(list_findings(model_index, folders))
    references = model_index.get(spec.REFERENCES_KEY) or {}
    if not isinstance(references, dict):
        findings.append(finding("R001", spec.MODEL_INDEX, f"{spec.REFERENCES_KEY} must be an object"))
        references = {}
    findings.extend(reference_findings(model_index, components))
    for component, (library, _cls) in components.items():
        if library is None:
            continue
        stored, referenced = component in folders, component in references
        if stored and referenced:
            findings.append(finding("R002", component, "is stored in the archive and also referenced"))
        elif not stored and not referenced:
            findings.append(finding("D008", component, "has no folder in the archive and no reference"))
    return findings
