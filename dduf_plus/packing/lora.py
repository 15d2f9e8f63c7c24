"""LoRA archives: ``dduf pack LORA.safetensors --base BASE`` stores the adapter file byte for byte under
``_lora/`` and references every component of BASE, checked by content as ``--base`` does (docs/lora.md).

Every adapter is checked against BASE before anything is written: its file is hostile input (header budgets,
A002-A004), each module it targets must exist in BASE's component with shapes that fit (A005/A006), and what
its trainer recorded (ModelSpec, kohya) must not name another family (A007, said as a warning)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .._version import __version__
from ..errors import DDUFPackError
from ..format.lora import (
    ADAPTER_NAME,
    LORA_CONFIG,
    LORA_FOLDER,
    LORA_KEY,
    LORA_MARKER,
    METADATA_SHOWN,
    LoraFile,
    check_against_base,
    lora_config,
    lora_file_findings,
    metadata_family,
    pipeline_family,
    read_lora,
    resolve_target,
    trigger_words,
)
from ..format.pack import EntrySource, FolderPlan, PackResult, write_archive
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, read_file_header
from ..format.structure import component_specs
from ..format.weights import select_weights, tensor_files
from ..sizes import format_size

logger = logging.getLogger(__name__)


class LoraInput(NamedTuple):
    """One adapter to pack: its file, the adapter name it loads under, its weight (scale)."""

    path: Path
    name: str
    weight: float = 1.0


_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})=)?(?P<path>.+?)(?:@(?P<weight>[-+0-9.eE]+))?$")


def parse_lora_arg(text: str | os.PathLike | LoraInput) -> LoraInput:
    """``[NAME=]FILE[@WEIGHT]`` (CLI ``--lora``) as a :class:`LoraInput`; NAME defaults to the file's stem."""
    if isinstance(text, LoraInput):
        return text
    raw = os.fspath(text)
    if os.path.exists(raw):  # a path that happens to hold '=' or '@' is a path
        return LoraInput(Path(raw), default_name(Path(raw)))
    match = _SPEC.match(raw)
    if match is None:
        raise DDUFPackError(f"--lora {raw!r}: expected [NAME=]FILE[@WEIGHT]")
    path = Path(match["path"])
    try:
        weight = float(match["weight"]) if match["weight"] else 1.0
    except ValueError:
        raise DDUFPackError(f"--lora {raw!r}: weight {match['weight']!r} is not a number") from None
    return LoraInput(path, match["name"] or default_name(path), weight)


