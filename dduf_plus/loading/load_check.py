"""The load check (``dduf validate --load-check``, ``dduf_plus.validate(..., load_check=True)``): does each
model component's stored weights fit the model its class and config build, without reading a weight?

Every stored model component is built on the meta device (:func:`dduf_plus.torchkit.meta_model.meta_model`:
no memory for parameters, no initialisers, within the construction budget of what is stored, so a hostile
config is refused in about a second, never built), and its state-dict table (names, shapes, dtypes) is
matched against the safetensors headers the archive already parsed:

- L001: a parameter or persistent buffer the model has and no stored tensor provides;
- L002: a stored tensor the model has no place for;
- L003: a stored tensor of another shape, or of another dtype kind (integers where the model holds floats);
- L004: the class refuses the config, or the config asks for far more than is stored (construction budget);
- L005 (info): a component left out: quantized (a backend rebuilds its layers; Q001-Q006 check it), stored
  elsewhere (a reference), or of a transformers class whose checkpoint key renames the check does not know.

Key renames the loader applies are applied here too: diffusers' old attention-block names
(``_fix_state_dict_keys_on_load``), the classes' ignore patterns, transformers' tied weights and, for the text
encoders the direct path builds (``DIRECT_TRANSFORMERS``), their checkpoint prefix. It imports torch and the
component's library, so the format floor runs it only when asked."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFError
from ..format.findings import Finding, finding
from ..format.quantization import QMAP_NAME as QUANTO_QMAP
from ..format.structure import parse_json
from ..torchkit.meta_model import meta_model
from ..torchkit.quiet import quiet_imports
from .components import kind_of, resolve_class
from .models import DIRECT_TRANSFORMERS, diffusers_class_for

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import Component, DDUFArchive

_LISTED = 8  # tensor names listed in one finding before "and N more"
_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                           "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64", "complex128"})

# {tensor name: (dtype, shape)}: a state-dict table, the model's or the archive's
Table = dict[str, tuple[str, tuple[int, ...]]]


def load_check_findings(archive: DDUFArchive) -> list[Finding]:
    """L001-L005 for every stored model component of ``archive`` (see the module docstring). Components the
    other rules already refuse (D016 no weights, D017 unknown class, D007 / D013 broken config) are left to
    them. Never raises for hostile input: a config that makes the model code fail is an L004 finding."""
    out: list[Finding] = []
    with quiet_imports():  # building imports diffusers, then torchao: notices about the libraries, not the archive
        for component in archive.components.values():
            out.extend(_check_component(archive, component))
    return out


def _check_component(archive: DDUFArchive, component: Component) -> list[Finding]:
    name = component.name
    if component.library is None or component.class_name is None:
        return []
    if component.external is not None:
        return [finding("L005", name, "stored elsewhere (a reference): its weights are checked when resolved")]
    weights = [w for w in archive.weight_files(name) if w in archive.headers]
    if not component.files or "config.json" not in component.files or not weights:
        return []  # not a model, or D006 / D016 / S00x say what is wrong
    try:
        cls = resolve_class(name, component.library, component.class_name)
    except DDUFError:
        return []  # D017, or a library not installed here: nothing to build it with
    kind = kind_of(cls)
    if kind not in ("diffusers_model", "transformers_model"):
        return []
    config = _config(archive, f"{name}/config.json")
    if config is None:
        return []  # D007 / D013 already say so
    if config.get("quantization_config") is not None or QUANTO_QMAP in component.files:
        return [finding("L005", name, "quantized: its layers are rebuilt by the quantization backend, so the "
                        "load check leaves it to Q001-Q006")]
    if kind == "transformers_model" and cls.__name__ not in DIRECT_TRANSFORMERS:
        return [finding("L005", name, f"transformers renames {cls.__name__}'s checkpoint keys in ways the load "
                        "check does not follow: not load-checked")]
    stored = {t: (info.dtype, info.shape) for w in weights for t, info in archive.headers[w].tensors.items()}
    try:
        model = _build(cls, config, f"component {name!r} ({name}/config.json)", archive, weights, kind)
    except DDUFError as e:
        return [finding("L004", name, str(e)[:1000])]
    return _compare(name, _model_table(model), _renamed(model, stored, kind), _ignored(model))


def _config(archive: DDUFArchive, entry: str) -> dict[str, Any] | None:
    if entry in archive.compressed:
        return None
    value, problems = parse_json(archive.read_bytes(entry), entry)
    return value if not problems and isinstance(value, dict) else None


def _build(cls: type[Any], config: dict[str, Any], where: str, archive: DDUFArchive, weights: list[str],
           kind: str) -> Any:
    """The model on the meta device, within the construction budget of the stored tensors."""
    stored = {t: (info.dtype, info.shape, info.nbytes) for w in weights for t, info in archive.headers[w].tensors.items()}
    if kind == "diffusers_model":
        cls = diffusers_class_for(cls, config)
    model = meta_model(cls, config, where, stored)
    if model is None:  # pragma: no cover - a model kind always builds one way or the other
        raise DDUFError(f"{where}: {cls.__name__} has no way to be built from its config")
    return model


def _model_table(model: Any) -> Table:
    """The model's state dict as (dtype, shape) per name: parameters and persistent buffers, no data read."""
    return {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in model.state_dict().items()}


