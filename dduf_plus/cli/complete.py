"""``dduf complete PARTIAL -o FULL``: pull referenced components into a self-contained archive."""

from __future__ import annotations

import argparse
import os

from ._common import as_usage, check_archive_name, echo, human_bytes, output_file, path_like_missing, plural


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("complete", help="pull referenced components into a self-contained archive")
    p.add_argument("partial", help="a partial .dduf archive (with references)")
    p.add_argument("-o", "--output", required=True, help="self-contained archive to write (atomically)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("--ref", action="append", metavar="[NAME=]SPEC",
                   help="take a referenced component from this source (Hub repo id[@revision], folder or .dduf)")
    p.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache to search first (and download into)")
    p.add_argument("--model-dir", action="append", metavar="FOLDER",
                   help="an app's model folder to find referenced components in by their tensors (repeatable; "
                        "also DDUF_PLUS_MODEL_DIRS)")
    p.add_argument("--local-files-only", action="store_true", help="never download")
    p.add_argument("--token", help="Hugging Face token for downloads")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..packing.complete import complete_archive
    from ..refs.resolve import parse_ref_args

    refs = as_usage(lambda: parse_ref_args(args.ref))
    for spec in refs.values():
        path_like_missing(spec, "--ref")
    output = output_file(args.output, args.force, os.path.basename(args.partial))
    check_archive_name(output)
    result = complete_archive(args.partial, output, refs=refs, local_files_only=args.local_files_only,
                              token=args.token, cache_dir=args.cache_dir, quiet=args.quiet,
                              model_dirs=args.model_dir)
    if not args.quiet:
        echo(f"wrote {result.path}: {plural(result.entries, 'entry', 'entries')}, {human_bytes(result.bytes_written)} "
             f"in {result.seconds:.2f} s")
    return 0
