"""Hub-grade validation of DDUF archives.

:func:`validate` runs every structural rule the reader already checks on open (ZIP records, DDUF layout,
safetensors headers: :class:`~dduf_plus.format.archive.DDUFArchive` ``.findings``) and adds what needs
more than records: component configs and other JSON entries parse, sharded-weight indexes name present
files, ``_dduf_plus_references`` are well-formed, the dduf_plus index agrees with the archive. With
``verify=True`` it also hashes every entry (CRC-32 against the ZIP records, sha256 against the index),
read with ``os.preadv`` by a thread per core (hashlib, zlib and preadv release the GIL); a file
truncated meanwhile is a :class:`~dduf_plus.errors.DDUFIOError`, never a SIGBUS.

Structural validation reads records, headers, configs and tokenizer files (their budgets: D014): kilobytes
to a few MB, also over fsspec URLs (range requests).
Bad input never raises: it becomes findings. :class:`~dduf_plus.errors.DDUFError` means the source could
not be read at all (missing file, unreachable URL).

A local ``X.dduf.zst`` is decompressed (every frame's checksum and size verified, within the
decompression budget) into a private temporary file and the plain archive validated, reported under the
``.zst`` path; a stream that cannot be decompressed is a ``Z021`` finding, one over the budget ``Z022``.
zstandard is imported only for ``.zst`` files."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import DDUFError, DDUFFormatError, DDUFIOError
from ..storage.http_range import HTTPSource
from ..storage.prefetch_source import PrefetchSource
from ..storage.source import ByteSource, is_url, open_source
from . import spec
from .archive import DDUFArchive, Entry
from .chat_template import restore_plan
from .findings import SEVERITIES, VERDICT_LABELS, Finding, finding
from .json_budget import SETTINGS_FILES, json_budget_problem, over_size
from .pipeline_kinds import config_copy_findings
from .references import SHA256
from .structure import component_specs, parse_json
from .tokenizer_budget import applies as tokenizer_applies
from .tokenizer_budget import budget_findings
from .weights import shard_map

# Structural validation parses what the loader parses itself (configs, shard indexes, generation_config.json,
# quanto_qmap.json) and every other JSON entry up to this size; bigger ones only with ``verify``, else their
# budget is checked on the bytes (D013: tokenizer files by _check_budgets), as the loader checks every JSON
# file it hands a library by path (format/json_budget.py).
STRUCTURAL_JSON_LIMIT = 256 << 10
HASH_CHUNK = 8 << 20
READ_CACHE = 64 << 20
READ_CACHE_ONE = 8 << 20  # what two rules may both read: configs (8 MiB budget), tokenizer files; not hashing blocks
REMOTE_CHUNK = 16 << 20
_CRC32 = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class ValidationReport:
    """The verdict on one archive. ``errors``, ``warnings`` and ``infos`` hold :class:`Finding` records (stable
    rule ``code``, ``entry`` or component concerned, ``message``; what each severity means:
    :data:`~dduf_plus.format.findings.SEVERITIES`); ``valid`` is True when there are no errors.
    ``io_error`` is set (and ``valid`` False) when the source could not be read at all: only
    :func:`dduf_plus.validate_many` makes such reports (:func:`validate` raises instead).
    :meth:`as_dict` is the ``dduf validate --json`` record."""

    path: str
    valid: bool
    errors: tuple[Finding, ...]
    warnings: tuple[Finding, ...]
    # two reports with the same verdict and findings are equal, however they read and how long each took
    bytes_read: int = field(compare=False)
    seconds: float = field(compare=False)
    infos: tuple[Finding, ...] = ()
    io_error: str | None = None

    @property
    def codes(self) -> list[str]:
        """Rule codes of the errors, then of the warnings, then of the infos, in the order they were found."""
        return [f.code for f in (*self.errors, *self.warnings, *self.infos)]

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding: errors, then warnings, then infos."""
        return (*self.errors, *self.warnings, *self.infos)

    def as_dict(self) -> dict[str, Any]:
        """The ``dduf validate --json`` record (schema :data:`REPORT_SCHEMA_VERSION`, docs/validation.md "JSON
        report schema"): ``schema_version``, ``path``, ``valid``, ``errors``, ``warnings``, ``infos`` (each a
        list of ``{code, severity, entry, message, offset}``), and ``io_error`` for a source that could not be
        read. Every string is valid Unicode (:func:`json_text`), so any JSON parser reads the record."""
        out: dict[str, Any] = {
            "schema_version": REPORT_SCHEMA_VERSION,
            "path": json_text(self.path),
            "valid": self.valid,
            "errors": [finding_record(f) for f in self.errors],
            "warnings": [finding_record(f) for f in self.warnings],
            "infos": [finding_record(f) for f in self.infos],
        }
        if self.io_error is not None:
            out["io_error"] = json_text(self.io_error)
        return out

    def __str__(self) -> str:
        head = f"{VERDICT_LABELS[self.valid]} {self.path}"
        lines = [f"  {SEVERITIES[f.severity].label:<7} {f}" for f in self.findings]
        return "\n".join([head, *lines])


