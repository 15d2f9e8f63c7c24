"""``dduf refs ARCHIVE [--json] [--verify]``: an archive's external references and where each resolves here."""

from __future__ import annotations

import argparse

from ._common import (
    as_usage,
    budget_arg,
    echo,
    human_bytes,
    path_like_missing,
    plain_archive,
    plural,
    print_json,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("refs", help="list an archive's external references and where each resolves")
    p.add_argument("archive", help="a .dduf archive (or a local .dduf.zst)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verify", action="store_true",
                   help="hash files not yet verified on this machine (default: sizes and remembered hashes only)")
    p.add_argument("--ref", action="append", metavar="[NAME=]SPEC",
                   help="check this source instead of the recorded one (as load_dduf(refs=...))")
    p.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache to search first")
    p.add_argument("--model-dir", action="append", metavar="FOLDER",
                   help="an app's model folder to find referenced components in by their tensors (repeatable; "
                        "also DDUF_PLUS_MODEL_DIRS)")
    p.add_argument("--max-decompressed", type=budget_arg, default=None, metavar="SIZE",
                   help="how far a .dduf.zst may expand (as dduf validate --max-decompressed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every reference resolves here (or can be downloaded), 1 otherwise."""
    from ..format.archive import DDUFArchive
    from ..packing.model_dir_layouts import install
    from ..refs.resolve import check_ref_names, check_references, parse_ref_args

    install()  # --model-dir: original layouts and full checkpoints' parts are read too

    refs = as_usage(lambda: parse_ref_args(args.ref))
    for spec in refs.values():
        path_like_missing(spec, "--ref")
    with plain_archive(args.archive, args.max_decompressed) as (plain, _), DDUFArchive(plain) as archive:
        references = archive.references
        check_ref_names(refs, archive.components, references, what="--ref", where=str(args.archive))
    rows = check_references(references, refs=refs, cache_dir=args.cache_dir, verify=args.verify,
                            model_dirs=args.model_dir)
    bad = [r for r in rows if r["status"] in ("unresolved", "differs")]
    if args.json:
        print_json({"archive": str(args.archive), "references": rows})
        return 1 if bad else 0
    if not rows:
        echo(f"{args.archive}: no references (self-contained)")
        return 0
    echo(f"{args.archive}: {plural(len(rows), 'reference')}")
    for r in rows:
        echo(f"  {r['component']:<16} {r['source']}  ({plural(r['files'], 'file')}, {human_bytes(r['bytes'])})")
        if r["status"] == "ok":
            state = "verified" if r["verified"] else "sizes match, not hashed yet (--verify)"
            member = f" component {r['member']}" if r.get("member") and r["member"] != r["component"] else ""
            where = r["found"] if r["how"] == "model folder" else r["resolves_to"]
            echo(f"      -> {r['how']}: {where}{member}  [{state}]")
        elif r["status"] == "download":
            echo("      -> not on this machine: only its entries will be fetched from the hosted archive when loaded"
                 if r.get("source_kind") == "url" else "      -> not on this machine: will be downloaded from the Hub when loaded")
        else:
            _print_unresolved(r)
    return 1 if bad else 0


def _print_unresolved(r: dict) -> None:
    """Why a reference does not resolve, and what to do. The reason's first line repeats the component and
    its source (already on the row) when it lists the sources tried below it; a one-line reason (no source
    recorded) is the whole story and is printed."""
    lines = [line.strip() for line in (r["reason"] or "").splitlines() if line.strip()]
    if r["status"] == "differs":
        echo("      -> DIFFERS: a copy is here but its content is not the referenced one:")
    else:
        echo("      -> UNRESOLVED" + (":" if lines else ""))
    for line in lines[1:] if len(lines) > 1 else lines:
        echo(f"         {line}")