def _renamed(model: Any, stored: Table, kind: str) -> Table:
    """The stored names as the loader maps them to the model's: diffusers' old attention-block names; the
    checkpoint prefix transformers strips for a direct-path text encoder (``text_model.`` of CLIPTextModel
    when the model itself has no such prefix)."""
    table = dict(stored)
    if kind == "diffusers_model":
        fix = getattr(model, "_fix_state_dict_keys_on_load", None)
        if fix is not None:
            fix(table)  # renames keys in place; the values are never looked at
        return table
    prefix = DIRECT_TRANSFORMERS.get(type(model).__name__)
    names = set(model.state_dict())
    if prefix and not any(n.startswith(prefix + ".") for n in names):
        table = {k.removeprefix(prefix + "."): v for k, v in table.items()}
    return table


def _ignored(model: Any) -> tuple[list[re.Pattern[str]], list[re.Pattern[str]], set[str]]:
    """(patterns of missing keys the class lets go, patterns of unexpected ones, tied names that are not
    stored because they share another tensor)."""
    def patterns(attribute: str) -> list[re.Pattern[str]]:
        found = getattr(model, attribute, None) or []
        return [re.compile(p) for p in found if isinstance(p, str)]

    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ()
    return (patterns("_keys_to_ignore_on_load_missing"), patterns("_keys_to_ignore_on_load_unexpected"),
            set(tied) if isinstance(tied, (Mapping, Iterable)) else set())


def _compare(component: str, model: Table, stored: Table,
             ignored: tuple[list[re.Pattern[str]], list[re.Pattern[str]], set[str]]) -> list[Finding]:
    skip_missing, skip_unexpected, tied = ignored
    missing = [k for k in model if k not in stored and k not in tied
               and not any(p.search(k) for p in skip_missing)]
    unexpected = [k for k in stored if k not in model and not any(p.search(k) for p in skip_unexpected)]
    misfit = [f"{k} {_shown(stored[k])} (the model's: {_shown(model[k])})"
              for k in stored if k in model and _misfits(stored[k], model[k])]
    out: list[Finding] = []
    if missing:
        out.append(finding("L001", component, f"{len(missing)} tensor(s) the model needs are not stored: "
                           f"{_listed(missing)}"))
    if unexpected:
        out.append(finding("L002", component, f"{len(unexpected)} stored tensor(s) the model does not have: "
                           f"{_listed(unexpected)}"))
    if misfit:
        out.append(finding("L003", component, f"{len(misfit)} stored tensor(s) do not fit the model: {_listed(misfit)}"))
    return out


def _misfits(stored: tuple[str, tuple[int, ...]], model: tuple[str, tuple[int, ...]]) -> bool:
    return tuple(stored[1]) != tuple(model[1]) or (stored[0] in _FLOAT_DTYPES) != (model[0] in _FLOAT_DTYPES)


def _shown(record: tuple[str, tuple[int, ...]]) -> str:
    return f"{record[0]}{list(record[1])}"


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