def default_name(path: Path) -> str:
    """An adapter name from a file name: its stem, reduced to the characters peft and the archive accept."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem).strip("._-") or "lora"
    return stem[:64] if stem[0].isalnum() else f"lora_{stem}"[:64]


def looks_like_lora(header: SafetensorsHeader) -> bool:
    """A safetensors file whose tensors are LoRA pairs (and alphas/extras) only: an adapter, not a checkpoint."""
    lora = read_lora(header)
    return bool(lora.modules) and not lora.unknown


def is_lora_file(source: str | os.PathLike) -> bool:
    """``[NAME=]FILE[@WEIGHT]`` names a local ``.safetensors`` file whose header holds LoRA pairs only (reads the
    header; a file that cannot be read is not called a LoRA: the checkpoint path says why)."""
    try:
        item = parse_lora_arg(source)
    except DDUFPackError:
        return False
    if not (item.path.suffix == ".safetensors" and item.path.is_file()):
        return False
    try:
        return looks_like_lora(read_file_header(item.path, item.path.name, DDUFPackError))
    except (DDUFPackError, OSError):
        return False


class CheckedAdapter(NamedTuple):
    """An adapter file checked against a base: its header, LoRA structure and the record config.json keeps."""

    source: LoraInput
    header: SafetensorsHeader
    lora: LoraFile
    record: dict[str, Any]
    data: bytes | None = None  # the file's bytes when it was serialised in memory (save_dduf), not read from a path


def read_adapter(item: LoraInput) -> tuple[SafetensorsHeader, LoraFile]:
    """The adapter file's checked header and LoRA structure (A002-A004; alphas read from the file)."""
    where = str(item.path)
    if not item.path.is_file():
        raise DDUFPackError(f"LoRA {where} does not exist")
    header = read_file_header(item.path, item.path.name, DDUFPackError)
    lora = read_lora(header)
    with open(item.path, "rb") as f:
        def read(info: TensorInfo) -> bytes:
            f.seek(header.data_start + info.begin)
            return f.read(info.nbytes)

        problems = [p for p in lora_file_findings(lora, item.path.name, read) if p.severity == "error"]
    if problems:
        raise DDUFPackError(f"LoRA {where}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return header, lora


class BaseView(NamedTuple):
    """What checking an adapter needs of BASE: its model_index.json and each component's tensor headers."""

    spec: str
    model_index: dict[str, Any]
    tensors: Any  # Callable[[str], dict[str, TensorInfo]]


def check_adapter(item: LoraInput, base: BaseView) -> CheckedAdapter:
    """Check ``item`` against BASE (A002-A007) and describe it for ``_lora/config.json``.

    Raises:
        DDUFPackError: the file is not a sane LoRA, or does not fit BASE.
    """
    if not ADAPTER_NAME.match(item.name):
        raise DDUFPackError(f"LoRA {item.path}: adapter name {item.name!r} is not a plain name (letters, digits, "
                            "'_', '.', '-'; at most 64)")
    header, lora = read_adapter(item)
    components = {n: c for n, c in component_specs(base.model_index).items() if c[0] is not None}
    targets: dict[str, Any] = {}
    resolved = {target: resolve_target(target, components) for target in lora.targets()}
    for target, modules in sorted(lora.targets().items()):  # every target first: A005 says more than A006
        if resolved[target] is None:
            raise DDUFPackError(f"LoRA {item.path}: A005 {len(modules)} module(s) target {target} "
                                f"(e.g. {modules[0].key!r}), which BASE {base.spec} does not have "
                                f"(it has {', '.join(sorted(components))})")
    for target, modules in sorted(lora.targets().items()):
        component = resolved[target]
        assert component is not None
        check = check_against_base(modules, component, base.tensors(component))
        if check.problems:
            raise DDUFPackError(f"LoRA {item.path}: A006 {check.problems[0]} in BASE {base.spec}/{component}")
        if lora.layout == "diffusers" and check.unmatched:
            raise DDUFPackError(f"LoRA {item.path}: A006 module {check.unmatched[0]!r} is not in BASE "
                                f"{base.spec}/{component} ({len(check.unmatched)} of {len(modules)} modules are not)")
        ranks = sorted({m.rank for m in modules if m.rank})
        targets[component] = {"modules": len(modules), "ranks": ranks, "checked_by_name": check.matched}
    _say_family(item, lora, base)
    meta = {k: lora.metadata[k] for k in METADATA_SHOWN if k in lora.metadata and len(lora.metadata[k]) <= 512}
    record = {"name": item.name, "file": f"{item.name}.safetensors", "weight": item.weight, "layout": lora.layout,
              "targets": targets, "size": item.path.stat().st_size, "base": base.spec, "metadata": meta}
    if words := trigger_words(lora.metadata):
        record["trigger_words"] = words
    return CheckedAdapter(item, header, lora, record)


def _say_family(item: LoraInput, lora: LoraFile, base: BaseView) -> None:
    said = metadata_family(lora.metadata)
    mine = pipeline_family(base.model_index.get("_class_name"))
    if said is not None and mine is not None and said[0] != mine:
        logger.warning("LoRA %s: A007 its %s (%r) names %s, BASE %s is %s (%s): check the base",
                       item.path.name, said[1], lora.metadata.get(said[1]), said[0], base.spec, mine,
                       base.model_index.get("_class_name"))


def describe_lora_file(path: Path, base: str | None = None, *, token: str | bool | None = None,
                       local_files_only: bool = False) -> dict[str, Any]:
    """``dduf info``'s record of a LoRA file (as :func:`~dduf_plus.format.lora.describe_adapters` gives for an
    archive's): checked against ``base`` when given (:func:`check_adapter`), else on its own (A002-A004)."""
    item = parse_lora_arg(path)
    header, lora = read_adapter(item)
    targets = {t: {"modules": len(ms), "ranks": sorted({m.rank for m in ms if m.rank})}
               for t, ms in sorted(lora.targets().items())}
    if base:
        from .single_file_base import open_base

        the_base = open_base(os.fspath(base), token, local_files_only)
        try:
            targets = check_adapter(item, base_view(the_base)).record["targets"]
        finally:
            if the_base.archive is not None:
                the_base.archive.close()
    metadata = {k: v[:200] for k, v in lora.metadata.items() if k in METADATA_SHOWN}
    return {"name": item.name, "file": str(item.path), "weight": item.weight, "layout": lora.layout,
            "bytes": item.path.stat().st_size, "tensors": len(header.tensors), "base": os.fspath(base) if base else None,
            "targets": targets, "metadata": metadata, "trigger_words": trigger_words(lora.metadata)}


def adapter_sources(adapters: Sequence[CheckedAdapter]) -> list[EntrySource]:
    """``_lora/config.json`` and each adapter's file, copied byte for byte."""
    names = [a.source.name for a in adapters]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise DDUFPackError(f"two adapters are named {duplicate!r}: give one another name ([NAME=]FILE)")
    config = lora_config([a.record for a in adapters], __version__)
    raw = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    sources = [EntrySource(LORA_CONFIG, data=raw)]
    for a in adapters:
        name = f"{LORA_FOLDER}/{a.record['file']}"
        sources.append(EntrySource(name, data=a.data, header=a.header) if a.data is not None
                       else EntrySource(name, path=a.source.path, header=a.header))
    return sources


def saved_adapter_sources(adapters: Sequence[Any], comparer: Any) -> list[EntrySource]:
    """``_lora/`` entries for adapters serialised from a live pipeline (``save_dduf``: each has ``name``,
    ``data``, ``weight``, ``components``). peft built them on the pipeline's own modules, so they fit it; the
    file is still checked as any adapter is (A002-A004)."""
    from ..format.safetensors_header import checked, read_header_length
    from ..format.safetensors_header import parse_header as parse

    out: list[CheckedAdapter] = []
    for a in adapters:
        n = read_header_length(a.data[:8])
        header = checked(*parse(a.data[8: 8 + n], n, len(a.data), a.name), f"adapter {a.name}", DDUFPackError)
        lora = read_lora(header)
        start = header.data_start

        def read(info: TensorInfo, data: bytes = a.data, start: int = start) -> bytes:
            return data[start + info.begin: start + info.end]

        problems = [p for p in lora_file_findings(lora, a.name, read) if p.severity == "error"]
        if problems:
            raise DDUFPackError(f"adapter {a.name}: {problems[0]}")
        targets = {c: {"modules": len(ms), "ranks": sorted({m.rank for m in ms if m.rank})}
                   for c, ms in sorted(lora.targets().items())}
        record = {"name": a.name, "file": f"{a.name}.safetensors", "weight": a.weight, "layout": lora.layout,
                  "targets": targets, "size": len(a.data), "base": str(comparer.spec) if comparer else None,
                  "metadata": {}}
        out.append(CheckedAdapter(LoraInput(Path(f"{a.name}.safetensors"), a.name, a.weight), header, lora, record,
                                  a.data))
    return adapter_sources(out)


def with_lora_key(model_index: Mapping[str, Any]) -> dict[str, Any]:
    """model_index.json naming the ``_lora`` folder (huggingface_hub requires every folder be named there)."""
    out = dict(model_index)
    out[LORA_KEY] = list(LORA_MARKER)
    return out


def base_view(base: Any) -> BaseView:
    """A :class:`BaseView` of an opened BASE (packing.single_file's BASE: a folder, snapshot or archive)."""
    cache: dict[str, dict[str, TensorInfo]] = {}

    def tensors(name: str) -> dict[str, TensorInfo]:
        if name not in cache:
            cache[name] = _base_tensors(base, name)
        return cache[name]

    return BaseView(base.spec, base.model_index, tensors)


def _base_tensors(base: Any, name: str) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    if base.archive is not None:
        for tname, (_entry, info) in base.archive.tensor_infos(name).items():
            out[tname] = info
        return out
    folder = Path(base.folder) / name
    for file in tensor_files(select_weights(base.files(name))):
        try:
            header = read_file_header(folder / file, f"{name}/{file}", DDUFPackError)
        except OSError as e:
            raise DDUFPackError(f"--base {base.spec}: {name}/{file} cannot be read ({e})") from None
        out.update(header.tensors)
    return out


def pack_lora(
    loras: Sequence[str | os.PathLike | LoraInput],
    output: str | os.PathLike,
    *,
    base: str | os.PathLike | None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    quiet: bool = False,
    fsync: bool = True,
) -> tuple[PackResult, Any]:
    """Pack LoRA adapter files as an archive that references every component of ``base``.

    Example:
        >>> pack_lora(["pixel.safetensors", "ink=ink_v2.safetensors@0.6"], "styles.dduf",
        ...           base="stable-diffusion-v1-5/stable-diffusion-v1-5")

    Raises:
        DDUFPackError: no BASE, an adapter that is not a sane LoRA or does not fit BASE; nothing is written.
    """
    from .partial import make_references, model_index_with
    from .single_file_base import open_base

    started = time.perf_counter()
    items = [parse_lora_arg(x) for x in loras]
    if not items:
        raise DDUFPackError("no LoRA file given")
    if not base:
        raise DDUFPackError(f"{items[0].path} is a LoRA: give --base BASE (the pipeline it was trained on: a "
                            "folder, a Hub repo id or a .dduf)")
    the_base = open_base(os.fspath(base), token, local_files_only)
    try:
        view = base_view(the_base)
        adapters = [check_adapter(item, view) for item in items]
        sources = adapter_sources(adapters)
        real = sorted(n for n, (lib, _c) in component_specs(the_base.model_index).items() if lib is not None)
        plan = FolderPlan(the_base.model_index, the_base.model_index_bytes, sources, [], the_base.folder)
        partial = make_references(plan, exclude=real, refs={"*": the_base.spec}, token=token,
                                  local_files_only=local_files_only)
    finally:
        if the_base.archive is not None:
            the_base.archive.close()
    model_index, raw = model_index_with(with_lora_key(the_base.model_index), the_base.model_index_bytes,
                                        partial.references)
    report = [adapter_line(a) for a in adapters] + list(partial.report)
    for line in report:
        logger.info("%s", line)
    result = write_archive(output, model_index, raw, sources, references=partial.references or None,
                           quiet=quiet, fsync=fsync)
    return result._replace(seconds=time.perf_counter() - started), partial._replace(report=report)


def adapter_line(a: CheckedAdapter) -> str:
    """One report line: ``adapter pixel (kohya, 1.2 MB): unet 64 modules rank 4, text_encoder 12 (weight 1)``."""
    parts = [f"{c} {t['modules']} modules rank {'/'.join(map(str, t['ranks']))}" for c, t in a.record["targets"].items()]
    return (f"adapter {a.source.name} ({a.lora.layout}, {format_size(a.record['size'])}, weight {a.source.weight:g}): "
            + ", ".join(parts))
