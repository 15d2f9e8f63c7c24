"""Mutation fuzzer over the loader: ``load_dduf``, ``DDUFArchive`` + ``describe``, ``dduf info [--json]`` and
``dduf refs [--json]`` (in-process) on mutants of the tiny-dit fixture (tests/mutations.py says how they are
made). Anything but a ``DDUFError`` is a finding, and so is a hang, a crash of the worker process, a
``DDUFError`` wrapping a ``MemoryError``, control characters in human output, or a change under the
reference source / canary folders.

    python bench/fuzz_loader.py --seconds 600              # the long run (figures in the notes)
    python bench/fuzz_loader.py --count 200 --seed 3       # a fixed set
    python bench/fuzz_loader.py --replay bench/results/fuzz/X.dduf   # run the targets on one saved input
    python bench/fuzz_loader.py --remote --seconds 600     # through the hostile server (tests/hostile_server.py)
    python bench/fuzz_loader.py --quant --seconds 300      # quantized bases: quantization states mutated too
    python bench/fuzz_loader.py --single-file --seconds 300   # single-file checkpoint headers (see below)

``--single-file`` fuzzes single-file checkpoints instead of archives (tests/mutations.py, second engine): shapes,
dtypes, key names and ``__metadata__`` of clean tiny SD 1.x, SD3.5 and FLUX.1 checkpoints, run through
``describe_checkpoint`` / ``dduf info CKPT``, ``plan_single_file`` / ``dduf info CKPT --base BASE`` and
``dduf pack CKPT --base BASE``; the same outcomes, deadlines, address-space limit and RSS report apply.

``--remote`` serves each input from tests/hostile_server.py on 127.0.0.1 in a mode drawn from the seed and the
input's number (honest a third of the time, so mutants get loaded through the remote path too; otherwise any
hostile mode, from the first request or from a later one) and runs ``validate(URL)``, ``dduf info URL`` and
``load_dduf(URL)`` under a short deadline. Besides the outcomes above, a finding is: more bytes sent by the
server than :func:`REMOTE_SENT_BOUND` allows, a target slower than the deadline allows, or a load that
succeeded from an archive that is not the served file byte for byte.

Inputs run in a forked worker (torch etc. imported once, before the fork) under a per-input deadline and an
address-space limit; a worker that hangs or dies is replaced and its input saved. Each finding's input is
written under bench/results/fuzz/ (``*.dduf`` is gitignored) with a ``.json`` that says how to regenerate it
(seed and number) and what happened. Prints inputs tried, outcomes per target (ok / DDUFError by class /
other) and the slowest inputs; ``summary.json`` holds the same.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "fuzz"
SAVE_PER_SIGNATURE = 3
SLOW_FORMAT_S = 3.0  # issue 10: info/refs/opening an archive answer within 3 s
SLOW_LOAD_S = 10.0  # no budget is written down for load_dduf; the tiny fixture loads in 0.1 s
BIG_RSS_MB = 500  # issue 10: 500 MB peak for the format-level commands; reported for load too
REMOTE_DEADLINE_S = 1.0  # DDUF_REMOTE_DEADLINE in --remote: a trickle or a stall ends here
REMOTE_READ_TIMEOUT_S = 1  # HF_HUB_DOWNLOAD_TIMEOUT in --remote (huggingface_hub reads it as an int)
REMOTE_EXTRA = 32 << 20  # what an overrunning answer offers past each range


def REMOTE_SENT_BOUND(size: int) -> int:  # noqa: N802 - a bound, named like the constants above
    """Bytes the server may have sent for an input of ``size`` bytes over the three remote targets: each
    reads it about once (load: once; validate and info: headers, or whole below 512 KiB), plus headers and
    what the kernel buffers for a reader that stopped (a 64 KiB send buffer and the receive window)."""
    return 4 * size + (16 << 20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600, help="stop after this long (default 600)")
    p.add_argument("--count", type=int, help="stop after this many inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first input number")
    p.add_argument("--timeout", type=float, default=60, help="hard deadline per input: the worker is killed")
    p.add_argument("--limit", type=float, default=30, help="soft deadline per target (in-process alarm)")
    p.add_argument("--memory-gb", type=float, default=12, help="address-space limit of the worker")
    p.add_argument("--in-process", action="store_true", help="no worker process (no hard deadline)")
    p.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one)")
    p.add_argument("--out", type=Path, default=OUT, help="where findings and summary.json go")
    p.add_argument("--replay", type=Path, nargs="+", help="run the targets on these archives and print the outcomes")
    p.add_argument("--remote", action="store_true", help="serve each input from the hostile server (random modes)")
    p.add_argument("--quant", action="store_true",
                   help="add bases with a quantized transformer (bitsandbytes 4-bit nested / 8-bit, torchao, SDNQ, "
                        "quanto) and mutate their quantization states")
    p.add_argument("--single-file", action="store_true", help="fuzz single-file checkpoint headers (info/pack --base)")
    p.add_argument("--families", default="v1,sd3,flux", help="--single-file: checkpoint families (v1, sd3, flux)")
    return p.parse_args(argv)


def setup_environment(work: Path, remote: bool = False) -> None:
    """Offline (but for the loopback server in --remote), private caches; set before huggingface_hub reads
    its constants."""
    os.environ["HF_HUB_OFFLINE"] = "0" if remote else "1"
    if remote:
        os.environ["DDUF_REMOTE_DEADLINE"] = str(REMOTE_DEADLINE_S)
        os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = str(REMOTE_READ_TIMEOUT_S)
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["DDUF_PLUS_CACHE"] = str(work / "dduf-cache")
    os.environ["HF_HOME"] = str(work / "hf-home")
    os.environ["HF_HUB_CACHE"] = str(work / "hf-home" / "hub")
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))


def quiet_libraries() -> None:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # the loader warns on every odd input; outcomes are what we count
    try:
        import torch

        torch.set_num_threads(1)  # one thread: no OpenMP pool to break across fork, and fair on 2 cores
    except ImportError:  # pragma: no cover
        pass


def preload() -> None:
    """Import what loading imports, so that forked workers start warm."""
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    import dduf_plus.cli  # noqa: F401
    import dduf_plus.loading.pipeline  # noqa: F401


def peak_rss_mb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return 0


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass



def finish_result(fuzzer: Any, result: dict, outcomes: list, started: float) -> dict:
    """An input's result: its outcomes plus a finding when the watched folders changed (nothing may write
    there), its peak RSS and time. Both engines end each input here."""
    after = fuzzer.m.snapshot(*fuzzer.watched)
    if after != fuzzer.before:
        changed = sorted(set(after.items()) ^ set(fuzzer.before.items()))[:10]
        outcomes.append(fuzzer.m.Outcome("filesystem", "finding", "watched-folder-changed", 0, repr(changed)))
        fuzzer.before = after
    result["outcomes"] = [list(o) for o in outcomes]
    result["peak_rss_mb"] = peak_rss_mb()
    result["seconds"] = time.perf_counter() - started
    return result

class Fuzzer:
    """Generates input N and runs the targets on it, in whichever process calls :meth:`run_one`."""

    def __init__(self, work: Path, seed: int, limit: float, remote: bool = False, quant: bool = False):
        import mutations

        self.m = mutations
        self.work, self.seed, self.limit, self.remote = work, seed, limit, remote
        self.server: Any = None  # the hostile server (--remote), started in the process that runs inputs
        self.served = work / "served"
        self.served.mkdir(exist_ok=True)
        self.bases, self.ctx = mutations.make_bases(work / "bases", quant=quant)
        self.canary = work / "canary"
        self.canary.mkdir(exist_ok=True)
        (self.canary / "keep.txt").write_text("nothing may touch this\n")
        self.watched = (self.ctx.source.parent, self.canary)
        self.before = mutations.snapshot(*self.watched)

    def input(self, number: int) -> Any:
        scratch = self.work / f"gen-{os.getpid()}"
        scratch.mkdir(exist_ok=True)
        return self.m.generate(self.bases, self.ctx, self.seed, number, scratch)

    def run_one(self, number: int) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            inp = self.input(number)
        except Exception as e:  # noqa: BLE001 - a bug of the mutation engine: reported, and the run goes on
            import traceback

            return {"number": number, "base": "?", "mutations": [], "outcomes": [
                ["generator", "finding", f"harness-{type(e).__name__}", 0, "".join(traceback.format_exception(e))]]}
        result: dict[str, Any] = {"number": number, "base": inp.base, "mutations": inp.mutations, "outcomes": []}
        if inp.data is None:
            result["unwritable"] = True
            return result
        path = (self.served if self.remote else self.work) / f"input-{os.getpid()}.dduf"
        path.write_bytes(inp.data)
        reset_peak_rss()
        if self.remote:
            result["server_mode"], result["server_sent"], outcomes = self.run_remote(path, number)
        else:
            outcomes = self.m.run_targets(path, limit_s=self.limit)
        return finish_result(self, result, outcomes, started)


    def _server(self) -> Any:
        from hostile_server import HostileServer

        if self.server is None or self.server.pid != os.getpid():  # a forked worker starts its own
            self.server = HostileServer(self.served, extra=REMOTE_EXTRA).__enter__()
            self.server.pid = os.getpid()
        return self.server

    def run_remote(self, path: Path, number: int) -> tuple[str, int, list[Any]]:
        """The remote targets on ``path`` served in a mode drawn from (seed, number): see :func:`run_remote`."""
        return run_remote(self.m, self._server(), path, self.seed, number, self.limit)


class SingleFileFuzzer:
    """:class:`Fuzzer` for single-file checkpoints: input N is a mutated checkpoint, the targets are the
    single-file commands against the checkpoint's BASE folder (tests/mutations.py, ``generate_single_file``)."""

    def __init__(self, work: Path, seed: int, limit: float, families: tuple[str, ...]):
        import mutations

        self.m = mutations
        self.work, self.seed, self.limit = work, seed, limit
        self.bases = mutations.single_file_bases(work / "bases", families=families)
        self.canary = work / "canary"
        self.canary.mkdir(exist_ok=True)
        (self.canary / "keep.txt").write_text("nothing may touch this\n")
        self.watched = (self.canary, *(b.base for b in self.bases))
        self.before = mutations.snapshot(*self.watched)

    def input(self, number: int) -> Any:
        return self.m.generate_single_file(self.bases, self.seed, number)

    def warm(self) -> None:
        """Run the targets once on a clean checkpoint: the first conversion imports diffusers' converters."""
        path = self.work / "warm.safetensors"
        draft = self.m.SingleFileDraft({k: list(v) for k, v in self.bases[0].tensors.items()}, None)
        path.write_bytes(self.m.write_checkpoint(draft))
        self.m.run_single_file_targets(path, self.bases[0].base, self.work / "warm.dduf")

    def run_one(self, number: int) -> dict[str, Any]:
        started = time.perf_counter()
        inp = self.input(number)
        result: dict[str, Any] = {"number": number, "base": inp.base, "mutations": inp.mutations, "single_file": True}
        path = self.work / f"input-{os.getpid()}.safetensors"
        path.write_bytes(inp.data)
        reset_peak_rss()
        outcomes = self.m.run_single_file_targets(path, inp.base_path, self.work / f"out-{os.getpid()}.dduf",
                                                  limit_s=self.limit)
        return finish_result(self, result, outcomes, started)