# The version of the --json / --json-lines / as_dict() schema (docs/validation.md, "JSON report schema"): raised
# only when a field is removed or changes meaning; new fields may appear within a version.
REPORT_SCHEMA_VERSION = 1
FINDING_FIELDS = ("code", "severity", "entry", "message", "offset")  # a finding's record, in this order


def json_text(text: str) -> str:
    """``text`` with every lone surrogate (a non-UTF-8 path given on the command line, ``\\udc80`` in an
    archive's JSON) written as the six characters ``\\udXXX``: ``json.dumps`` would emit it as a lone
    ``\\u`` escape, which strict parsers (Rust's serde_json, Go) refuse or replace."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def finding_record(f: Finding) -> dict[str, Any]:
    """One finding of a JSON report: its fields :data:`FINDING_FIELDS` (``entry`` and ``offset`` may be null)."""
    return {"code": f.code, "severity": f.severity, "entry": None if f.entry is None else json_text(f.entry),
            "message": json_text(f.message), "offset": f.offset}


def unreadable(path: str, message: str) -> ValidationReport:
    """The report of a source that could not be read (``io_error``; ``dduf validate`` exits with 2)."""
    return ValidationReport(path, False, (), (), 0, 0.0, io_error=message)


class _SourceFailure(DDUFIOError):
    """The source failed to deliver bytes it has (I/O, network): no verdict on the archive is possible."""


class _OutOfBounds(Exception):
    """A rule asked for bytes outside the file: a validator bug, reported as X000, never an I/O error."""


class _GuardedSource:
    """Wraps a ByteSource: bounds every read itself, so a parser bug and a failing disk or server can be
    told apart. Closing is left to whoever opened the inner source."""

    def __init__(self, inner: ByteSource):
        self.inner = inner
        self.name = inner.name
        self.size = inner.size
        # Two rules may read the same entry (a config is parsed by the JSON rule, then budget-checked: D015):
        # reads are kept up to READ_CACHE bytes in all, so validation fetches each byte once (remote sources).
        self._kept: dict[tuple[int, int], bytes] = {}
        self._kept_bytes = 0

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    @property
    def prefetching(self) -> bool:
        return bool(getattr(self.inner, "prefetching", False))

    reads_small_entries = True  # the rules read configs and tokenizer files whole: plan them with the headers

    def kept(self, offset: int, length: int) -> bytes | None:
        kept = getattr(self.inner, "kept", None)
        return kept(offset, length) if kept is not None else None

    def prefetch(self, ranges: list[tuple[int, int]]) -> int:
        """Pass the format floor's plan on (a remote source fetches it in merged requests)."""
        try:
            return int(self.inner.prefetch(ranges))  # type: ignore[attr-defined]
        except DDUFError as e:
            raise _SourceFailure(str(e)) from None

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise _OutOfBounds(f"read of {length} bytes at {offset} in a {self.size}-byte file")
        data = self._kept.get((offset, length))
        if data is not None:
            return data
        try:
            data = self.inner.read_at(offset, length)
        except DDUFError as e:
            raise _SourceFailure(str(e)) from None
        if length <= READ_CACHE_ONE and self._kept_bytes + length <= READ_CACHE:
            self._kept[(offset, length)] = data
            self._kept_bytes += length
        return data

    def close(self) -> None:
        pass


# A check beyond the format's rules, run on the opened archive like every rule (its exceptions become X000):
# how the top floor adds the load check (dduf_plus.validate(..., load_check=True)) without this floor
# importing torch.
ArchiveCheck = Callable[[DDUFArchive], Iterable[Finding]]


