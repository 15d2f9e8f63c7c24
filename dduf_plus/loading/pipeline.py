"""``load_dduf``: a ready-to-call diffusers pipeline from a DDUF archive, weights viewing the archive's mmap."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import (
    DDUFError,
    DDUFLoadError,
    DDUFNotFoundError,
    DDUFReferenceError,
    DDUFUsageError,
    DDUFValidationError,
)
from ..format.archive import DDUFArchive
from ..format.pipeline_kinds import LIST_CLASSES, LIST_LIBRARY, list_parts, part_owner
from ..format.validate import load_findings
from ..format.weights import variants
from ..storage.urls import is_url
from ..torchkit.backend_import import offline_imports
from ..torchkit.quiet import quiet_imports
from .arguments import (
    check_adapters,
    check_dtype_kind,
    check_flags,
    check_hub_options,
    check_optional,
    check_passed_component,
    check_sources,
    from_pretrained_options,
    source_path,
)
from .bridge import install_bridge
from .components import build_component, did_you_mean, resolve_class
from .dtypes import AUTO, requested_for, resolve_request
from .files import ArchiveComponentFiles, ComponentFiles
from .folder_source import FOLDER, FolderPipeline
from .gated_files import gate
from .gc_pause import collector_paused
from .lora import apply_adapters
from .models import ModelRequest, quiet_transformers
from .prefetch import Prefetcher

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # diffusers' root may type it as a dummy

    from ..remote.fetch import RemoteFetch

logger = logging.getLogger(__name__)

_UNSUPPORTED_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def load_dduf(  # long: its signature is from_pretrained's keywords (27 lines), each checked first
    path: str | bytes | os.PathLike,
    torch_dtype: Any = AUTO,
    *,
    dduf_file: str | None = None,
    dtype: Any = None,
    device: Any = None,
    device_map: Any = None,
    variant: str | None = None,
    refs: Any = None,
    local_files_only: bool | None = False,
    token: str | bool | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    verify: bool = True,
    use_mmap: bool = True,
    prefetch: bool = False,
    allow_missing_weights: bool = False,
    max_decompressed: Any = None,
    remote: Any = None,
    model_dirs: Any = None,
    adapters: Any = None,
    adapter_weights: Mapping[str, float] | None = None,
    fuse_lora: bool = False,
    **kwargs: Any,
) -> DiffusionPipeline:
    """Load the pipeline a ``.dduf`` archive holds, ready to call.

    Models are built on the meta device from their configs and given tensors that view the archive's
    memory map: on CPU in the saved dtype nothing is copied. Mixed-precision pipelines run as saved
    through the precision bridge (``dduf_plus.loading.bridge``).

    Args:
        path: a local ``.dduf`` file, or a ``.dduf.zst`` (decompressed once into a cache, then mapped), or a
            Hub repo id (``"org/name"``, not an existing local path) holding the archive, or a URL
            (``https://``, ``s3://``, ``gs://``, ``hf://``...): fetched by concurrent range requests into a
            content-keyed cache (``cache_dir("remote")``), each entry checked against the index's sha256 as it
            arrives, each component built as soon as its bytes are here; an interrupted load resumes; a second
            load makes one small request (none with ``local_files_only`` or ``HF_HUB_OFFLINE``).
        dduf_file: the archive's file name in the Hub repo ``path`` (as diffusers 0.35's
            ``from_pretrained(repo, dduf_file=...)``; a local folder ``path`` holding it works too); optional
            when the repo holds exactly one ``.dduf``.
            Downloaded through huggingface_hub into its cache (``revision``, ``token``, ``cache_dir``,
            ``local_files_only`` / ``HF_HUB_OFFLINE`` apply); offline with it cached, no request is made.
        torch_dtype: ``"auto"`` (each component in the dtype it was saved in: see docs/loading.md; None, as
            diffusers' default, means the same), a floating torch dtype, a name (``"bfloat16"``) or
            {component: dtype, "default": dtype}.
        dtype: diffusers' newer spelling of ``torch_dtype`` (both given: they must agree).
        device, device_map: ``"cpu"`` (default), ``"cuda"``, ``"cuda:1"``, a CUDA index, a ``torch.device``,
            or {component: device, "default": ...}; placement strategies (``"auto"``, ``"balanced"``) are refused.
        variant: weight variant (``"fp16"``): components that have it load it, the others their default weights;
            a variant no component has is an error naming the archive's variants, before anything is imported.
        refs, local_files_only, token, revision, cache_dir, verify: ``refs={component: source}`` (a folder, a
            ``.dduf``, a Hub repo id ``org/name[@rev][:subfolder]`` or a URL; ``"*"`` for all) and the Hub's
            options (``local_files_only`` also takes diffusers' default None): how components stored elsewhere
            (external references) are resolved and checked; ``verify`` also checks the CRC-32 of the
            archive's small entries. ``revision`` is the Hub revision of the archive's repo when ``path`` is
            a repo id, and the revision of references that record none (references written by ``dduf pack``
            pin the commit they were checked against, which wins).
        model_dirs: app model folders (ComfyUI's ``models/vae``...; also ``DDUF_PLUS_MODEL_DIRS``) where a
            referenced component is found by its tensors' digest, after local copies and before any download
            (:mod:`dduf_plus.refs.model_dirs`).
        use_mmap: False reads each tensor into its own buffer with ``os.preadv`` (network file systems).
        prefetch: read the weights in on a background thread while the modules are being built (off by
            default: measured slower than the faults of the first use, cold and warm; docs/loading.md).
        max_decompressed: the decompression budget for a ``.dduf.zst`` (``"64G"``, ``"32x"``, ``"64G,32x"``,
            ``"unlimited"``; default: ``$DDUF_PLUS_MAX_DECOMPRESSED`` or 256 GiB and 16x past 256 MiB).
        remote: how a URL is fetched: a ``dduf_plus.remote.fetch.RemoteOptions`` or a dict of its fields,
            e.g. ``{"concurrency": 16, "chunk_size": 16 << 20, "timeout": 10, "storage_options": {...}}``
            (docs/loading.md, "Remote archives").
        adapters, adapter_weights, fuse_lora: a LoRA archive's adapters (docs/lora.md): all are applied through
            diffusers' ``load_lora_weights``, each with its stored weight, unless ``adapters`` names some
            (``["pixel"]``) or none (``False``); ``adapter_weights={"pixel": 0.7}`` overrides weights;
            ``fuse_lora=True`` merges them into the weights and removes the LoRA layers.
        allow_missing_weights: load a transformers model whose stored weights do not cover all of its
            parameters (the rest randomly initialised, with a warning); by default that is an error.
        **kwargs: components to use instead of the archive's (``vae=my_vae``, ``safety_checker=None``; one of
            another kind than the archive's component, ``unet=5``, is refused as diffusers refuses it) and
            pipeline ``__init__`` options, as with ``DiffusionPipeline.from_pretrained``. That method's own
            keywords: ``disable_mmap=True`` is ``use_mmap=False``; ``low_cpu_mem_usage`` (either bool),
            ``use_safetensors=True``, ``force_download=False``, ``trust_remote_code=False`` and ``None`` for
            the others change nothing; any other value of ``force_download``, ``proxies``,
            ``custom_pipeline``, ``custom_revision``, ``trust_remote_code``, ``provider``, ``sess_options``,
            ``provider_options``, ``use_onnx``, ``max_memory``, ``offload_folder``, ``offload_state_dict``,
            ``use_safetensors``, ``load_connected_pipeline``, ``quantization_config`` or ``use_flashpack``
            is refused saying why (``dduf_plus.loading.arguments.FROM_PRETRAINED``). Other unknown keywords are
            warned about and ignored, as diffusers does, unless close to a component's name (an error).

    Every argument is checked before the archive is opened: a wrong kind of value (``verify="no"``,
    ``adapters=[1]``, ``load_dduf(123)``) is a :class:`~dduf_plus.errors.DDUFUsageError` naming it.
    Libraries imported during the load (diffusers, transformers, torchao...) print no import-time notices
    (:mod:`dduf_plus.torchkit.quiet`); the caller's logging and warnings configuration is left as it is.

    Example:
        >>> pipe = load_dduf("tiny-sd.dduf", torch_dtype="auto")
        >>> image = pipe("a photo of a cat", num_inference_steps=2).images[0]

    Raises:
        DDUFUsageError: an argument of the wrong kind, or a ``from_pretrained`` option that cannot apply.
        DDUFNotFoundError: the file, folder or Hub repo does not exist (or is not cached, offline: the
            message says which setting keeps it offline and how to allow the download).
        DDUFValidationError: the file is not a valid DDUF archive (``.findings`` says why).
        DDUFLoadError: a component cannot be built; the message names it and says what to do.
        DDUFReferenceError: an external component cannot be resolved.
    """
    started = time.perf_counter()
    check_flags(verify=verify, use_mmap=use_mmap, prefetch=prefetch, allow_missing_weights=allow_missing_weights,
                fuse_lora=fuse_lora)
    check_optional("local_files_only", local_files_only, (bool,), "True, False or None")
    check_hub_options(token=token, revision=revision, cache_dir=cache_dir, variant=variant, dduf_file=dduf_file)
    model_dirs = check_sources(refs=refs, model_dirs=model_dirs, remote=remote, max_decompressed=max_decompressed)
    adapters = check_adapters(adapters, adapter_weights)  # iterables read once, into lists
    check_dtype_kind(torch_dtype, dtype)
    use_mmap, local_files_only = from_pretrained_options(kwargs, use_mmap), bool(local_files_only)
    path_str = source_path(path)
    # before the archive is opened (a URL connected to, a Hub file fetched): torch_dtype="int8" is the call's
    # mistake. The first load in a process imports torch here (see gc_pause).
    with collector_paused(), quiet_imports():
        request = resolve_request(torch_dtype, dtype)
    path_str, archive, fetch = _open_source(path_str, dduf_file, revision=revision, token=token,
                                            cache_dir=cache_dir, local_files_only=local_files_only,
                                            remote=remote, max_decompressed=max_decompressed, variant=variant)
    device_for = _device_resolver(device, device_map)
    mapped = archive.mmap if prefetch and use_mmap and fetch is None else None  # use_mmap=False: nothing mapped
    prefetcher = Prefetcher(mapped) if mapped is not None else None
    ctx = _Context(archive, path_str, request, device_for, variant, prefetcher,
                   resolve_options={"refs": refs, "local_files_only": local_files_only, "token": token,
                                    "revision": revision, "cache_dir": cache_dir, "verify": verify,
                                    "model_dirs": model_dirs},
                   use_mmap=use_mmap, verify=verify, allow_missing_weights=allow_missing_weights,
                   before_build=functools.partial(gate, fetch) if fetch is not None else None,
                   build_order=fetch.prioritize if fetch is not None else None,
                   device_keys=_device_keys(device, device_map))
    try:
        pipe = _load(ctx, kwargs)
        # a text encoder's adapter: transformers' "Loading weights" bar otherwise (no transformers: no bar)
        with quiet_transformers() if "transformers" in sys.modules else contextlib.nullcontext():
            apply_adapters(pipe, archive, adapters=adapters, adapter_weights=adapter_weights, fuse_lora=fuse_lora)
        if fetch is not None:
            fetch.finish()  # the rest of the archive, then the cache file is marked complete
        if prefetcher is not None:  # not waited for: waiting measured slower (reclaim drops untouched pages)
            prefetcher.finish()
    except BaseException:
        if fetch is not None:
            fetch.abort()  # what has arrived stays, for the next load to resume from
        if prefetcher is not None:
            prefetcher.stop()
        raise
    finally:
        archive.close()  # the tensors keep the mapping alive; the file descriptor is not needed any more
    logger.info("loaded %s in %.2f s", path_str, time.perf_counter() - started)
    return pipe


def _open_source(path_str: str, dduf_file: str | None, *, revision: str | None, token: str | bool | None,
                 cache_dir: str | os.PathLike | None, local_files_only: bool, remote: Any,
                 max_decompressed: Any, variant: str | None = None) -> tuple[str, DDUFArchive | FolderPipeline, Any]:
    """The source ``load_dduf``'s first argument names: (path or URL, open archive or folder, the remote fetch
    or None).

    A local folder plus ``dduf_file`` is the file in it (diffusers 0.35); a local folder alone is a diffusers
    pipeline folder; a Hub repo id is its archive or, for a repo without one, its folder layout (only the
    files the pipeline needs downloaded); a URL is fetched into the remote cache (components are built as
    their bytes arrive); a ``.dduf.zst`` is decompressed once into a content-keyed cache."""
    if dduf_file is not None and os.path.isdir(path_str):
        path_str = os.path.join(path_str, dduf_file)
    elif os.path.isdir(path_str):
        return path_str, _open_folder(path_str), None
    elif dduf_file is not None or _is_hub_repo(path_str):
        from .folder_source import hub_pipeline

        kind, where = hub_pipeline(path_str, dduf_file, revision=revision, variant=variant, token=token,
                                   cache_dir=cache_dir, local_files_only=local_files_only)
        if kind == "folder":  # a repo in diffusers' folder layout: its snapshot, named as the caller named it
            return path_str, FolderPipeline(where, display=path_str), None
        path_str = os.fspath(where)
    if is_url(path_str):
        archive, fetch = _open_url(path_str, remote, local_files_only)
        return path_str, archive, fetch
    if _is_zst(path_str):
        from ..storage.zst_cache import cached_decompress

        return path_str, DDUFArchive(str(cached_decompress(path_str, max_decompressed=max_decompressed))), None
    return path_str, DDUFArchive(path_str), None


def _is_zst(path: str) -> bool:
    """``storage.zst.is_zst`` (a suffix), without importing the zstd and remote modules a local load never
    uses (they are imported when a ``.dduf.zst`` or a URL comes: a fresh process's first load pays less)."""
    return path.endswith(".zst")


def _is_hub_repo(path: str) -> bool:
    """``org/name[@revision]`` that is no local path (an existing path wins, as in ``from_pretrained``)."""
    if os.path.exists(path) or is_url(path):  # a local load does not import the Hub module
        return False
    from ..remote.hub import hub_repo_of

    return hub_repo_of(path) is not None


def _open_folder(path: str) -> FolderPipeline:
    """A local diffusers pipeline folder; one without model_index.json says what load_dduf reads."""
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        archives = sorted(n for n in os.listdir(path) if n.endswith((".dduf", ".dduf.zst")))
        hint = (f"; it holds {', '.join(archives)}: load_dduf({path!r}, dduf_file={archives[0]!r})" if archives
                else "")
        raise DDUFNotFoundError(f"{path}: a folder without model_index.json is no diffusers pipeline; load_dduf reads "
                                f"a pipeline folder, a .dduf archive, a Hub repo or a URL{hint}", path)
    return FolderPipeline(path)


class _TorchvisionFallbackNotice(logging.Filter):
    """transformers says, once per image-processor class diffusers imports, that without torchvision it uses
    the PIL implementation: harmless for loading a pipeline, and not the user's concern. Only that notice is
    dropped; every other transformers message still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


def _quiet_torchvision_notice() -> None:
    target = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _TorchvisionFallbackNotice) for f in target.filters):
        target.addFilter(_TorchvisionFallbackNotice())


_quiet_torchvision_notice()  # before anything imports diffusers' pipeline modules through us


@dataclass
class _Context:
    """What every step of one load needs to know."""

    archive: DDUFArchive | FolderPipeline  # a folder: the files an archive packed from it would hold
    path: str  # as the caller gave it (a local path or a URL): messages and ``_name_or_path`` use it
    request: Any
    device_for: Callable[[str], torch.device]
    variant: str | None
    prefetcher: Prefetcher | None
    resolve_options: dict[str, Any]
    use_mmap: bool = True
    verify: bool = True
    allow_missing_weights: bool = False
    # a remote fetch: the component's files, reading only entries that have arrived and matched (a model is
    # constructed while its weights still arrive)
    before_build: Callable[[str, ComponentFiles], ComponentFiles] | None = None
    build_order: Callable[[list[str]], None] | None = None  # a remote fetch: fetch components in this order
    device_keys: tuple[str, ...] | None = None  # the components a device_map={...} names (checked like dtypes')


@dataclass
class _Plan:
    """The pipeline class, what to build and what the caller passed, from model_index.json and kwargs."""

    pipeline_class: type[DiffusionPipeline]
    expected_modules: set[str]
    passed_components: dict[str, Any]
    init_kwargs: dict[str, Any]
    to_build: dict[str, tuple[str, str]]
    # list components (Multi-ControlNet, Multi-Adapter): {name: its parts' folders, itself first}
    parts: dict[str, list[str]] = field(default_factory=dict)

    def folders(self) -> list[str]:
        """The stored components to read, in build order: each list component's parts in its place."""
        return [part for name in self.to_build if name not in self.passed_components
                for part in self.parts.get(name, [name])]


def _load(ctx: _Context, kwargs: dict[str, Any]) -> DiffusionPipeline:
    if ctx.build_order is None:
        _refuse_what_validate_refuses(ctx)
    _check_names(ctx)
    _check_variant(ctx, kwargs)
    _refuse_unbuildable(ctx, kwargs)
    with collector_paused():  # imports the pipeline's module: diffusers and transformers, the first time
        plan = _plan(ctx, kwargs)
    if ctx.build_order is not None:
        ctx.build_order(plan.folders())
        _refuse_what_validate_refuses(ctx)  # reads tokenizer files: once the fetch brings them in build order
    with _one_search(ctx.archive.references):  # model folders walked and read once for every reference
        sources = {name: _component_files(ctx.archive, name, ctx.archive.components, ctx.archive.references,
                                          ctx.resolve_options, use_mmap=ctx.use_mmap, verify=ctx.verify,
                                          prefetcher=ctx.prefetcher)
                   for name in plan.folders()}
    if ctx.prefetcher is not None:  # queue every model's weights now, in build order: I/O overlaps construction
        for files in sources.values():
            _queue_prefetch(files, ctx.variant)
    # Building a local pipeline's models creates ~100,000 objects that all live on: with the collector paused
    # they are walked once when it resumes, instead of by ~50 young and 4 middle-generation collections
    # (a third less collector time). A remote build waits for bytes in between: not paused (see gc_pause).
    with collector_paused() if ctx.before_build is None else contextlib.nullcontext():
        _build_components(ctx, plan, sources)
    return _assemble(ctx, plan)


def _check_names(ctx: _Context) -> None:
    """Component names in ``torch_dtype={...}``, ``device_map={...}`` and ``refs={...}`` are the archive's, never
    ignored: a typo (``"unte"``) is an error naming it, the closest component and the components; so is a
    further part of a list component (``"controlnet_1"``), which is built with the list's dtype and device."""
    from ..assignments import LoadNameError, check_names

    components = list(ctx.archive.components)
    for what, keys, wildcards in (("torch_dtype={...} key", ctx.request, ("default",)),
                                  ("device_map={...} key", ctx.device_keys, ("default", ""))):
        if isinstance(keys, (Mapping, tuple)):
            check_names(keys, components, what=what, where=ctx.path, error=LoadNameError, wildcards=wildcards)
            _refuse_part_keys(ctx, what, keys)
    if ctx.resolve_options.get("refs"):  # dduf_plus.refs is imported only when there is something to check
        from ..refs.resolve import check_ref_names

        check_ref_names(ctx.resolve_options["refs"], components, ctx.archive.references, what="refs={...} key",
                        where=ctx.path)


def _refuse_part_keys(ctx: _Context, what: str, keys: Any) -> None:
    """diffusers builds every part of a Multi-ControlNet / Multi-Adapter with the list's arguments, and a list
    of parts in several dtypes or on several devices fails at the first step: a key naming a part is refused."""
    from ..assignments import LoadNameError

    model_index = ctx.archive.model_index
    owned = {key: owner for key in keys if (owner := part_owner(model_index, str(key))) is not None}
    if owned:
        key, owner = next(iter(owned.items()))
        raise LoadNameError(f"{what} {key}: a part of list component {owner!r} ({model_index[owner][1]}), whose "
                            f"parts are all built with the list's dtype and device, as diffusers builds them; "
                            f"give {owner!r} instead", names=list(owned), known=list(ctx.archive.components),
                            suggestions={k: o for k, o in owned.items()})


def _refuse_what_validate_refuses(ctx: _Context) -> None:
    """The rules validate runs beyond opening (JSON entries within their budgets, shard indexes, the index,
    tokenizer and weightless-config budgets), with validate's codes: before any component is built or any
    library sees a byte of the archive; for a local archive before the pipeline class is even resolved."""
    if isinstance(ctx.archive, FolderPipeline):
        problems, kind = ctx.archive.findings(), FOLDER
    else:
        problems, kind = [f for f in load_findings(ctx.archive) if f.severity == "error"], "DDUF archive"
    if problems:
        raise DDUFValidationError(ctx.path, problems, kind=kind)


def _refuse_unbuildable(ctx: _Context, kwargs: Mapping[str, Any]) -> None:
    """D016 (a model component stored without weights) and D017 (a component class its library does not have)
    as validate finds them, before anything is resolved; a component the caller passes (``unet=...``) is not
    built, so it is not asked about. (Building refuses both again with the same codes, should a check miss.)"""
    from ..format.class_names import class_findings, missing_weight_findings

    problems = [f for f in missing_weight_findings(ctx.archive.components.values())
                + class_findings(ctx.archive.model_index) if f.entry not in kwargs]
    if problems:
        named = sorted({str(f.entry) for f in problems})
        raise DDUFLoadError(f"{ctx.path}: " + "; ".join(f"{f.code} {f.entry}: {f.message}" for f in problems)
                            + f"; pass {'it' if len(named) == 1 else 'them'} yourself: load_dduf(..., "
                            + ", ".join(f"{n}=..." for n in named) + ")", code=problems[0].code)


@offline_imports  # imports diffusers, transformers and what they import: no Hub request (backend_import)
def _plan(ctx: _Context, kwargs: dict[str, Any]) -> _Plan:
    from diffusers import DiffusionPipeline

    model_index = dict(ctx.archive.model_index)
    model_index.pop("_ignore_files", None)
    parts = list_parts(model_index, [n for n, c in ctx.archive.components.items() if c.files])
    for key in [k for k in model_index if part_owner(model_index, k) is not None]:
        model_index.pop(key)  # a list's further parts: built into the list, never pipeline arguments
    pipeline_class = _pipeline_class(model_index, ctx.path)
    expected_modules, optional_kwargs = DiffusionPipeline._get_signature_keys(pipeline_class)
    passed_components = {k: kwargs.pop(k) for k in expected_modules if k in kwargs}
    passed_options = {k: kwargs.pop(k) for k in optional_kwargs if k in kwargs}
    try:
        init_dict, unused, _ = pipeline_class.extract_init_dict(model_index, **kwargs)
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # diffusers' own reading of odd values
        raise DDUFLoadError(f"{ctx.path}: model_index.json cannot be read as the config of "
                            f"{pipeline_class.__name__}: {type(e).__name__}: {e}") from e
    init_kwargs = {k: init_dict.pop(k) for k in optional_kwargs
                   if k in init_dict and k not in pipeline_class._optional_components}
    init_kwargs.update(passed_options)
    to_build = {k: (v[0], v[1]) for k, v in init_dict.items()  # (library, class name)
                if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] is not None
                and not (k in passed_components and passed_components[k] is None)}
    if unused:
        _refuse_component_typos(unused, expected_modules, pipeline_class.__name__)
        logger.warning("keyword arguments %s are not expected by %s and are ignored",
                       sorted(unused), pipeline_class.__name__)
    # Smallest stored components first (diffusers' init dict comes in set order, which changes from process
    # to process): one order every run, and the small ones are built while a remote fetch still brings weights.
    stored: dict[str, int] = {}
    for entry in ctx.archive.entries.values():
        component = entry.name.partition("/")[0]
        component = part_owner(model_index, component) or component  # a list's parts: in the list's place
        stored[component] = stored.get(component, 0) + entry.length
    to_build = dict(sorted(to_build.items(), key=lambda kv: (stored.get(kv[0], 0), kv[0])))
    return _Plan(pipeline_class, set(expected_modules), passed_components, init_kwargs, to_build,
                 {name: names for name, names in parts.items() if name in to_build})


def _refuse_component_typos(unused: Mapping[str, Any], components: Any, pipeline: str) -> None:
    """``load_dduf(path, vea=my_vae)`` is a misspelt component, never a silently ignored argument; other
    unexpected keywords (``use_safetensors=True`` from a from_pretrained call) are only warned about."""
    from ..assignments import LoadNameError, closest

    typos = {k: m for k in sorted(unused) if (m := closest(k, components)) is not None}
    if typos:
        args, names = ", ".join(f"{k}=..." for k in typos), ", ".join(typos)
        meant = ", ".join(f"{m}=" for m in typos.values())
        what = "is not a component" if len(typos) == 1 else "are not components"
        raise LoadNameError(f"load_dduf({args}): {names} {what} of {pipeline} (did you mean {meant}?); its components: "
                            f"{', '.join(sorted(components))}", names=list(typos), known=sorted(components),
                            suggestions=typos)


def _check_variant(ctx: _Context, kwargs: Mapping[str, Any]) -> None:
    """A variant that no component to be built has is refused from the archive's listing alone, naming the
    variants it holds: before diffusers is imported or anything is logged (a component the caller passes
    is not built, so its variants do not count)."""
    stored, variant = ctx.archive.components, ctx.variant
    if variant is None or any(variant in variants(c.files) for n, c in stored.items() if n not in kwargs):
        return
    present = sorted(set().union(*(variants(c.files) for c in stored.values())))
    held = (f"it holds variant{'s' if len(present) > 1 else ''} {', '.join(present)}" if present else
            "it holds no variant weights, only each component's default ones: load it without variant=")
    raise DDUFLoadError(f"{ctx.path}: no component has weights of variant {variant!r}; {held}")


def _build_components(ctx: _Context, plan: _Plan, sources: Mapping[str, ComponentFiles]) -> None:
    index = ctx.archive.index
    declared_all = index.get("components", {}) if isinstance(index, dict) else {}
    for name, (library, class_name) in plan.to_build.items():
        if name in plan.passed_components:
            plan.init_kwargs[name] = check_passed_component(name, plan.passed_components[name], library, class_name)
            continue
        t0 = time.perf_counter()
        with collector_paused(), quiet_imports():  # may import the component's module (a tokenizer's...)
            cls = resolve_class(name, library, class_name)
        declared = declared_all.get(name) if isinstance(declared_all, dict) else None
        model_request = ModelRequest(
            variant=ctx.variant,
            dtype=requested_for(ctx.request, name),
            device=ctx.device_for(name),
            declared=declared if isinstance(declared, dict) else None,
            name_or_path=os.path.join(ctx.path, name),
            materialize=_materializer(),
            allow_missing_weights=ctx.allow_missing_weights,
        )
        if name in plan.parts:
            plan.init_kwargs[name] = _build_list(ctx, cls, plan.parts[name], sources, model_request)
        else:
            files = sources[name] if ctx.before_build is None else ctx.before_build(name, sources[name])
            plan.init_kwargs[name] = build_component(cls, files, model_request)
        logger.debug("built %s (%s) in %.3f s", name, class_name, time.perf_counter() - t0)


def _build_list(ctx: _Context, list_cls: type[Any], parts: list[str], sources: Mapping[str, ComponentFiles],
                request: ModelRequest) -> Any:
    """A list component (``MultiControlNetModel``, ``MultiAdapter``) as diffusers' ``from_pretrained`` of the
    list builds it: each part from its own folder with the list's part class (never a class the archive
    names: D018 holds the archive to it), then the list of them. Every part gets the list's dtype and device."""
    owner = parts[0]
    part_cls = resolve_class(owner, LIST_LIBRARY, LIST_CLASSES[list_cls.__name__])
    index = ctx.archive.index
    declared_all = index.get("components", {}) if isinstance(index, dict) else {}
    models = []
    for part in parts:
        declared = declared_all.get(part) if isinstance(declared_all, dict) else None
        part_request = ModelRequest(variant=request.variant, dtype=request.dtype, device=request.device,
                                    declared=declared if isinstance(declared, dict) else None,
                                    name_or_path=os.path.join(ctx.path, part), materialize=request.materialize,
                                    allow_missing_weights=request.allow_missing_weights)
        files = sources[part] if ctx.before_build is None else ctx.before_build(part, sources[part])
        models.append(build_component(part_cls, files, part_request))
    try:
        return list_cls(models)
    except Exception as e:  # MultiAdapter refuses fewer than two adapters, or adapters that do not match
        raise DDUFLoadError(f"{ctx.path}: cannot build {owner!r} ({list_cls.__name__}) from its {len(parts)} "
                            f"part(s) {', '.join(parts)}: {type(e).__name__}: {e}") from e


def _assemble(ctx: _Context, plan: _Plan) -> DiffusionPipeline:
    pipeline_class, init_kwargs, passed = plan.pipeline_class, plan.init_kwargs, plan.passed_components
    missing = plan.expected_modules - set(init_kwargs)
    optional = set(pipeline_class._optional_components) | set(passed)
    if missing - optional:
        raise DDUFLoadError(f"{ctx.path}: {pipeline_class.__name__} needs {', '.join(sorted(missing - optional))}, "
                            "which model_index.json does not provide; pass "
                            + ", ".join(f"{m}=..." for m in sorted(missing - optional)))
    for name in missing:
        init_kwargs[name] = passed.get(name)
    try:
        pipe = pipeline_class(**init_kwargs)
    except DDUFError:
        raise
    except Exception as e:
        raise DDUFLoadError(f"{ctx.path}: cannot create {pipeline_class.__name__}: {type(e).__name__}: {e}") from e
    pipe.register_to_config(_name_or_path=ctx.path)
    bridged = install_bridge(pipe)
    if bridged:
        logger.info("%s: components in different dtypes, precision bridge on %s", ctx.path, ", ".join(bridged))
    return pipe


def _open_url(url: str, remote: Any, local_files_only: bool) -> tuple[DDUFArchive, RemoteFetch | None]:
    """The archive at ``url``: mapped from the remote cache when complete there, else opened over the fetch
    in progress (opening reads only the metadata, which is fetched first)."""
    from ..remote.fetch import CacheSource, RemoteFetch, open_remote

    if _is_zst(url):
        raise DDUFUsageError(f"{url}: remote .dduf.zst archives are not fetched by range; download the file "
                             "and load it locally, or serve the .dduf itself")
    opened = open_remote(url, remote, local_files_only=local_files_only)
    if not isinstance(opened, RemoteFetch):
        return DDUFArchive(opened), None
    try:
        return DDUFArchive(CacheSource(opened)), opened
    except BaseException:
        opened.abort()
        raise


def _pipeline_class(model_index: Mapping[str, Any], path: str) -> type[DiffusionPipeline]:
    import diffusers
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    name = model_index.get("_class_name")
    if not isinstance(name, str):
        raise DDUFLoadError(f"{path}: model_index.json has no _class_name")
    cls = getattr(diffusers, name.removeprefix("Flax"), None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, DiffusionPipeline)):
        # no rule code: validate leaves the pipeline class to `dduf pack`'s warning (D017 is for components)
        raise DDUFLoadError(f"{path}: model_index.json names the pipeline class {name!r}, which diffusers "
                            f"{diffusers.__version__} does not have{did_you_mean(name, diffusers)} (upgrade "
                            "diffusers?)")
    return cls


def _component_files(archive: DDUFArchive | FolderPipeline, name: str, stored: Mapping[str, Any], references: Mapping[str, Any],
                     resolve_options: dict[str, Any], *, use_mmap: bool, verify: bool,
                     prefetcher: Prefetcher | None) -> ComponentFiles:
    if name in references:
        try:
            from .files import resolve_component
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("dduf_plus.refs"):
                raise
            raise DDUFReferenceError(f"component {name!r} is stored outside {archive.path} "
                                     "(a reference) and this dduf_plus cannot resolve "
                                     f"references; pass it as an argument: load_dduf(..., {name}=...)") from None
        return resolve_component(name, references[name], use_mmap=use_mmap, **resolve_options)
    if name in stored and stored[name].files:
        if isinstance(archive, FolderPipeline):
            return archive.component_files(name, use_mmap=use_mmap)
        return ArchiveComponentFiles(archive, name, use_mmap=use_mmap, verify=verify, prefetcher=prefetcher)
    raise DDUFLoadError(f"component {name!r} is named in model_index.json but {archive.path} neither stores nor "
                        f"references it; pass it as an argument: load_dduf(..., {name}=...)")


def _one_search(references: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """One model-folder search (one walk, one header read per file, one budget) for all of a load's references."""
    try:
        from ..refs.model_dirs import search_session
    except ModuleNotFoundError:  # a dduf_plus without refs: _component_files says so per component
        return contextlib.nullcontext()
    return search_session() if references else contextlib.nullcontext()


def _queue_prefetch(files: ComponentFiles, variant: str | None) -> None:
    fetch = getattr(files, "prefetch", None)
    if fetch is None:
        return
    try:
        fetch(files.weight_files(variant))
    except DDUFError:
        pass  # the build reports it, with the component's name


def _device_resolver(device: Any, device_map: Any) -> Callable[[str], torch.device]:
    import torch

    if device is not None and device_map is not None and device != device_map:
        raise DDUFLoadError(f"device={device!r} and device_map={device_map!r} disagree; pass one of them")
    value, arg = (device, "device") if device is not None else (device_map, "device_map")
    if isinstance(value, Mapping):
        table = {str(k): _parse_device(v, arg) for k, v in value.items()}
        default = table.get("default", table.get("", torch.device("cpu")))
        return lambda name: table.get(name, default)
    one = _parse_device(value if value is not None else "cpu", arg)
    return lambda name: one


def _device_keys(device: Any, device_map: Any) -> tuple[str, ...] | None:
    value = device if device is not None else device_map
    return tuple(str(k) for k in value) if isinstance(value, Mapping) else None


def _parse_device(value: Any, arg: str = "device_map") -> torch.device:
    import torch

    if isinstance(value, str) and value in _UNSUPPORTED_DEVICE_MAPS:
        raise DDUFLoadError(f"{arg}={value!r} is not supported; give a device per component "
                            f"({arg}={{'unet': 'cuda:0', 'default': 'cuda:1'}})")
    try:
        dev = torch.device(value) if not isinstance(value, int) else torch.device("cuda", value)
    except (RuntimeError, TypeError) as e:
        raise DDUFLoadError(f"{arg}={value!r} is not a torch device ('cpu', 'cuda', 'cuda:1', a cuda index, or "
                            f"{{component: device}}): {str(e).splitlines()[0]}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DDUFLoadError(f"{arg}={value!r}: CUDA is not available in this torch")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# --- device / dtype transfer -----------------------------------------------------------------------------------
def _materializer() -> Callable[..., dict]:
    """``dduf_plus.loading.transfer.materialize`` (pinned, chunked streaming to CUDA); a plain per-tensor
    fallback while that module is absent."""
    try:
        from .transfer import materialize
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.transfer":
            raise
        return _materialize_fallback
    return materialize


def _materialize_fallback(tensors: Mapping[str, torch.Tensor], *, device: torch.device,
                          dtype_for: Callable[[str, torch.Tensor], torch.dtype | None]) -> dict[str, torch.Tensor]:
    out = {}
    for name in tensors:
        tensor = tensors[name]
        target = dtype_for(name, tensor)
        if target is None or target == tensor.dtype:
            out[name] = tensor if tensor.device == device else tensor.to(device)
        else:
            out[name] = tensor.to(device=device, dtype=target)  # one tensor at a time: never two full copies
    return out


__all__ = ["load_dduf"]