def run_remote(m: Any, server: Any, path: Path, seed: int, number: int, limit: float | None
               ) -> tuple[str, int, list[Any]]:
    """The remote targets on ``path`` (a file ``server`` serves) in a mode drawn from (seed, number): (mode,
    bytes the server sent, outcomes), the bounds checked as findings. The remote cache is emptied first."""
    import random
    import shutil

    from hostile_server import MODES, wait_idle

    rng = random.Random(f"{seed}-{number}-remote")
    mode = "honest" if rng.random() < 1 / 3 else rng.choice(sorted(MODES))
    honest_first = rng.choice((0, 0, 1, 2, 3, 5))
    wait_idle(server)
    shutil.rmtree(Path(os.environ["DDUF_PLUS_CACHE"]) / "remote", ignore_errors=True)  # fetched afresh
    server.mode, server.honest_first = mode, honest_first
    server.reset()
    try:
        outcomes = remote_targets(m, server.url(path.name), limit, before_each=server.restart_count)
    finally:
        server.mode, server.honest_first = "honest", 0
    wait_idle(server)
    label = f"{mode}@{honest_first}" if honest_first else mode
    size = path.stat().st_size
    if server.sent > REMOTE_SENT_BOUND(size):
        outcomes.append(m.Outcome("server", "finding", "unbounded-bytes", 0,
                                  f"{label}: the server sent {server.sent} bytes for a {size}-byte input"))
    for o in list(outcomes):
        if o.seconds > REMOTE_DEADLINE_S + 2 * REMOTE_READ_TIMEOUT_S + 3 and o.status != "finding":
            outcomes.append(m.Outcome(o.target, "finding", "past-the-deadline", o.seconds,
                                      f"{label}: {o.target} took {o.seconds:.1f} s"))
        if o.target == "remote-load" and o.status == "ok" and (why := _fetched_differs(path)):
            outcomes.append(m.Outcome(o.target, "finding", "loaded-bytes-differ", o.seconds, f"{label}: {why}"))
    return label, server.sent, outcomes