def validate(source: str | os.PathLike | ByteSource, verify: bool = False, strict: bool = False, *,
             max_decompressed: Any = None, checks: Sequence[ArchiveCheck] = (),
             **storage_options: Any) -> ValidationReport:
    """Check an archive against every DDUF and dduf_plus rule.

    Args:
        source: a local path, any fsspec URL (``https://``, ``hf://``, ``s3://``...) or a ByteSource.
        verify: also hash every entry: CRC-32 vs the ZIP records (H001), sha256 vs the index (H002).
        strict: count warnings as errors (infos stay infos: see
            :data:`~dduf_plus.format.findings.SEVERITIES`).
        max_decompressed: the decompression budget for a ``.zst`` (see
            :func:`dduf_plus.storage.zst.decompression_budget`; default ``$DDUF_PLUS_MAX_DECOMPRESSED``,
            else 256 GiB and 16x the compressed size above 256 MiB); over it is a ``Z022`` error.
        checks: more checks to run on the opened archive (each gives findings; an exception is an X000
            finding). :func:`dduf_plus.validate` passes the load check here when ``load_check=True``.
        storage_options: passed to fsspec for URLs.

    Returns:
        A :class:`ValidationReport`; bad input gives ``valid=False`` with rule codes, never an exception.

    Raises:
        DDUFError: the source cannot be opened or read (missing file, unreachable URL, I/O error).

    A local path ending in ``.zst`` (``X.dduf.zst``) is decompressed into a private temporary file first,
    removed after the verdict (see :func:`dduf_plus.storage.zst_cache.validation_archive`; the persistent
    cache is never written); its report carries the ``.zst`` path, a stream that cannot be decompressed
    (truncated, corrupted, not zstd, zstandard missing) is a ``Z021`` error, one over the budget or the
    free disk space a ``Z022`` error.

    Example:
        >>> report = validate("model.dduf", verify=True)
        >>> report.valid, [f.code for f in report.errors]
        (True, [])
    """
    if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".zst"):
        return _validate_zst(source, verify, strict, max_decompressed, checks, storage_options)
    started = time.perf_counter()
    owned = isinstance(source, (str, os.PathLike))
    inner: ByteSource = open_source(source, **storage_options) if isinstance(source, (str, os.PathLike)) else source
    if isinstance(source, str) and is_url(source) or isinstance(source, HTTPSource):  # e.g. dduf serve's URL checks
        inner = PrefetchSource(inner)  # structural reads in a few merged requests (the tail at once, then a plan)
    guarded = _GuardedSource(inner)
    findings: list[Finding] = []
    hashed = 0
    try:
        archive = _guard(findings, "archive", lambda: DDUFArchive(guarded, check=False))
        if archive is not None:
            findings.extend(archive.findings)
            for rule in (_check_json_entries, _check_index, _check_budgets, _check_quantization, _check_components,
                         _check_adapters):
                findings.extend(_guard(findings, rule.__name__.strip("_"), rule, archive, guarded, verify) or ())
            if verify:
                problems, hashed = _guard(findings, "verify", _verify_entries, archive, guarded) or ((), 0)
                findings.extend(problems)
            for check in checks:
                findings.extend(_guard(findings, getattr(check, "__name__", "check"), lambda c=check: list(c(archive)))
                                or ())
        if archive is not None:
            findings = [located(f, archive) for f in findings]
    finally:
        bytes_read = inner.bytes_read + hashed
        if owned:
            inner.close()
    return _report(inner.name, findings, strict, bytes_read, time.perf_counter() - started)


def located(f: Finding, archive: DDUFArchive) -> Finding:
    """``f`` with its byte ``offset`` filled in where the rule gave none and its entry is a stored member (its
    first data byte) or a stored tensor (``member:tensor``: the tensor's first byte), so a hub can point at
    the bytes; folders, components and archive-wide findings keep ``None``."""
    if f.offset is not None or not f.entry:
        return f
    entries = archive.entries
    member = entries.get(f.entry)
    if member is not None:
        return f._replace(offset=member.offset)
    name, _, tensor = f.entry.partition(":")
    member = entries.get(name)
    if member is None:
        return f
    header = archive.headers.get(name)
    info = header.tensors.get(tensor) if header is not None else None
    return f._replace(offset=member.offset + (header.data_start + info.begin if header and info else 0))


