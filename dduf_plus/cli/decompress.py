"""``dduf decompress X.dduf.zst -o X.dduf``"""

from __future__ import annotations

import argparse
import os

from ..errors import DDUFUsageError
from ._common import budget_arg
from .compress import MAX_THREADS, threads_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "decompress", help="decompress a .dduf.zst archive",
        description="Decompress a zstd stream (frames in parallel when it has a seek table), verifying every "
                    "frame's checksum and size, within a size/ratio budget and the free disk space; the "
                    "output appears only when complete.")
    p.add_argument("archive", help="the .dduf.zst to decompress")
    p.add_argument("-o", "--output", help="where to write (default: ARCHIVE without .zst); written atomically")
    p.add_argument("--threads", type=threads_arg, default=-1,
                   help=f"decompression threads, 1 to {MAX_THREADS} (default, or 0: one per CPU)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--max-decompressed", type=budget_arg, default=None, metavar="SIZE",
                   help="how far the stream may expand: SIZE (64G), RATIOx (32x), both (64G,32x) or 'unlimited' "
                        "(default: $DDUF_PLUS_MAX_DECOMPRESSED, else 256G and 16x above 256M)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..storage.zst import decompress
    from ._common import echo, human_bytes, human_rate, input_file, output_file, plural

    input_file(args.archive)
    name = os.path.basename(args.archive).removesuffix(".zst")
    if args.output:
        output = output_file(args.output, args.force, name if args.archive.endswith(".zst") else None)
    elif args.archive.endswith(".zst"):
        output = output_file(args.archive[: -len(".zst")], args.force)
    else:
        raise DDUFUsageError(f"{args.archive} does not end in .zst: say where to write with -o")
    result = decompress(args.archive, output, threads=args.threads, quiet=args.quiet,
                        max_decompressed=args.max_decompressed)
    if not args.quiet:
        echo(f"wrote {result.path}: {human_bytes(result.output_bytes)} ({plural(result.frames, 'frame')}) "
             f"in {result.seconds:.2f} s, {human_rate(result.output_bytes, result.seconds)}")
    return 0