def _fetched_differs(path: Path) -> str | None:
    """After a load that succeeded: why the archive it fetched is not the served file byte for byte (None if
    it is). Whatever the server did, what loads must be the file's real bytes."""
    fetched = list((Path(os.environ["DDUF_PLUS_CACHE"]) / "remote").glob("*.dduf"))
    if len(fetched) != 1:
        return f"{len(fetched)} archives in the remote cache after one load"
    return None if fetched[0].read_bytes() == path.read_bytes() else f"{fetched[0].name} differs from the served file"


def remote_targets(m: Any, url: str, limit: float | None, before_each: Any = None) -> list[Any]:
    """``validate(URL)``, ``dduf info URL`` and ``load_dduf(URL)``, each classified as mutations.run_targets
    does; ``before_each()`` runs before each (the server counts each target's requests from 1)."""
    from dduf_plus import load_dduf
    from dduf_plus.format.validate import validate

    def validating() -> None:
        validate(url)

    def loading() -> None:
        load_dduf(url)

    outcomes = []
    for target, call in (("remote-validate", validating), ("remote-info", lambda: m._cli(["info", url], human=True)),
                         ("remote-load", loading)):
        if before_each is not None:
            before_each()
        outcomes.append(m.run_target(target, call, limit))
    return outcomes