def _validate_zst(source: str | os.PathLike, verify: bool, strict: bool, max_decompressed: Any,
                  checks: Sequence[ArchiveCheck], storage_options: dict[str, Any]) -> ValidationReport:
    """Decompress a ``.dduf.zst`` into a private temporary file (never the persistent cache), validate the
    plain archive, report under ``source``; the file is removed after the verdict, whatever happens."""
    started = time.perf_counter()
    name = os.fspath(source)
    if is_url(name):
        raise DDUFError(f"{name}: .zst archives are validated from a local file; download it first")
    local = open_source(name)  # the same checks and messages as for a plain archive (missing, not a file)
    size = local.size
    local.close()
    from ..storage import zst  # lazy: plain archives never import it (nor zstandard)
    from ..storage.zst_cache import validation_archive

    def failed(code: str, message: str) -> ValidationReport:
        return _report(name, [finding(code, None, message)], strict, size, time.perf_counter() - started)

    try:
        zst.zstd_module()
    except DDUFError as e:  # zstandard missing or broken: the message says `pip install zstandard`
        return failed("Z021", str(e))
    with ExitStack() as stack:
        try:
            archive = stack.enter_context(validation_archive(name, max_decompressed=max_decompressed))
        except zst.DecompressionBudgetError as e:  # a bomb, or no room for a genuine archive: Z022
            return failed("Z022", str(e))  # the stream is named as the caller named it
        except DDUFFormatError as e:  # truncated, corrupted (DDUFIntegrityError), not zstd, bad seek table
            return failed("Z021", str(e))
        except OSError as e:  # the temporary folder cannot be written (disk full, read-only): exit 2
            raise DDUFError(f"{name}: cannot decompress into a temporary folder ({tempfile.gettempdir()}, "
                            f"$TMPDIR): {e}") from None
        except DDUFError:
            raise
        except Exception as e:  # noqa: BLE001 - a decoder bug on hostile input: an incomplete verdict, never a crash
            return _report(name, [finding("X000", None, f"internal error in zst: {type(e).__name__}: {e}"[:500])],
                           strict, size, time.perf_counter() - started)
        inner = validate(archive, verify=verify, strict=strict, checks=checks, **storage_options)
    return replace(inner, path=name, bytes_read=inner.bytes_read + size, seconds=time.perf_counter() - started)


def _guard(findings: list[Finding], label: str, rule: Callable[..., Any], *args: Any) -> Any:
    """Run one rule; whatever it raises (but a failing source) becomes an X000 finding."""
    try:
        return rule(*args)
    except _SourceFailure:
        raise
    except Exception as e:  # a validator must survive its own bugs (RecursionError, MemoryError...)
        findings.append(finding("X000", None, f"internal error in {label}: {type(e).__name__}: {e}"[:500]))
        return None


def _report(path: str, findings: Iterable[Finding], strict: bool, bytes_read: int, seconds: float) -> ValidationReport:
    """Findings sorted by severity. ``strict`` makes warnings errors, never infos: an archive another writer
    made from a good folder (no index, no ZIP64, unaligned) passes ``--strict``."""
    unique = list(dict.fromkeys(findings))
    errors = tuple(f for f in unique if f.severity == "error")
    warnings = tuple(f for f in unique if f.severity == "warning")
    infos = tuple(f for f in unique if f.severity not in ("error", "warning"))
    if strict:
        errors, warnings = errors + tuple(f._replace(severity="error") for f in warnings), ()
    return ValidationReport(path, not errors, errors, warnings, bytes_read, seconds, infos)


# --- rules the reader does not run on open ---------------------------------------------------------
def load_findings(archive: DDUFArchive) -> list[Finding]:
    """What structural validation checks beyond opening the archive (every JSON entry within the budget of its
    kind; sharded-weight indexes; the index against the archive; tokenizer and weightless-config budgets;
    quantized components self-consistent):
    ``load_dduf`` runs it before it builds anything, so it refuses what ``validate`` (without ``verify``)
    refuses, with the same codes."""
    entries = archive.entries
    return (json_entry_findings(archive, lambda e: archive.read_bytes(e.name), verify=False)
            + _check_index(archive, None, False)
            + budget_findings(((name, e.length) for name, e in entries.items() if name not in archive.compressed),
                              archive.read_bytes)
            + quantization_findings(archive, lambda e: archive.read_bytes(e.name), archive.read_bytes)
            + adapter_findings(archive, lambda e: archive.read_bytes(e.name), archive.read_bytes))


