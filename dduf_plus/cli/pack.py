"""``dduf pack SRC -o OUT.dduf``"""

from __future__ import annotations

import argparse
import os

from ._common import (
    as_usage,
    check_archive_name,
    echo,
    human_bytes,
    input_folder,
    output_file,
    path_like_missing,
    plural,
    print_json,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pack", help="pack a diffusers pipeline folder into a .dduf archive")
    p.add_argument("source", help="diffusers pipeline folder (with model_index.json), a Hub repo org/name[@revision], "
                   "a .dduf archive (re-packed without unpacking: --base, --dtype, --quantize, --exclude, --ref), "
                   "or a single-file .safetensors checkpoint (SD 1.x/2.x, SDXL, SD3/3.5, ...; with --base)")
    p.add_argument("-o", "--output", required=True,
                   help="archive to write (atomically); DIR/ writes DIR/NAME.dduf; the folder must exist")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("--variant", help="pack this weight variant (e.g. fp16), like from_pretrained(variant=...)")
    p.add_argument("--exclude", action="append", default=[], metavar="COMPONENT",
                   help="store a reference instead of this component (repeatable)")
    p.add_argument("--ref", action="append", metavar="[NAME=]SPEC",
                   help="where excluded components come from: Hub repo id[@revision], folder, .dduf, "
                        "or a hosted archive (https://host/base.dduf, hf://org/repo/base.dduf)")
    p.add_argument("--base", metavar="BASE", help="reference every component identical to BASE's")
    p.add_argument("--dtype", action="append", metavar="[NAME=]DTYPE",
                   help="convert floating weights while packing (e.g. bfloat16, unet=float8_e4m3fn)")
    p.add_argument("--quantize", action="append", metavar="NAME=SCHEME",
                   help="quantize a component while packing, as diffusers would save it (repeatable): bnb-nf4, "
                        "bnb-fp4, bnb-int8, torchao-int8, sdnq-int8, sdnq-uint4, sdnq-float8_e4m3fn, quanto-int8, "
                        "quanto-float8")
    p.add_argument("--lora", action="append", default=[], metavar="[NAME=]FILE[@WEIGHT]",
                   help="with a LoRA SOURCE (itself [NAME=]FILE[@WEIGHT] too): one more adapter for the same --base "
                        "(docs/lora.md)")
    p.add_argument("--token", help="Hugging Face token for a SOURCE repo and --ref/--base on the Hub")
    p.add_argument("--no-fsync", dest="fsync", action="store_false",
                   help="skip flushing to disk before the atomic rename (faster; like cp, not power-cut safe)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar, skipped files, references report or summary (warnings still printed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Every argument is checked before any work (and before torch is imported for --dtype).
    from ..dtype_names import DEFAULT_KEY, parse_dtype_args
    from ..refs.resolve import parse_ref_args

    refs = as_usage(lambda: parse_ref_args(args.ref))
    dtypes = as_usage(lambda: parse_dtype_args(args.dtype or []))
    quantize = as_usage(lambda: _parse_quantize(args.quantize))
    from ..packing.archive_source import check_not_same, is_archive_source
    from ..packing.pack import hub_source
    from .info_single_file import is_checkpoint

    if _is_lora_source(args.source) or args.lora:
        return _run_lora(args)
    checkpoint = is_checkpoint(args.source)  # a single-file .safetensors checkpoint: packed against --base
    archive = not checkpoint and is_archive_source(args.source)  # a .dduf: re-packed from its entries
    if checkpoint:
        _check_single_file_args(args)
    elif args.source.endswith(".zst") and os.path.isfile(args.source):
        from ..errors import DDUFUsageError

        raise DDUFUsageError(f"{args.source}: a compressed archive; run dduf decompress first, then pack the .dduf")
    elif not archive and hub_source(args.source) is None:  # a local folder; else a Hub repo id[@revision]
        _check_lora_weight(args.source)
        input_folder(args.source)
    for spec in refs.values():
        path_like_missing(spec, "--ref")
    if args.base:
        path_like_missing(args.base, "--base")
    name = _default_name(args.source, checkpoint=checkpoint, archive=archive)
    if archive:
        check_not_same(args.source, _output_path(args.output, name))  # before -f could even be considered
    output = output_file(args.output, args.force, name)
    check_archive_name(output)
    dtype = dtypes.pop(DEFAULT_KEY, None)
    dtype_arg = ({**({DEFAULT_KEY: dtype} if dtype else {}), **dtypes} if dtypes else dtype)

    from ..packing import pack

    result, partial = pack(args.source, output, variant=args.variant, exclude=args.exclude, refs=refs,
                           base=args.base, dtype=dtype_arg, token=args.token, quiet=args.quiet,
                           fsync=args.fsync, quantize=quantize or None)
    if args.json:
        print_json({
            "path": str(result.path), "bytes": result.bytes_written, "entries": result.entries,
            "seconds": round(result.seconds, 3),
            "skipped": [{"path": s.path, "reason": s.reason} for s in result.skipped],
            "references": getattr(partial, "references", None) or {},
            "bytes_saved": getattr(partial, "bytes_saved", 0),
        })
        return 0
    if not args.quiet:
        for s in result.skipped:
            echo(f"skipped {s.path}: {s.reason}")
        # (the reference report was logged by pack itself, once, on stderr: not printed here a second time)
        echo(f"wrote {result.path}: {plural(result.entries, 'entry', 'entries')}, {human_bytes(result.bytes_written)} "
             f"in {result.seconds:.2f} s")
    return 0


def _default_name(source: str, *, checkpoint: bool, archive: bool) -> str:
    """OUT's name when ``-o`` is a folder: the archive's own, the checkpoint's stem, or the folder's / repo's."""
    from ..packing.pack import hub_source

    if archive:
        return os.path.basename(source)
    if checkpoint:
        return os.path.basename(source).removesuffix(".safetensors") + ".dduf"
    hub = hub_source(source)
    return (hub[0].rsplit("/", 1)[-1] if hub else os.path.basename(os.path.abspath(source))) + ".dduf"


def _is_lora_source(source: str) -> bool:
    """SOURCE is a LoRA file (``[NAME=]FILE[@WEIGHT]``): its header holds LoRA pairs only (header read only)."""
    from ..packing.lora import is_lora_file

    return is_lora_file(source)


def _run_lora(args: argparse.Namespace) -> int:
    """``dduf pack LORA.safetensors --base BASE [--lora ...]``: an adapter archive referencing BASE."""
    from functools import partial as partial_call

    from ..errors import DDUFUsageError
    from ..packing.lora import pack_lora, parse_lora_arg

    if not _is_lora_source(args.source):
        raise DDUFUsageError(f"--lora: SOURCE {args.source} is not a LoRA file; adapters are packed as "
                             "`dduf pack LORA.safetensors [--lora MORE] --base BASE`")
    used = [o for o, v in (("--variant", args.variant), ("--exclude", args.exclude), ("--ref", args.ref),
                           ("--dtype", args.dtype), ("--quantize", args.quantize)) if v]
    if used or not args.base:
        raise DDUFUsageError(f"{args.source} is a LoRA: give --base BASE (the pipeline it was trained on)"
                             + (f"; {', '.join(used)} do not apply to adapters" if used else ""))
    items = [as_usage(partial_call(parse_lora_arg, v)) for v in [args.source, *args.lora]]
    path_like_missing(args.base, "--base")
    output = output_file(args.output, args.force, f"{items[0].name}.dduf")
    check_archive_name(output)
    result, partial = pack_lora(items, output, base=args.base, token=args.token, quiet=args.quiet, fsync=args.fsync)
    if args.json:
        print_json({"path": str(result.path), "bytes": result.bytes_written, "entries": result.entries,
                    "seconds": round(result.seconds, 3), "adapters": [i.name for i in items],
                    "references": partial.references or {}, "bytes_saved": partial.bytes_saved})
        return 0
    if not args.quiet:  # the report itself is logged by pack_lora (stderr, once)
        echo(f"wrote {result.path}: {plural(result.entries, 'entry', 'entries')}, {human_bytes(result.bytes_written)} "
             f"in {result.seconds:.2f} s")
    return 0

def _check_lora_weight(source: str) -> None:
    """``NAME=FILE@WEIGHT`` whose FILE exists but whose WEIGHT is no number (``@abc``, ``@0,8``): said as such,
    instead of "SRC ... does not exist" (the whole text, taken for a folder, is not one)."""
    from ..errors import DDUFUsageError

    file, at, weight = source.rpartition("@")
    file = file.split("=", 1)[1] if "=" in file.split("/", 1)[0] else file
    if at and file.endswith(".safetensors") and os.path.isfile(file):
        raise DDUFUsageError(f"{source}: weight {weight!r} is not a number ([NAME=]FILE[@WEIGHT], e.g. "
                             f"{file}@0.8)")


def _output_path(output: str, name: str) -> str:
    """Where ``-o`` writes (``DIR/``: DIR/NAME), without the checks of ``output_file``."""
    return os.path.join(output, name) if output.endswith(("/", os.sep)) else output


def _parse_quantize(values: list[str] | None) -> dict[str, str]:
    """``--quantize`` checked before any work (scheme names: torch-free)."""
    if not values:
        return {}
    from ..packing.quantize import parse_quantize

    return parse_quantize(values)


def _check_single_file_args(args: argparse.Namespace) -> None:
    """A single-file checkpoint needs --base and takes none of the folder-only options."""
    from ..errors import DDUFUsageError

    if not args.base:
        raise DDUFUsageError(f"{args.source} is a single-file checkpoint: give --base BASE (a diffusers pipeline "
                             "folder or Hub repo of the same family) for its configs, tokenizers and scheduler")
    used = [o for o, v in (("--variant", args.variant), ("--exclude", args.exclude), ("--ref", args.ref),
                           ("--dtype", args.dtype), ("--quantize", args.quantize)) if v]
    if used:
        raise DDUFUsageError(f"{', '.join(used)}: not supported with a single-file checkpoint (only --base)")
