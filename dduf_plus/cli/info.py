"""``dduf info ARCHIVE|FOLDER [--json]``"""

from __future__ import annotations

import argparse

from ._common import echo, human_bytes, human_count, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="show components, dtypes, sizes and references of an archive or folder")
    p.add_argument("source", help="a .dduf archive or a diffusers pipeline folder")
    p.add_argument("--variant", help="describe this weight variant (e.g. fp16)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..format.describe import describe

    info = describe(args.source, args.variant)
    if args.json:
        print_json(info)
        return 0
    echo(f"{info['path']}: {info.get('pipeline')} ({info['kind']}"
         + (f", {human_bytes(info['size'])}" if "size" in info else "") + ")")
    for name, c in info["components"].items():
        if c["external"]:
            ref = c["external"]
            where = ref.get("pretrained_model_name_or_path") or "(must be passed as an argument)"
            sub = f"/{ref['subfolder']}" if ref.get("subfolder") else ""
            echo(f"  {name:<20} {c['class']!s:<32} external: {where}{sub}")
            continue
        dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in c["dtypes"].items()) or "no weights"
        params = f"{human_count(c['parameters'])} params" if c["parameters"] else ""
        aligned = "" if c.get("aligned", True) else "  [not page-aligned]"
        extra = f"  [stored {c['storage_dtype']}, computes {c.get('compute_dtype')}]" if c.get("storage_dtype") else ""
        echo(f"  {name:<20} {c['class']!s:<32} {c['dtype'] or '-':<10} {params:<14} {dtypes}{aligned}{extra}")
    if info["null_components"]:
        echo(f"  null: {', '.join(info['null_components'])}")
    for s in info.get("skipped", []):
        echo(f"  would skip {s['path']}: {s['reason']}")
    return 0