def _read_json(read: Callable[[Entry], bytes], e: Entry) -> tuple[Any, list[Finding]]:
    """An entry through the one archive JSON reader; one over its kind's byte budget is not even read."""
    why = over_size(e.length, e.name)
    if why is not None:
        return None, [finding("D013", e.name, why)]
    return parse_json(read(e), e.name)


def _bytes_within_budget(read: Callable[[Entry], bytes], e: Entry) -> list[Finding]:
    """D013 for a large JSON entry nobody here parses (the loader hands it to a library by path and checks it
    the same way): its budget on the bytes, no parse."""
    why = over_size(e.length, e.name)
    found = ("D013", why) if why is not None else json_budget_problem(read(e), e.name)
    return [] if found is None else [finding(found[0], e.name, found[1])]


def _check_json_entries(archive: DDUFArchive, source: _GuardedSource, verify: bool) -> list[Finding]:
    return json_entry_findings(archive, lambda e: source.read_at(e.offset, e.length), verify=verify)


def json_entry_findings(archive: DDUFArchive, read: Callable[[Entry], bytes], *, verify: bool) -> list[Finding]:
    """D007: configs (always) and other JSON entries (small ones, or all with verify) parse; configs are
    objects. D011: a sharded-weights index names only files its folder holds. D013: each within the JSON
    budget of its kind (:func:`~dduf_plus.format.json_budget.budget_for`). ``read`` gives an entry's bytes."""
    out: list[Finding] = []
    entries = archive.entries
    compressed: frozenset[str] = getattr(archive, "compressed", frozenset())  # a loader's folder view has none
    for name, e in entries.items():
        if not name.endswith(".json") or name in (spec.MODEL_INDEX, spec.INDEX_NAME) or name in compressed:
            continue  # a compressed entry's bytes are not its content: Z011 is what is wrong with it
        basename = name.rsplit("/", 1)[-1]
        is_config = "/" in name and basename in spec.CONFIG_FILES
        shard_index = ".safetensors.index" in basename
        # what the loader parses itself is always checked, whatever its size: configs, shard indexes, settings
        parsed_by_loader = is_config or shard_index or basename in SETTINGS_FILES
        if not (parsed_by_loader or verify or e.length <= STRUCTURAL_JSON_LIMIT):
            if not tokenizer_applies(name):  # tokenizer files: _check_budgets (D013, D014)
                out.extend(_bytes_within_budget(read, e))
            continue
        value, problems = _read_json(read, e)
        out.extend(problems)
        if problems:
            continue
        if is_config and not isinstance(value, dict):
            out.append(finding("D007", name, f"config is a JSON {type(value).__name__}, not an object"))
        if shard_index:
            out.extend(_check_shard_index(name, value, entries))
    copies = [name for name in entries if name not in compressed]
    return out + config_copy_findings(copies, lambda name: read(entries[name]))  # D019


def _check_budgets(archive: DDUFArchive, source: _GuardedSource, verify: bool) -> list[Finding]:
    """D014: tokenizer files within their caps (vocabulary, pieces, merges, added tokens); D015: scheduler and
    guider configs hold no number out of range (format/tokenizer_budget.py, the checks the loader runs too).
    Tokenizer files are read whole: the few MB a real pipeline holds, what the loader reads anyway. Also the
    files ``dduf unpack`` would restore from chat-template records (I002, D013, D014, Z005: the same
    :func:`~dduf_plus.format.chat_template.restore_plan` unpack and complete refuse by)."""
    entries = archive.entries

    def read(name: str) -> bytes:
        return source.read_at(entries[name].offset, entries[name].length)

    found = budget_findings(((name, e.length) for name, e in entries.items() if name not in archive.compressed), read)
    return found + restore_plan(archive.stored_index, {n: e.length for n, e in entries.items()}, read).findings


def _check_components(archive: DDUFArchive, source: _GuardedSource, verify: bool) -> list[Finding]:
    """D016: model components stored without weights; D017: classes their library does not have (looked up
    in the installed diffusers / transformers source text, no torch). The loader runs the same two checks
    before it resolves anything (same codes), for the components the caller does not pass itself."""
    from .class_names import class_findings, missing_weight_findings

    return missing_weight_findings(archive.components.values()) + class_findings(archive.model_index)


