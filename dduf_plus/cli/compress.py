"""``dduf compress X.dduf -o X.dduf.zst``: zstd for transport (the archive itself stays STORED)."""

from __future__ import annotations

import argparse
import os

from ._common import int_arg, size_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compress", help="zstd-compress an archive for transport",
        description="Compress an archive into independent zstd frames with content checksums and a seek "
                    "table (any `zstd -d` decodes it; `dduf decompress` decodes frames in parallel).")
    p.add_argument("archive", help="the .dduf archive to compress")
    p.add_argument("-o", "--output", help="where to write (default: ARCHIVE.zst); written atomically")
    p.add_argument("--level", type=level_arg, default=3,
                   help="zstd level: 1 (fast) to 19 (small), 20-22 smaller still (more memory), -1 to -131072 "
                        "faster still, 0 zstd's default; default 3")
    p.add_argument("--threads", type=threads_arg, default=-1,
                   help=f"compression threads, 1 to {MAX_THREADS} (default, or 0 as zstd -T0: one per CPU)")
    p.add_argument("--long", action="store_true", help="long-distance matching, 128 MiB window")
    p.add_argument("--frame-size", type=size_arg, default="256M", metavar="SIZE",
                   help="input bytes per independent frame (default 256M)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=run)


# zstd's own bounds (ZSTD_minCLevel() is -(1 << 17), ZSTD_maxCLevel() 22), as storage.zst checks them
MIN_LEVEL, MAX_LEVEL = -(1 << 17), 22


# checked before any work, both ends said (storage.zst's "max 22" read as if -200000 were too large)
level_arg = int_arg(MIN_LEVEL, MAX_LEVEL, out_of_range="{value} is out of range: {low} (fastest) to {high} (smallest), "
                                                       "0 for zstd's default")
MAX_THREADS = 256  # zstd's own cap on workers (ZSTDMT_NBWORKERS_MAX) is about this on 64-bit systems
# -7 and 100000 were taken silently
threads_arg = int_arg(-1, MAX_THREADS, out_of_range="{value} is out of range: 1 to {high}, or 0 / -1 for one per CPU")


def run(args: argparse.Namespace) -> int:
    from ..storage.zst import compress
    from ._common import echo, human_bytes, human_rate, input_file, output_file, plural

    input_file(args.archive)
    name = os.path.basename(args.archive) + ".zst"
    output = output_file(args.output if args.output else args.archive + ".zst", args.force, name)
    result = compress(args.archive, output, level=args.level, threads=args.threads, frame_size=args.frame_size,
                      long=args.long, quiet=args.quiet)
    if not args.quiet:
        ratio = result.input_bytes / result.output_bytes if result.output_bytes else 0.0
        echo(f"wrote {result.path}: {human_bytes(result.output_bytes)} from {human_bytes(result.input_bytes)} "
             f"(ratio {ratio:.3f}, {plural(result.frames, 'frame')})"
             f" in {result.seconds:.2f} s, {human_rate(result.input_bytes, result.seconds)}")
    return 0
