"""Requests and seconds to *open* a remote archive (issue 22, "one round trip to open"; target: 1 request).

    python bench/bench_remote_open.py [--latency 0.020] [--runs 3] [--no-large]

Each archive is served from 127.0.0.1 by tests/servers.FileServer in this process, with ``latency`` slept before
every answer (an injected round trip). Archives: tiny-dit packed by dduf_plus (456 KiB, indexed); tiny-sd with
1 MiB of extra weights per file (5.45 MB), indexed and without an index (huggingface_hub's exporter); the
SD-1.5-shaped pipeline (bench/_common's folder, packed here as dduf_plus packs now: 2.1 GB) and the SDXL-shaped
archive (6.9 GB) as bench/_common built it, when they are already there (``--no-large`` skips them). Entry points:

- ``dduf validate URL`` (validate(URL): every record, header and small entry is read and checked);
- ``DDUFArchive(URL)`` (the full open: parses every record and safetensors header);
- ``dduf info URL`` (cli.info.describe_source), ``inspect_dtypes(URL)`` and a hosted reference
  (refs.hosted.hosted_member_records: one component's records): opened from the tail when the index agrees
  with the central directory (remote/indexed.py), else the full open;
- ``load_dduf(URL)``'s open: the range reader and the tail (remote/tail.read_tail), everything before the first
  entry-data request of the fetch (local and safetensors headers are then checked as the data lands).

Four ways, each a real configuration of the client: ``per read`` (a 1-byte size probe, then one request per
read: before the merged reads), ``probe`` (the size probe, then the tail and the planned header reads merged:
0.5.0), ``suffix`` (the opening request is a suffix range that gives the size and the tail at once; every open
a full open) and ``index`` (now: the suffix range, and info, inspect_dtypes and hosted references answered
from the index; validate, DDUFArchive and the load's open are as ``suffix``). Medians of ``--runs``; requests
are the same every run. Writes bench/results/remote_open.json."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, ROOT, WORK, median, write_result  # noqa: E402

OUT = RESULTS / "remote_open.json"
WAYS = ("per read", "probe", "suffix", "index")
FROM_INDEX = ("dduf info URL", "inspect_dtypes(URL)", "hosted reference (component records)")


def _padded_archives() -> dict[str, Path]:
    """tiny-sd with a 1 MiB random tensor added to each weights file (5.45 MB: read by ranges, not whole),
    packed by dduf_plus (indexed) and by huggingface_hub (no index)."""
    import numpy as np
    from huggingface_hub import export_folder_as_dduf
    from safetensors.numpy import load_file, save_file

    from dduf_plus.format.pack import pack_folder

    root = WORK / "open-requests"
    out = {"tiny-sd padded, indexed": root / "tiny-sd-padded.dduf", "tiny-sd padded, no index": root / "plain.dduf"}
    if all(p.exists() for p in out.values()) and _copies_model_index(out["tiny-sd padded, indexed"]):
        return out
    folder = root / "src"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(ROOT / "fixtures" / "pipelines" / "tiny-sd", folder)
    for path in sorted(folder.rglob("*.safetensors")):
        tensors = load_file(path)
        tensors["zz_padding.weight"] = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
        save_file(tensors, path)
    pack_folder(folder, out["tiny-sd padded, indexed"], quiet=True)
    export_folder_as_dduf(str(out["tiny-sd padded, no index"]), folder_path=str(folder))
    return out


def _copies_model_index(path: Path) -> bool:
    """Whether the archive's index holds model_index.json's text (packed since the index carries it)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        return "dduf_plus.index.json" in names and b'"model_index_json"' in z.read("dduf_plus.index.json")


def _archives(large: bool) -> dict[str, Path]:
    from dduf_plus.format.pack import pack_folder

    tiny = WORK / "open-requests" / "tiny-dit.dduf"
    if not tiny.exists() or not _copies_model_index(tiny):
        tiny.parent.mkdir(parents=True, exist_ok=True)
        pack_folder(ROOT / "fixtures" / "pipelines" / "tiny-dit", tiny, quiet=True)
    out = {"tiny-dit, indexed": tiny, **_padded_archives()}
    if large and (WORK / "sd15" / "model_index.json").exists():  # bench/_common's folder, packed as now (~2 GB)
        again = WORK / "open-requests" / "sd15.dduf"
        if not again.exists() or not _copies_model_index(again):
            pack_folder(WORK / "sd15", again, quiet=True, fsync=False)
        out["SD-1.5-shaped, indexed"] = again
    if large and (WORK / "sdxl.dduf").exists():  # built by bench/_common (minutes): used as it is (6.9 GB)
        label = "SDXL-shaped, indexed" + ("" if _copies_model_index(WORK / "sdxl.dduf") else " (packed before "
                                          "the index held model_index.json)")
        out[label] = WORK / "sdxl.dduf"
    return out