def _check_adapters(archive: DDUFArchive, source: _GuardedSource, verify: bool) -> list[Finding]:
    """A001-A007: a LoRA archive's ``_lora/`` (format/lora.py), headers and alpha scalars only."""
    return adapter_findings(archive, lambda e: source.read_at(e.offset, e.length),
                            lambda name, offset, n: source.read_at(archive.entries[name].offset + offset, n))


def adapter_findings(archive: DDUFArchive, read: Callable[[Entry], bytes],
                     read_range: Callable[[str, int, int], bytes]) -> list[Finding]:
    """A001-A007 for the archive's adapters, if it has any (``read``/``read_range`` as for
    :func:`quantization_findings`)."""
    from .lora import LORA_CONFIG, archive_findings

    e = archive.entries.get(LORA_CONFIG)
    if e is None:
        return []
    if over_size(e.length, e.name) is not None or e.name in archive.compressed:
        return []  # D013 / Z011 already say so
    config, problems = parse_json(read(e), e.name)
    if problems:
        return []  # D007 / D013 already say so
    headers = archive.headers

    def read_tensor(entry: str, info: Any) -> bytes:
        return read_range(entry, headers[entry].data_start + info.begin, info.nbytes)

    return archive_findings(archive.model_index, archive.entries, headers, config, read_tensor)


def _check_quantization(archive: DDUFArchive, source: _GuardedSource, verify: bool) -> list[Finding]:
    """Q001-Q006 (see :func:`quantization_findings`), read through the validator's guarded source."""
    entries = archive.entries
    return quantization_findings(archive, lambda e: source.read_at(e.offset, e.length),
                                 lambda name, offset, n: source.read_at(entries[name].offset + offset, n))


def quantization_findings(archive: DDUFArchive, read: Callable[[Entry], bytes],
                          read_range: Callable[[str, int, int], bytes] | None = None) -> list[Finding]:
    """Q001-Q006: components quantized by torchao / bitsandbytes / SDNQ are self-consistent
    (format/quant_rules.py). ``read`` gives an entry's bytes, ``read_range(entry, offset, length)`` a range of
    one: with it, the small metadata tensors a backend parses (bitsandbytes' quant states) are checked too."""
    from .quant_rules import findings_for

    out: list[Finding] = []
    entries = archive.entries
    for name in sorted({n.split("/", 1)[0] for n in entries if n.endswith("/config.json") and n.count("/") == 1}):
        e = entries[f"{name}/config.json"]
        if over_size(e.length, e.name) is not None or e.name in archive.compressed:
            continue  # D013 / Z011 already say so
        config, problems = parse_json(read(e), e.name)
        out.extend(_quanto_component_findings(archive, name, config, read))
        if problems or not isinstance(config, dict) or "quantization_config" not in config:
            continue  # D007 / D013 already say so; not quantized
        weights = [w for w in archive.weight_files(name) if w in archive.headers]
        out.extend(findings_for(name, config, [archive.headers[w] for w in weights],
                                None if read_range is None else _tensor_reader(archive, weights, read_range)))
    return out


def _quanto_component_findings(archive: DDUFArchive, name: str, config: Any, read: Callable[[Entry], bytes]) -> list[Finding]:
    """Q008: an optimum-quanto component's int8 weights the loader will copy (quantization.quanto_unaligned);
    Q003: its stored parts against its map's qtypes (quant_rules.quanto_findings)."""
    from .quant_rules import quanto_findings
    from .quantization import QMAP_NAME, backend_of, quanto_unaligned, unaligned_finding

    method = backend_of(config) if isinstance(config, dict) else None
    if f"{name}/{QMAP_NAME}" not in archive.entries and method != "quanto":
        return []
    weights = [w for w in archive.weight_files(name) if w in archive.headers] if name in archive.components else []
    starts = ((info, archive.entries[w].offset + archive.headers[w].data_start + info.begin)
              for w in weights for info in archive.headers[w].tensors.values())
    unaligned = quanto_unaligned(starts)
    qmap = archive.entries.get(f"{name}/{QMAP_NAME}")
    parsed = parse_json(read(qmap), qmap.name)[0] \
        if qmap is not None and over_size(qmap.length, qmap.name) is None and qmap.name not in archive.compressed else None
    return quanto_findings(name, parsed, [archive.headers[w] for w in weights]) + \
        ([unaligned_finding(name, unaligned)] if unaligned else [])


