"""``dduf info CKPT.safetensors``: what a single-file checkpoint holds (detected architecture, components,
dtypes, parameters, bytes), read from its header only. Called by ``dduf info`` (cli/info.py)."""

from __future__ import annotations

import argparse
import os

from ._common import echo, human_bytes, human_count, print_json, table

HEADERS = ("COMPONENT", "KEY PREFIX", "DTYPE", "PARAMS", "SIZE", "NOTES")


def is_checkpoint(source: str) -> bool:
    """A local ``.safetensors`` file: described as a single-file checkpoint, not opened as an archive."""
    return source.endswith(".safetensors") and os.path.isfile(source)


def run_single_file(args: argparse.Namespace) -> int:
    from ..packing.lora import is_lora_file
    from ..packing.single_file import describe_checkpoint

    if is_lora_file(args.source):
        return _run_lora_file(args)

    info = describe_checkpoint(args.source)
    if getattr(args, "base", None):
        from ..packing.single_file import plan_single_file

        info["pack_plan"] = plan_single_file(args.source, args.base)
    if args.json:
        print_json(info)
        return 0
    arch = f"{info['family']} ({info['architecture']})" if info.get("family") else info.get("architecture")
    echo(f"{info['path']}: single-file checkpoint, {arch or 'unknown architecture'} "
         f"({info['tensors']} tensors, {human_bytes(info['size'])})")
    if info.get("problem"):
        echo(f"  {info['problem']}")
    rows = []
    for name, c in info["components"].items():
        notes = ", ".join(f"{k} {human_bytes(v)}" for k, v in c["dtypes"].items()) if len(c["dtypes"]) > 1 else ""
        rows.append((name, c["prefix"], c["dtype"], human_count(c["parameters"]), human_bytes(c["bytes"]), notes))
    if rows:
        for line in table([HEADERS, *rows]):
            echo(f"  {line}")
    if info.get("absent"):
        echo(f"  not in the file: {', '.join(info['absent'])} (a pack against --base references BASE's)")
    if info.get("other_tensors"):
        echo(f"  {info['other_tensors']} tensors belong to no component (ignored by a pack)")
    if "pack_plan" in info:
        _echo_plan(info["pack_plan"])
    elif info.get("pipeline") and not info.get("problem"):
        echo(f"  pack it: dduf pack {args.source} --base BASE -o OUT.dduf  (BASE: a {info['pipeline']} folder, Hub repo or .dduf, local or URL)")
    return 0


def _run_lora_file(args: argparse.Namespace) -> int:
    """``dduf info LORA.safetensors [--base BASE]``: the adapter's layout, targets, ranks and trainer metadata,
    from its header; with --base, checked against BASE as ``dduf pack`` checks it (A002-A007)."""
    from pathlib import Path

    from ..format.lora import METADATA_SHOWN, trigger_words
    from ..packing.lora import describe_lora_file
    from ._common import adapter_lines

    adapter = describe_lora_file(Path(args.source), getattr(args, "base", None))
    if args.json:
        print_json(adapter)
        return 0
    echo(f"{args.source}: LoRA adapter ({adapter['tensors']} tensors, {human_bytes(adapter['bytes'])})")
    for line in adapter_lines([adapter]):
        echo(f"  {line}")
    meta = {k: v for k, v in adapter["metadata"].items() if k in METADATA_SHOWN}
    if not meta and not trigger_words(meta):
        echo("  no trainer metadata (ModelSpec / kohya) in its header")
    if adapter.get("base"):
        echo(f"  fits --base {adapter['base']}: pack it with dduf pack {args.source} --base {adapter['base']}")
    return 0


def _echo_plan(plan: dict) -> None:
    """What a pack against --base would store and reference."""
    stored = ", ".join(f"{n} ({human_bytes(b)})" for n, b in sorted(plan["stored"].items())) or "nothing"
    refs = ", ".join(n + (f" ({v} variant)" if v else "") for n, v in plan["referenced"].items()) or "nothing"
    echo(f"  dduf pack --base {plan['base']} would store: {stored}")
    echo(f"  and reference BASE's: {refs}")
    for line in plan["report"][1:]:
        echo(f"    {line}")
