"""inspect_dtypes: "what precision was this saved in?", answered from safetensors headers alone.

Works on a ``.dduf`` archive (local or an fsspec URL), a diffusers pipeline folder, or a Hub repo id;
reads kilobytes, never tensor data, and imports no torch (the format layer's start-up speed). The
numbers are the ones the archive index and ``dduf info`` show: both use
:func:`dduf_plus.format.index.summarize`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypedDict

from .errors import DDUFError, path_argument
from .format import spec
from .format.index import summarize
from .format.safetensors_header import SafetensorsHeader, TensorInfo, read_file_header
from .format.structure import component_specs, model_index_object
from .format.weights import select_weights, tensor_files
from .storage.urls import is_url

logger = logging.getLogger(__name__)


class _ComponentDtypesRequired(TypedDict):
    dtype: str | None  # dominant floating dtype (most bytes), torch spelling: "float16"; None: no floats
    dtypes: dict[str, int]  # bytes per dtype
    parameters: int
    bytes: int


class ComponentDtypes(_ComponentDtypesRequired, total=False):
    quantization: dict[str, Any]  # archives of quantized components: the index's record (backend, scheme, roles)


def inspect_dtypes(
    source: str | os.PathLike,
    *,
    variant: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> dict[str, ComponentDtypes]:
    """Per model component of a pipeline, the dtypes its weights were saved in, before loading anything.

    ``source``: a ``.dduf`` file (or fsspec URL of one), a diffusers pipeline folder, a single-file
    ``.safetensors`` checkpoint (the components it holds, by diffusers' names), or a Hub repo id
    (``revision`` and ``token`` apply there; a repo holding a single ``.dduf`` file is read through
    range requests; a folder repo's safetensors headers too; offline, the repo as cached, as ``load_dduf``
    reads it). Every source of the same pipeline gives the same answer (tests/test_load_folder.py).
    ``variant`` picks variant weight files as diffusers does (falling back to the default ones). Components without safetensors weights (tokenizers, schedulers, pickle-only models)
    are left out.

    Example:
        >>> inspect_dtypes("fixtures/pipelines/tiny-sd")["unet"]["dtype"]
        'float16'

    Raises:
        DDUFError: the source does not exist, is not a pipeline, or its headers are broken
            (``DDUFValidationError`` for a malformed archive).
    """
    text = path_argument(source, "inspect_dtypes(source=...)")
    if text.endswith(".safetensors") and os.path.isfile(text):
        return _from_single_file(text)
    if is_url(text) or text.endswith(".dduf") or os.path.isfile(text):
        return _from_archive(text, variant)
    if os.path.isdir(text):
        return _from_folder(Path(text), variant)
    if os.path.exists(text) or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise DDUFError(f"{text}: not a .dduf archive, a pipeline folder or a Hub repo id")
    return _from_hub(text, variant=variant, revision=revision, token=token)


def _summary(headers: Iterable[SafetensorsHeader]) -> ComponentDtypes:
    s = summarize(headers)
    return ComponentDtypes(dtype=s["dtype"], dtypes=s["dtypes"], parameters=s["parameters"], bytes=s["bytes"])


def _model_components(model_index: dict[str, Any]) -> list[str]:
    return [name for name, (library, _cls) in component_specs(model_index).items() if library is not None]


def _per_component(
    model_index: dict[str, Any],
    files_of: Callable[[str], list[str]],
    headers_of: Callable[[str, list[str]], list[SafetensorsHeader]],
    variant: str | None,
) -> dict[str, ComponentDtypes]:
    out: dict[str, ComponentDtypes] = {}
    for name in _model_components(model_index):
        chosen = tensor_files(select_weights(files_of(name), variant))
        if chosen:
            out[name] = _summary(headers_of(name, chosen))
    return out


# --- archives ----------------------------------------------------------------------------------------
def _from_archive(path: str, variant: str | None = None, **storage_options: Any) -> dict[str, ComponentDtypes]:
    from .format.archive import DDUFArchive
    from .remote.indexed import open_indexed

    # a URL: from the tail alone when the index agrees with the directory (one request), else the full open
    with (open_indexed(path, **storage_options) if is_url(path) else DDUFArchive(path, **storage_options)) as archive:
        out: dict[str, ComponentDtypes] = {}
        for name, comp in archive.components.items():
            if comp.library is None or comp.external is not None:
                continue  # stored elsewhere: its precision is that source's to tell
            files = archive.weight_files(name, variant)
            if files:
                out[name] = _summary(archive.headers[f] for f in files)
                record = _quantization_record(archive.stored_index, name)
                if record is not None:
                    out[name]["quantization"] = record
        return out


def _quantization_record(index: Any, name: str) -> dict[str, Any] | None:
    """The quantization record the (untrusted, any shape) dduf_plus index keeps for a component, or None."""
    components = index.get("components") if isinstance(index, dict) else None
    component = components.get(name) if isinstance(components, dict) else None
    record = component.get("quantization") if isinstance(component, dict) else None
    return record if isinstance(record, dict) else None


# --- single-file checkpoints ------------------------------------------------------------------------
def _from_single_file(path: str) -> dict[str, ComponentDtypes]:
    """The components a single-file checkpoint holds, in diffusers' component names (header only)."""
    from .packing.single_file import describe_checkpoint

    described = describe_checkpoint(path)
    if described["architecture"] is None:
        raise DDUFError(f"{path}: {described['problem']}")
    out: dict[str, ComponentDtypes] = {}
    for name, comp in described["components"].items():
        dtypes = dict(sorted(comp["dtypes"].items()))
        floating = {k: v for k, v in dtypes.items() if spec.DTYPE_BY_TORCH[k].floating}
        dominant = max(sorted(floating), key=lambda k: floating[k]) if floating else None
        out[name] = ComponentDtypes(dtype=dominant, dtypes=dtypes, parameters=comp["parameters"], bytes=comp["bytes"])
    return out


# --- folders -----------------------------------------------------------------------------------------
def _from_folder(root: Path, variant: str | None) -> dict[str, ComponentDtypes]:
    model_index = _read_model_index((root / spec.MODEL_INDEX).read_bytes() if (root / spec.MODEL_INDEX).is_file()
                                    else None, str(root))

    def files_of(name: str) -> list[str]:
        folder = root / name
        return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []

    def headers_of(name: str, files: list[str]) -> list[SafetensorsHeader]:
        return [_file_header(root / name / f, f"{name}/{f}") for f in files]

    return _per_component(model_index, files_of, headers_of, variant)


def _read_model_index(raw: bytes | None, where: str) -> dict[str, Any]:
    if raw is None:
        raise DDUFError(f"{where}: no model_index.json (is this a diffusers pipeline?)")
    return model_index_object(raw, f"{where}/{spec.MODEL_INDEX}", DDUFError)


def _file_header(path: Path, entry: str) -> SafetensorsHeader:
    return read_file_header(path, entry, DDUFError)


# --- the Hub -----------------------------------------------------------------------------------------
def _from_hub(repo_id: str, *, variant: str | None, revision: str | None, token: str | bool | None) -> dict[str, ComponentDtypes]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        files = api.list_repo_files(repo_id, revision=revision, token=token)
        if spec.MODEL_INDEX not in files:
            archives = [f for f in files if f.endswith(".dduf")]
            if len(archives) == 1:  # a DDUF repo: read the archive's headers by range requests
                at = f"@{revision}" if revision else ""
                options = {"token": token} if token is not None else {}
                return _from_archive(f"hf://{repo_id}{at}/{archives[0]}", variant, **options)
            raise DDUFError(f"{repo_id}: no model_index.json at the repo root"
                            + (f" and {len(archives)} .dduf files (pass one by URL)" if archives else ""))
        path = api.hf_hub_download(repo_id, spec.MODEL_INDEX, revision=revision, token=token)
        model_index = _read_model_index(Path(path).read_bytes(), repo_id)

        def files_of(name: str) -> list[str]:
            prefix = name + "/"
            return sorted(f[len(prefix):] for f in files if f.startswith(prefix) and "/" not in f[len(prefix):])

        def headers_of(name: str, chosen: list[str]) -> list[SafetensorsHeader]:
            return [_hub_header(api.parse_safetensors_file_metadata(repo_id, f"{name}/{f}", revision=revision,
                                                                   token=token), f"{name}/{f}")
                    for f in chosen]

        return _per_component(model_index, files_of, headers_of, variant)
    except HfHubHTTPError as e:
        raise DDUFError(f"{repo_id}: {e}") from None
    except OSError as e:  # offline mode, unreachable host, missing cache entry
        cached = _from_hub_cache(repo_id, variant=variant, revision=revision)
        if cached is None:
            raise DDUFError(f"{repo_id}: cannot reach the Hub ({e})") from None
        return cached


def _from_hub_cache(repo_id: str, *, variant: str | None, revision: str | None) -> dict[str, ComponentDtypes] | None:
    """Offline: the repo as the Hugging Face cache holds it (its archive, or its folder layout), as
    ``load_dduf`` reads it offline; None when it is not cached."""
    from .loading.folder_source import hub_pipeline

    try:
        kind, where = hub_pipeline(repo_id, revision=revision, variant=variant, local_files_only=True)
    except DDUFError:
        return None
    return _from_folder(where, variant) if kind == "folder" else _from_archive(str(where), variant)


def _hub_header(meta: Any, entry: str) -> SafetensorsHeader:
    """huggingface_hub's SafetensorsFileMetadata as our header record (torch dtype names)."""
    tensors = {}
    for name, info in meta.tensors.items():
        dtype = spec.DTYPE_BY_SAFETENSORS.get(info.dtype)
        if dtype is None:
            raise DDUFError(f"{entry}:{name}: unknown dtype {info.dtype!r}")
        begin, end = info.data_offsets
        tensors[name] = TensorInfo(name, dtype.torch, tuple(info.shape), begin, end)
    return SafetensorsHeader(0, tensors, meta.metadata or None)