def _tensor_reader(archive: DDUFArchive, weights: list[str],
                   read_range: Callable[[str, int, int], bytes]) -> Callable[[str], bytes]:
    """A stored tensor's bytes by name, over a component's weight entries."""
    def read_tensor(tensor: str) -> bytes:
        for entry in weights:
            info = archive.headers[entry].tensors.get(tensor)
            if info is not None:
                return read_range(entry, archive.headers[entry].data_start + info.begin, info.nbytes)
        raise KeyError(tensor)
    return read_tensor


def _check_shard_index(name: str, value: Any, entries: dict[str, Entry]) -> list[Finding]:
    weight_map = shard_map(value)
    if weight_map is None:
        return [finding("D011", name, "sharded-weights index has no 'weight_map' object of file names")]
    folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    missing = sorted({f for f in weight_map.values() if folder + f not in entries})
    if missing:
        shown = ", ".join(repr(f) for f in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return [finding("D011", name, f"weight_map names {shown}, missing from {folder or 'the archive root'}")]
    return []


def _check_index(archive: DDUFArchive, source: _GuardedSource | None, verify: bool) -> list[Finding]:
    """What the reader's index check leaves out: digests well-formed, CRC-32 and tensor data offsets equal
    to the archive's, components equal to model_index.json's (stored files, references)."""
    index = archive.stored_index
    if not isinstance(index, dict) or index.get("format_version") != spec.INDEX_VERSION:
        return []  # absent, broken (I001 already) or a newer version this reader only partly knows
    files, components = index.get("files"), index.get("components")
    if not isinstance(files, dict) or not isinstance(components, dict):
        return []
    entries = archive.entries
    out: list[Finding] = []
    for name, rec in files.items():
        e = entries.get(name)
        if e is None or not isinstance(rec, dict):
            continue  # reported by the reader (I002)
        sha, crc = rec.get("sha256"), rec.get("crc32")
        if sha is not None and not (isinstance(sha, str) and SHA256.fullmatch(sha)):
            out.append(finding("I001", name, f"sha256 {sha!r} is not 64 lowercase hex digits"))
        if crc is not None and not (isinstance(crc, str) and _CRC32.fullmatch(crc)):
            out.append(finding("I001", name, f"crc32 {crc!r} is not 8 lowercase hex digits"))
        elif crc is not None and int(crc, 16) != e.crc32:
            out.append(finding("I002", name, f"index CRC-32 {crc} differs from the ZIP records' {e.crc32:08x}"))
        header = archive.headers.get(name)
        tdo = rec.get("tensor_data_offset")
        if header is not None and tdo is not None and tdo != e.offset + header.data_start:
            out.append(finding("I002", name, f"tensor_data_offset {tdo!r} is not {e.offset + header.data_start}"))
    specs = component_specs(archive.model_index)
    refs = archive.references
    unreadable = any(f.code in ("D001", "D002") for f in archive.findings)  # said once: not a difference per name
    if set(components) != set(specs) and not unreadable:
        differ = sorted(set(components) ^ set(specs))
        out.append(finding("I002", spec.INDEX_NAME, f"components differ from model_index.json's: {', '.join(differ)}"))
    folders = archive.components  # entries grouped by folder once: not components x entries
    for name, comp in components.items():
        if name not in specs or not isinstance(comp, dict):
            continue
        if name in refs and comp.get("external") != refs[name]:
            out.append(finding("I002", name, "index reference differs from model_index.json's"))
        listed = comp.get("files")
        if isinstance(listed, list):
            stored = [f"{name}/{f}" for f in folders[name].files]
            if sorted(x for x in listed if isinstance(x, str)) != stored or not all(isinstance(x, str) for x in listed):
                out.append(finding("I002", name, "index lists other files than the component folder holds"))
    return out


# --- verify: hash every entry ----------------------------------------------------------------------
def _verify_entries(archive: DDUFArchive, source: _GuardedSource, workers: int | None = None) -> tuple[list[Finding], int]:
    """H001/H002 findings for every entry whose bytes don't match, and the number of bytes hashed from the
    local file's descriptor (reads through the source count themselves)."""
    # a compressed entry's CRC-32 is that of its content, not of the bytes stored (Z011 already says so)
    entries = [e for e in archive.entries.values() if e.length and e.name not in archive.compressed]
    fd = getattr(source.inner, "fd", None)
    local = isinstance(fd, int) and fd >= 0
    if isinstance(fd, int) and local:
        try:
            results = _hash_local(fd, entries, workers or min(8, max(2, os.cpu_count() or 2)))
        except _SourceFailure as failure:  # name the archive: a --from-file batch reports it as that source's io_error
            raise _SourceFailure(f"{source.name}: {failure}") from None
    else:
        results = {e.name: _hash_read(source, e) for e in entries}
    out: list[Finding] = []
    for e in entries:
        crc, sha = results[e.name]
        if crc != e.crc32:
            out.append(finding("H001", e.name, f"CRC-32 is {crc:08x}, the ZIP records say {e.crc32:08x}"))
        if sha is not None and sha != e.sha256:
            out.append(finding("H002", e.name, f"sha256 is {sha}, the index says {e.sha256}"))
    return out, sum(e.length for e in entries) if local else 0


def _hash_local(fd: int, entries: list[Entry], workers: int) -> dict[str, tuple[int, str | None]]:
    """CRC-32 and sha256 of each entry as separate jobs, longest first, over ``workers`` threads: on two
    cores a 1.7 GB unet's sha256 runs on one while the other does every CRC and the smaller sha256s.

    Read with ``os.preadv`` into a buffer per job, never through a memory map: a file truncated while it is
    hashed (a listed archive rewritten by its owner, a download replaced) made a mapped read fault with
    SIGBUS, which killed the whole ``--from-file`` batch with no line; here a short read is a
    :class:`_SourceFailure` (an ``io_error`` result) and the batch goes on."""
    from concurrent.futures import ThreadPoolExecutor

    if not entries:
        return {}
    crcs: dict[str, int] = {}
    shas: dict[str, str | None] = {e.name: None for e in entries}
    jobs = [(e.length // 4, "crc32", e) for e in entries]  # CRC-32 runs ~4x faster than sha256
    jobs += [(e.length, "sha256", e) for e in entries if e.sha256 is not None]
    jobs.sort(key=lambda job: -job[0])
    _advise_sequential(fd)

    def run(kind: str, e: Entry) -> None:
        if kind == "crc32":
            crcs[e.name] = _crc32_file(fd, e)
        else:
            shas[e.name] = _sha256_file(fd, e)

    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="dduf-verify") as pool:
        futures = [pool.submit(run, kind, e) for _, kind, e in jobs]
    for future in futures:
        future.result()
    return {e.name: (crcs[e.name], shas[e.name]) for e in entries}


def _advise_sequential(fd: int) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:  # only a hint
            pass


def _entry_chunks(fd: int, e: Entry) -> Iterator[memoryview]:
    """The bytes of ``e`` in HASH_CHUNK pieces, read with ``os.preadv`` into one reused buffer (the GIL is
    released while the kernel copies). A read that ends early (the file was truncated meanwhile) or fails
    is a :class:`_SourceFailure`, never a signal."""
    buffer = bytearray(min(HASH_CHUNK, e.length))
    view = memoryview(buffer)
    done = 0
    try:
        while done < e.length:
            want = min(len(buffer), e.length - done)
            got = os.preadv(fd, [view[:want]], e.offset + done)
            if got <= 0:
                raise _SourceFailure(f"entry {e.name!r}: the file ended at byte {e.offset + done} while it was "
                                     f"being hashed (it was truncated or replaced during validation)")
            yield view[:got]
            done += got
    except OSError as err:
        raise _SourceFailure(f"entry {e.name!r}: cannot read it to hash it: {err}") from None
    finally:
        view.release()


def _crc32_file(fd: int, e: Entry) -> int:
    import zlib

    crc = 0
    for chunk in _entry_chunks(fd, e):
        crc = zlib.crc32(chunk, crc)
    return crc


def _sha256_file(fd: int, e: Entry) -> str:
    import hashlib

    h = hashlib.sha256()
    for chunk in _entry_chunks(fd, e):
        h.update(chunk)
    return h.hexdigest()


def _hash_read(source: _GuardedSource, e: Entry) -> tuple[int, str | None]:
    """Remote sources: stream the entry in large range requests."""
    import hashlib
    import zlib

    crc, h = 0, hashlib.sha256() if e.sha256 is not None else None
    for at in range(e.offset, e.offset + e.length, REMOTE_CHUNK):
        chunk = source.read_at(at, min(REMOTE_CHUNK, e.offset + e.length - at))
        crc = zlib.crc32(chunk, crc)
        if h is not None:
            h.update(chunk)
    return crc, h.hexdigest() if h is not None else None