def _worker(conn: Any, fuzzer: Fuzzer, memory_gb: float) -> None:
    limit = int(memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        number = conn.recv()
        if number is None:
            return
        conn.send(fuzzer.run_one(number))


class Pool:
    """One forked worker at a time; replaced when it hangs past the deadline or dies."""

    def __init__(self, fuzzer: Fuzzer, memory_gb: float):
        self.fuzzer, self.memory_gb = fuzzer, memory_gb
        self.ctx = multiprocessing.get_context("fork")
        self.proc = None
        self.restarts = 0

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.fuzzer, self.memory_gb), daemon=True)
        self.proc.start()

    def run(self, number: int, timeout: float) -> dict[str, Any]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(number)
        started = time.perf_counter()
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        self.proc.join(0.5)
        died = self.proc.exitcode
        self.proc.kill()
        self.proc.join()
        self.proc = None
        self.restarts += 1
        try:
            inp = self.fuzzer.input(number)
            base, done = inp.base, inp.mutations
        except Exception:  # noqa: BLE001 - reported by the worker's own attempt, if it got that far
            base, done = "?", []
        label = "hang" if died is None else f"worker-died-{died}"
        return {"number": number, "base": base, "mutations": done,
                "outcomes": [["worker", "finding", label, time.perf_counter() - started, f"exit code {died}"]],
                "seconds": time.perf_counter() - started}

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:90]


