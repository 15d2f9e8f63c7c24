"""``dduf info ARCHIVE|FOLDER [--json]``: one row per component under column headers; sizes in decimal
units (kB, MB, GB: 1 kB = 1000 bytes, as the Hub shows them), the same in every command's output."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ._common import (
    adapter_lines,
    budget_arg,
    echo,
    human_bytes,
    human_count,
    plain_archive,
    print_json,
    table,
)

FROM_INDEX = "from the archive's index; `dduf validate` reads every header"
HEADERS = ("COMPONENT", "CLASS", "DTYPE", "PARAMS", "SIZE", "NOTES")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="show components, dtypes, sizes and references of an archive or folder")
    p.add_argument("source", help="a .dduf archive (or a local .dduf.zst, or a URL), a diffusers pipeline folder, "
                   "a Hub repo (org/name[@revision]: its archive, or its folder layout), or a single-file "
                   ".safetensors checkpoint or LoRA file (docs/single_file.md, docs/lora.md)")
    p.add_argument("--variant", help="describe this weight variant (e.g. fp16)")
    p.add_argument("--base", metavar="BASE", help="for a single-file .safetensors checkpoint: what `dduf pack CKPT "
                   "--base BASE` would store and reference (converts and compares; writes nothing)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--max-decompressed", type=budget_arg, default=None, metavar="SIZE",
                   help="how far a .zst may expand (as dduf validate --max-decompressed)")
    p.set_defaults(func=run)


def describe_source(source: str, variant: str | None, max_decompressed: str | None = None) -> dict[str, Any]:
    """``describe`` of an archive or folder; a local ``.dduf.zst`` is read as ``dduf validate`` reads it
    (:func:`plain_archive`) and described under its own name."""
    from ..format.describe import describe

    hub = _hub_local(source, variant)
    if hub is not None:  # a Hub repo: its archive or its folder layout (only what a load needs is downloaded)
        info = describe(hub, variant)
        info["path"] = source
        return info
    remote = _remote_from_index(source, variant)
    if remote is not None:
        return remote
    with plain_archive(source, max_decompressed) as (plain, compressed):
        info = describe(plain, variant)
    if compressed is not None:
        info.update(path=source, compressed_size=compressed)
    return info


def _remote_from_index(source: str, variant: str | None) -> dict[str, Any] | None:
    """``describe`` of a remote archive opened from its tail when its index agrees with its central directory
    (one request: ``from_index`` is then True), else by the full open over the same source (as before, no
    ``from_index``); None for a
    source that is not a remote plain archive."""
    from ..storage.urls import is_url
    from ..storage.zst import is_zst

    if not is_url(source) or is_zst(source):
        return None
    from ..format.describe import describe_archive
    from ..remote.indexed import IndexedArchive, open_indexed

    with open_indexed(source) as archive:
        info = describe_archive(archive, variant)
        if isinstance(archive, IndexedArchive):  # said only then: a full open's description is as before
            info["from_index"] = True
    return info


def _hub_local(source: str, variant: str | None) -> str | None:
    """The local path ``dduf info org/name[@rev]`` describes (the repo's archive, or the snapshot of its folder
    layout holding what a load needs, as ``load_dduf`` picks them); None for anything else."""
    from ..packing.pack import hub_source

    if hub_source(source) is None:
        return None
    from ..loading.folder_source import hub_pipeline

    return str(hub_pipeline(source, variant=variant)[1])


def run(args: argparse.Namespace) -> int:
    from .info_single_file import is_checkpoint, run_single_file  # dduf info CKPT.safetensors

    if is_checkpoint(args.source):
        return run_single_file(args)
    if getattr(args, "base", None):
        from ..errors import DDUFUsageError

        raise DDUFUsageError("--base: only for a single-file .safetensors checkpoint (an archive or folder has its own)")
    info = describe_source(args.source, args.variant, args.max_decompressed)
    if args.json:
        print_json(info)
        return 0
    size = f", {human_bytes(info['size'])}" if "size" in info else ""
    if "compressed_size" in info:
        size += f"; {human_bytes(info['compressed_size'])} as .zst"
    echo(f"{info['path']}: {info.get('pipeline')} ({info['kind']}{size})")
    rows = [_row(name, c) for name, c in info["components"].items()]
    for line in table([HEADERS, *rows]):
        echo(f"  {line}")
    if info["null_components"]:
        echo(f"  null (not used): {', '.join(info['null_components'])}")
    for line in adapter_lines(info.get("adapters") or []):
        echo(f"  {line}")
    for s in info.get("skipped", []):
        echo(f"  would skip {s['path']}: {s['reason']}")
    if info.get("from_index"):
        echo(f"  {FROM_INDEX}")
    return 0


def _row(name: str, c: Mapping[str, Any]) -> tuple[str, ...]:
    if c["external"]:
        return (name, str(c["class"]), "-", "-", "-", f"referenced: {reference_text(name, c['external'])}")
    notes = []
    tag = quantization_tag(c)
    if tag:
        notes.append(tag)
    if c.get("storage_dtype"):
        notes.append(f"stored {c['storage_dtype']}, computes {c.get('compute_dtype') or '?'}")
    if len(c["dtypes"]) > 1:
        notes.append(", ".join(f"{k} {human_bytes(v)}" for k, v in c["dtypes"].items()))
    if not c.get("aligned", True):
        notes.append("not page-aligned (loads by copy)")
    if not c["dtypes"]:
        notes.append("no weights")
    if c.get("parts"):
        notes.append(f"list of {len(c['parts'])}: {', '.join(c['parts'])}")
    if c.get("part_of"):
        notes.append(f"part of {c['part_of']}")
    params = human_count(c["parameters"]) if c["parameters"] else "-"
    size = human_bytes(c["bytes"]) if c["bytes"] else "-"
    return (name, str(c["class"]), c["dtype"] or "-", params, size, "; ".join(notes))


def quantization_tag(c: Mapping[str, Any]) -> str | None:
    """``quantized: optimum-quanto (qint8)`` from the index record, or from a ``quanto_qmap.json`` file."""
    from ..format.quantization import QMAP_NAME

    record = c.get("quantization")
    if isinstance(record, Mapping):
        weights = record.get("weights")
        detail = f" ({', '.join(map(str, weights))})" if isinstance(weights, list) and weights else ""
        if isinstance(record.get("scheme"), str):  # torchao / bitsandbytes: "quantized: torchao int8_weight_only"
            detail = f" {record['scheme']}"[:80]
        return f"quantized: {record.get('method') or 'yes'}{detail}"
    if any(str(f).endswith("/" + QMAP_NAME) for f in c.get("files", {})):
        return "quantized: optimum-quanto"
    return None


def reference_text(name: str, ref: Mapping[str, Any]) -> str:
    """Where a referenced component comes from (:func:`dduf_plus.refs.resolve.describe_reference`), and what to
    do when the archive records no source."""
    from ..refs.spec import describe_reference

    text = describe_reference(name, ref)
    if text == "no source recorded":
        return f"{text}: pass it when loading (load_dduf(..., {name}=...) or --ref {name}=SPEC)"
    return text

