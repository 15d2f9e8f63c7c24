"""``dduf unpack ARCHIVE -o DIR``: recreate a diffusers folder."""

from __future__ import annotations

import argparse

from ._common import echo, output_folder, plural


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "unpack", help="unpack an archive into a diffusers folder",
        description="Recreate the diffusers pipeline folder an archive was packed from (structurally validated "
                    "first; entry names are confined to the folder). A partial archive's referenced components "
                    "are not fetched: `dduf complete` first. A .dduf.zst: `dduf decompress` first.")
    p.add_argument("archive", help="the .dduf archive to unpack")
    p.add_argument("-o", "--output", required=True, help="target folder (created; may exist)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite files that already exist in it")
    p.add_argument("--keep-index", action="store_true", help="also write dduf_plus.index.json")
    p.add_argument("--no-check", action="store_true", help="skip structural validation (paths are still confined)")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..format.unpack import unpack

    output = output_folder(args.output)
    written = unpack(args.archive, output, force=args.force, keep_index=args.keep_index,
                     check=not args.no_check)
    if not args.quiet:
        echo(f"unpacked {plural(len(written), 'file')} into {args.output}")
    return 0