class Report:
    def __init__(self, out: Path, seed: int):
        import mutations

        self.m = mutations
        self.out, self.seed = out, seed
        self.inputs = self.unwritable = 0
        self.by_target: dict[str, Counter] = {}
        self.by_kind: dict[str, Counter] = {}  # mutation kind -> how far its inputs got
        self.findings: dict[str, dict[str, Any]] = {}
        self.slow: list[tuple[float, int, str]] = []
        self.big: list[tuple[int, int]] = []
        self.baseline_rss = 0  # peak RSS of a warm process before any input
        self.by_mode: dict[str, dict[str, Any]] = {}  # --remote: server mode -> outcomes and worst figures
        self.started = time.perf_counter()

    def add(self, result: dict[str, Any], fuzzer: Fuzzer) -> None:
        self.inputs += 1
        if result.get("unwritable"):
            self.unwritable += 1
            return
        outcomes = result["outcomes"]
        status = {o[0]: o for o in outcomes}
        load = "remote-load" if "remote-load" in status else "load"
        reach = ("loaded" if status.get(load, [None, None])[1] == "ok" else
                 "load refused" if load in status else
                 "archive refused" if status.get("archive", [None, None])[1] == "error" else "other")
        if result.get("single_file"):  # --single-file: planned (converted and compared), refused, or header refused
            plan = status.get("sf-plan")
            reach = "header refused" if plan is None else "planned" if plan[1] == "ok" else "plan refused"
        for kind in {k for k, _ in result["mutations"]}:
            self.by_kind.setdefault(kind, Counter())[reach] += 1
        for o in outcomes:
            self.by_target.setdefault(o[0], Counter())[o[2] if o[1] != "finding" else f"FINDING {o[2]}"] += 1
            limit = SLOW_LOAD_S if o[0] == "load" else SLOW_FORMAT_S
            if o[1] == "timeout" or (o[3] > limit and o[1] != "finding"):
                self.slow.append((o[3], result["number"], o[0]))
            if o[1] in ("finding", "timeout"):
                self._save(o, result, fuzzer)
        if result.get("peak_rss_mb", 0) > BIG_RSS_MB + self.baseline_rss:
            self.big.append((result["peak_rss_mb"], result["number"]))
        if "server_mode" in result:
            self._add_mode(result, status)

    def _add_mode(self, result: dict[str, Any], status: dict[str, Any]) -> None:
        mode = result["server_mode"].split("@")[0]
        row = self.by_mode.setdefault(mode, {"inputs": 0, "load": Counter(), "max_sent_bytes": 0,
                                             "max_seconds": 0.0, "max_peak_rss_mb": 0})
        row["inputs"] += 1
        row["load"][str(status.get("remote-load", [None, None, "not run"])[2]).split(":")[0]] += 1
        row["max_sent_bytes"] = max(row["max_sent_bytes"], result.get("server_sent", 0))
        row["max_seconds"] = max(row["max_seconds"], round(max((o[3] for o in result["outcomes"]), default=0), 2))
        row["max_peak_rss_mb"] = max(row["max_peak_rss_mb"], result.get("peak_rss_mb", 0))

    def _save(self, outcome: list, result: dict[str, Any], fuzzer: Fuzzer) -> None:
        sig = self.m.signature(self.m.Outcome(*outcome))
        record = self.findings.setdefault(sig, {"count": 0, "saved": [], "first": None})
        record["count"] += 1
        if record["first"] is None:
            record["first"] = {"seed": self.seed, "number": result["number"], "base": result["base"],
                               "mutations": result["mutations"], "detail": outcome[4][-4000:]}
        if len(record["saved"]) >= SAVE_PER_SIGNATURE:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"{_slug(sig)}-s{self.seed}-n{result['number']}"
        try:
            data = fuzzer.input(result["number"]).data
        except Exception:  # noqa: BLE001 - a harness bug: nothing to save
            data = None
        if data is not None:
            (self.out / f"{name}.dduf").write_bytes(data)
        (self.out / f"{name}.json").write_text(json.dumps(
            {"seed": self.seed, "number": result["number"], "signature": sig, "base": result["base"],
             "mutations": result["mutations"], "outcomes": result["outcomes"],
             "regenerate": f"python bench/fuzz_loader.py --seed {self.seed} --start {result['number']} --count 1"
                           + (" --remote" if "server_mode" in result else "")
                           + (" --single-file" if result.get("single_file") else ""), "server_mode": result.get("server_mode")},
            indent=1))
        record["saved"].append(f"{name}.dduf")

    def summary(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        return {"seed": self.seed, "inputs": self.inputs, "baseline_rss_mb": self.baseline_rss, "unwritable": self.unwritable, "seconds": round(elapsed, 1),
                "inputs_per_second": round(self.inputs / elapsed, 2) if elapsed else None,
                "outcomes": {t: dict(c.most_common()) for t, c in sorted(self.by_target.items())},
                "reach_by_mutation": {k: dict(c) for k, c in sorted(self.by_kind.items())},
                "findings": self.findings,
                "slow": sorted(self.slow, reverse=True)[:20], "big_rss_mb": sorted(self.big, reverse=True)[:20],
                **({"by_server_mode": {k: {**v, "load": dict(v["load"])} for k, v in sorted(self.by_mode.items())}}
                   if self.by_mode else {})}

    def print(self) -> None:
        s = self.summary()
        print(f"\n{s['inputs']} inputs in {s['seconds']} s ({s['inputs_per_second']}/s), seed {s['seed']}; "
              f"{s['unwritable']} refused by the writer (not run)")
        for target, counts in s["outcomes"].items():
            total = sum(counts.values())
            ok = counts.get("ok", 0) + counts.get("exit 0", 0)
            bad = sum(v for k, v in counts.items() if k.startswith("FINDING") or k == "timeout")
            print(f"  {target:<10} {total:>6} runs: {ok} ok, {total - ok - bad} DDUFError, {bad} other")
            for label, n in list(counts.items())[:12]:
                print(f"      {n:>6}  {label}")
        print("  how far each mutation kind got (inputs):")
        for kind, c in s["reach_by_mutation"].items():
            print(f"      {kind:<16} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        print(f"  findings: {len(s['findings'])} distinct" + ("" if s["findings"] else " (none)"))
        for sig, rec in s["findings"].items():
            print(f"      {rec['count']:>5}x {sig}  e.g. seed {rec['first']['seed']} number {rec['first']['number']}: "
                  f"{rec['first']['mutations']}"[:400])
        for seconds, number, target in s["slow"][:10]:
            print(f"  slow: {target} {seconds:.1f} s on input {number}")
        for mb, number in s["big_rss_mb"][:10]:
            print(f"  big: {mb} MB peak RSS on input {number}")
        if s.get("by_server_mode"):
            print("  by server mode: inputs, worst bytes sent / seconds / peak RSS, load_dduf(URL) outcomes")
            for mode, row in s["by_server_mode"].items():
                print(f"      {mode:<17} {row['inputs']:>5}  {row['max_sent_bytes'] / 2**20:>7.2f} MiB "
                      f"{row['max_seconds']:>6.2f} s {row['max_peak_rss_mb']:>5} MB  "
                      + ", ".join(f"{k} {v}" for k, v in sorted(row["load"].items())))


def replay(paths: list[Path], limit: float) -> int:
    import mutations

    bad = 0
    for path in paths:
        for o in mutations.run_targets(path, limit_s=limit):
            print(f"{path.name}: {o.target:<10} {o.status:<8} {o.label} ({o.seconds:.2f} s)")
            if o.bad:
                bad += 1
                print(o.detail)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="dduf-fuzz-loader-"))
    work.mkdir(parents=True, exist_ok=True)
    setup_environment(work, args.remote)
    quiet_libraries()
    if args.replay:
        return replay(args.replay, args.limit)
    preload()
    fuzzer: Any
    if args.single_file:
        fuzzer = SingleFileFuzzer(work, args.seed, args.limit, tuple(args.families.split(",")))
        fuzzer.warm()
    else:
        fuzzer = Fuzzer(work, args.seed, args.limit, args.remote, args.quant)
        fuzzer.m.run_targets(fuzzer.ctx.archive_paths[0])  # warm: the first load imports what loading needs
    report = Report(args.out, args.seed)
    report.baseline_rss = peak_rss_mb()
    pool = None if args.in_process else Pool(fuzzer, args.memory_gb)
    deadline = time.perf_counter() + args.seconds
    number, last_progress = args.start, time.perf_counter()
    print(f"fuzzing the loader: seed {args.seed}, work folder {work}, findings to {args.out}", flush=True)
    try:
        while time.perf_counter() < deadline and (args.count is None or number < args.start + args.count):
            result = pool.run(number, args.timeout) if pool else fuzzer.run_one(number)
            report.add(result, fuzzer)
            number += 1
            if time.perf_counter() - last_progress > 60:
                last_progress = time.perf_counter()
                print(f"  ... {report.inputs} inputs, {len(report.findings)} distinct findings", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        if pool:
            pool.close()
    report.print()
    summary = report.summary() | {"worker_restarts": pool.restarts if pool else 0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
