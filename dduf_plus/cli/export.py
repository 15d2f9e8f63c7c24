"""``dduf export ARCHIVE -o OUT.safetensors``: the archive's pipeline (or one component) as the single file apps
load, in its family's original layout (:mod:`dduf_plus.packing.export`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ._common import as_usage, echo, human_bytes, output_file, path_like_missing

if TYPE_CHECKING:
    from ..format.archive import DDUFArchive


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write an archive as the single .safetensors file apps load")
    p.add_argument("archive", help="a .dduf archive (a partial one is exported complete: references resolved)")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write (atomically)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("--component", metavar="NAME",
                   help="export only this model, in the layout an app's folder for it expects (vae: models/vae; "
                        "text_encoder*: models/text_encoders; unet / transformer: models/diffusion_models)")
    p.add_argument("--adapter", metavar="NAME",
                   help="export this LoRA adapter of the archive in kohya / A1111 layout (models/loras); the only "
                        "adapter of a LoRA archive is exported when --adapter is not given")
    p.add_argument("--dtype", help="cast floating tensors (fp16, bf16, fp32, fp8; default: as stored)")
    p.add_argument("--title", help="modelspec.title written in the file (default: the archive's name)")
    p.add_argument("--ref", action="append", metavar="[NAME=]SPEC",
                   help="take a referenced component from this source (Hub repo id[@revision], folder or .dduf)")
    p.add_argument("--model-dir", action="append", metavar="FOLDER",
                   help="an app's model folder to find referenced components in by their tensors (repeatable; "
                        "also DDUF_PLUS_MODEL_DIRS)")
    p.add_argument("--local-files-only", action="store_true", help="never download a referenced component")
    p.add_argument("--token", help="Hugging Face token for downloads")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..packing.export import export_single_file
    from ..refs.resolve import parse_ref_args

    refs = as_usage(lambda: parse_ref_args(args.ref))
    for spec in refs.values():
        path_like_missing(spec, "--ref")
    output = output_file(args.output, args.force, "export.safetensors")
    if args.adapter or _adapters_only(args.archive):
        return _run_adapter(args, output)
    result = export_single_file(args.archive, output, component=args.component, dtype=args.dtype, title=args.title,
                                refs=refs or None, token=args.token, local_files_only=args.local_files_only,
                                model_dirs=args.model_dir)
    if not args.quiet:
        for name, where in result.components.items():
            echo(f"{name}: {where}")
        echo(f"wrote {result.path}: {result.architecture} ({result.model_type}), {result.tensors} tensors, "
             f"{human_bytes(result.bytes)} in {result.seconds:.2f} s")
    return 0


def _adapters_only(path: str) -> bool:
    """A LoRA archive: adapters stored, every component referenced (its export is the adapter)."""
    from ..errors import DDUFError
    from ..format.archive import DDUFArchive
    from ..format.lora import LORA_CONFIG

    try:
        with DDUFArchive(path) as archive:
            stored = {name.split("/", 1)[0] for name in archive.entries if "/" in name}
            return LORA_CONFIG in archive.entries and stored == {LORA_CONFIG.split("/", 1)[0]}
    except DDUFError:  # not readable as an archive here: export_single_file says why
        return False


def _run_adapter(args: argparse.Namespace, output: object) -> int:
    """``dduf export L.dduf [--adapter NAME] -o OUT.safetensors``: the adapter as a kohya file (docs/lora.md)."""
    from ..errors import DDUFUsageError
    from ..format.archive import DDUFArchive
    from ..format.lora_export import export_adapter

    used = [o for o, v in (("--component", args.component), ("--dtype", args.dtype), ("--title", args.title),
                           ("--ref", args.ref), ("--model-dir", args.model_dir)) if v]
    if used:
        raise DDUFUsageError(f"{', '.join(used)}: not for an adapter (it is written as stored, in kohya names)")
    with DDUFArchive(args.archive) as archive:
        _check_adapter_name(archive, args.adapter)
        path = export_adapter(archive, args.adapter, output)  # type: ignore[arg-type]
    if not args.quiet:
        echo(f"wrote {path}: adapter {args.adapter or '(the only one)'} in kohya layout, "
             f"{human_bytes(path.stat().st_size)}")
    return 0


def _check_adapter_name(archive: DDUFArchive, name: str | None) -> None:
    """``--adapter`` is a name the user gives, checked like a component's (docs/cli.md): a typo is a usage error
    (exit 2, as ``--exclude vea``) naming the closest adapter. No ``--adapter`` for an archive of several stays
    export_adapter's refusal (exit 1, tests/test_lora.py)."""
    from ..assignments import closest
    from ..errors import DDUFUsageError
    from ..format.lora import LORA_CONFIG, config_findings

    entries = archive.entries
    if LORA_CONFIG not in entries:
        return  # no adapters at all: export_adapter says so
    adapters, problems = config_findings(archive.read_json(LORA_CONFIG), entries)
    names = [a.name for a in adapters]
    if name is None or problems or name in names:
        return  # a broken config is export_adapter's to report (A001)
    guess = closest(name, names)
    raise DDUFUsageError(f"--adapter {name}: not an adapter of {archive.path}"
                         + (f" (did you mean {guess}?)" if guess else "") + f"; its adapters: {', '.join(names)}")