@contextlib.contextmanager
def _way(way: str) -> Iterator[None]:
    """The client configured as ``way``: the opening request (suffix range or 1-byte probe), for ``per read``
    no planned reads (validate and DDUFArchive read a URL through the source itself), and unless ``index``,
    no open from the index (remote/indexed.open_indexed takes the full open over its source)."""
    from dduf_plus.format import archive, validate
    from dduf_plus.remote import indexed
    from dduf_plus.storage import http_range

    saved = (http_range.SUFFIX_BYTES, archive.PrefetchSource, validate.PrefetchSource, indexed.PrefetchSource,
             indexed._from_tail)
    if way not in ("suffix", "index"):
        http_range.SUFFIX_BYTES = 0  # HTTPSource opens with bytes=0-0
    if way == "per read":
        archive.PrefetchSource = validate.PrefetchSource = indexed.PrefetchSource = lambda source: source  # type: ignore[assignment,misc]
    if way != "index":
        indexed._from_tail = lambda source: None  # type: ignore[assignment]
    try:
        yield
    finally:
        (http_range.SUFFIX_BYTES, archive.PrefetchSource, validate.PrefetchSource, indexed.PrefetchSource,
         indexed._from_tail) = saved


def _entry_points(url: str) -> dict[str, Callable[[], object]]:
    from dduf_plus.cli.info import describe_source
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.format.validate import validate
    from dduf_plus.inspection import inspect_dtypes
    from dduf_plus.refs.hosted import hosted_member_records
    from dduf_plus.remote.readers import RemoteOptions, open_reader
    from dduf_plus.remote.tail import read_tail

    def load_open() -> None:  # what open_remote does before the fetch's workers ask for entry data
        reader = open_reader(url, RemoteOptions())
        try:
            read_tail(reader)
        finally:
            reader.close()

    return {"dduf validate URL": lambda: validate(url),
            "DDUFArchive(URL) (full open)": lambda: DDUFArchive(url).close(),
            "dduf info URL": lambda: describe_source(url, None),
            "inspect_dtypes(URL)": lambda: inspect_dtypes(url),
            "hosted reference (component records)": lambda: hosted_member_records(url, "vae"),
            "load_dduf(URL): open (reader + tail)": load_open}


def measure(archives: dict[str, Path], latency: float, runs: int) -> dict[str, dict]:
    """{archive: {"bytes", "rows": {entry point: {way: {"requests", "seconds", "runs_s"}}}}}."""
    from servers import FileServer

    out: dict[str, dict] = {}
    for label, path in archives.items():
        rows: dict[str, dict[str, dict]] = {}
        with FileServer(path.parent, latency=latency) as srv:
            for entry, call in _entry_points(srv.url(path.name)).items():
                cells: dict[str, dict] = {}
                for way in WAYS:
                    if way == "per read" and entry.startswith("load_dduf"):
                        continue  # the fetch never read headers one by one: "probe" is its before
                    if way == "index" and entry not in FROM_INDEX:
                        continue  # opened as with "suffix": nothing of it answers from the index
                    times, gets = [], 0
                    for _ in range(runs):
                        with _way(way):
                            srv.reset()
                            started = time.perf_counter()
                            call()
                            times.append(time.perf_counter() - started)
                            gets = srv.gets
                    cells[way] = {"requests": gets, "seconds": median(times), "runs_s": times}
                rows[entry] = cells
                print(f"{label:28} {entry:40} " + "  ".join(
                    f"{w}: {c['requests']:3d} req {c['seconds'] * 1e3:7.1f} ms" for w, c in cells.items()), flush=True)
        out[label] = {"bytes": path.stat().st_size, "index_copies_model_index": _copies_model_index(path),
                      "rows": rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=0.020, help="seconds slept before each answer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-large", action="store_true", help="skip the SD-1.5- and SDXL-shaped archives")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ["HF_HUB_OFFLINE"] = "0"  # the remote reader refuses URLs offline; the server is on loopback
    from dduf_plus.storage.http_range import SUFFIX_BYTES

    results = measure(_archives(not args.no_large), args.latency, args.runs)
    opens = {label: r["rows"]["load_dduf(URL): open (reader + tail)"]["suffix"]["requests"]
             for label, r in results.items()}
    info = {label: r["rows"]["dduf info URL"]["index"]["requests"] for label, r in results.items()}
    write_result(OUT, {
        "latency_s": args.latency, "runs": args.runs, "suffix_bytes": SUFFIX_BYTES, "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(), "target_requests_to_open": 1,
        "requests_to_open": opens, "requests_for_info": info, "archives": results})
    print(f"requests to open (load_dduf's reader + tail): {opens}")
    print(f"requests for dduf info URL: {info}")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
