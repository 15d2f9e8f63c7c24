"""DDUFArchive: a strict, zero-copy reader.

Opening parses and cross-checks every ZIP record, the DDUF structure and every safetensors header
(kilobytes of reads, no tensor data). Entry bytes are then served as ``memoryview`` slices of one
private mmap of the file, and tensors as torch views of that same mapping."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from itertools import repeat
from operator import add, attrgetter, methodcaller, mod
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DDUFEntryNotFoundError, DDUFError, DDUFFormatError, DDUFValidationError, path_argument
from ..storage.prefetch_source import PrefetchSource
from ..storage.source import ByteSource, is_url, open_source
from . import spec
from .findings import Finding, finding
from .index import FileRecord, build_index, check_index
from .open_plan import prefetch_hook
from .safetensors_header import SafetensorsHeader, read_safetensors_header
from .sniff import torch_zip_kind
from .structure import check_structure, component_specs, parse_json
from .weights import select_weights, tensor_files
from .zipfmt import ZipEntry, parse_layout

if TYPE_CHECKING:  # pragma: no cover
    import torch

MAX_JSON_ENTRY = 64 << 20  # model_index.json / the index / configs are small; refuse absurd ones
_LISTED = 20  # findings of one kind listed one by one before the rest is counted


class Entry(NamedTuple):
    name: str
    offset: int  # absolute offset of the first data byte
    length: int
    crc32: int
    sha256: str | None  # from the dduf_plus index, when the archive has one


class Component(NamedTuple):
    name: str
    library: str | None
    class_name: str | None
    files: tuple[str, ...]  # file names inside the component folder
    external: dict[str, Any] | None  # reference to a component stored elsewhere


class DDUFArchive:
    """Read a DDUF archive.

    Example:
        >>> with DDUFArchive("model.dduf") as archive:
        ...     config = json.loads(archive.read_text("unet/config.json"))
        ...     weights = archive.tensors("unet")  # torch tensors viewing the file's mmap

    Raises:
        DDUFValidationError: the archive breaks a structural rule (``.findings`` holds the rule codes).
        DDUFError: the file cannot be opened.
    """

    # compressed entries (Z011): listed, never read as they are (their bytes are not the content); only
    # model_index.json and the index, when deflated, are inflated within their budget to check the rest
    compressed: frozenset[str] = frozenset()

    def __init__(self, path: str | os.PathLike | ByteSource, *, check: bool = True, **storage_options: Any):
        if not isinstance(path, (str, os.PathLike)) and not hasattr(path, "read_at"):  # a ByteSource has it
            path = path_argument(path, "DDUFArchive(path=...)")
        self._source: ByteSource = (
            open_source(path, **storage_options) if isinstance(path, (str, os.PathLike)) else path)
        if isinstance(path, str) and is_url(path):  # structural reads in a few merged requests (tail at once, then planned ranges)
            self._source = PrefetchSource(self._source)
        self.path = self._source.name
        self._mmap: mmap.mmap | None = None
        self.findings: list[Finding] = []
        self.headers: dict[str, SafetensorsHeader] = {}
        self.model_index: dict[str, Any] = {}
        self.stored_index: dict[str, Any] | None = None
        self._entries: dict[str, Entry] = {}
        self._components: dict[str, Component] | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        if check and any(f.severity == "error" for f in self.findings):
            findings = self.findings
            self.close()
            raise DDUFValidationError(self.path, findings)

    # --- parsing -------------------------------------------------------------------------------------
    def _open(self) -> None:
        layout, findings = parse_layout(self._source, prefetch_hook(self._source))
        self.findings.extend(findings)
        if layout is None:
            return
        self.layout = layout
        zip_entries: dict[str, ZipEntry] = {e.name: e for e in layout.entries}
        self.compressed = frozenset(name for name, e in zip_entries.items() if e.compressed)
        torch_zip = None if spec.MODEL_INDEX in zip_entries else torch_zip_kind(list(zip_entries))
        if torch_zip is not None:  # say what the file is, not a ZIP or DDUF error per pickle entry
            self.findings[:] = [finding("D001", None, f"model_index.json is missing: the file is {torch_zip}")]
            return
        first = min(layout.entries, key=lambda e: e.header_offset).name if layout.entries else None
        raw_model_index = self._read_small(zip_entries.get(spec.MODEL_INDEX))
        model_index, parsed = None, raw_model_index is not None
        if raw_model_index is not None:
            model_index, problems = parse_json(raw_model_index, spec.MODEL_INDEX, code="D002")
            self.findings.extend(problems)
            parsed = not problems
        self.findings.extend(check_structure(list(zip_entries), model_index, first_entry=first, parsed=parsed))
        if isinstance(model_index, dict):
            self.model_index = model_index
        self._read_headers(zip_entries)
        raw_index = self._read_small(zip_entries.get(spec.INDEX_NAME))
        if raw_index is not None:
            index, problems = parse_json(raw_index, spec.INDEX_NAME, code="I001")
            why = check_index(index) if not problems else None
            self.findings.extend(problems)
            if why:
                self.findings.append(finding("I001", spec.INDEX_NAME, why))
            elif not problems and isinstance(index, dict):  # check_index passed: it is one
                self.stored_index = index
                self.findings.extend(self._check_index_agrees(index, zip_entries))
        elif spec.INDEX_NAME not in zip_entries:
            self.findings.append(finding("I003", None, "archive has no dduf_plus index"))
        files = (self.stored_index or {}).get("files")
        files = files if isinstance(files, dict) else {}
        for name, e in zip_entries.items():
            sha = files.get(name, {}).get("sha256") if isinstance(files.get(name), dict) else None
            self._entries[name] = Entry(name, e.data_offset, e.size, e.crc32, sha if isinstance(sha, str) else None)

    def _read_small(self, e: ZipEntry | None) -> bytes | None:
        """A JSON entry's bytes, unless they are over its budget (D013: not even read)."""
        if e is None:
            return None
        budget = spec.json_budget(e.name)
        limit = budget.bytes if budget else MAX_JSON_ENTRY
        if e.size > limit:
            self.findings.append(finding("D013", e.name, f"{e.size} bytes is more than the {limit} allowed"))
            return None
        if e.compressed:
            return self._inflate(e)
        return self._source.read_at(e.data_offset, e.size)

    def _inflate(self, e: ZipEntry) -> bytes | None:
        """A small deflated entry's content (the caller bounded ``e.size``), when it inflates to exactly its
        size and CRC-32; else None (nothing more is said about its content than Z011)."""
        import zlib

        if e.method != spec.METHOD_DEFLATED or e.span > e.size + (e.size >> 6) + 1024:  # deflate barely grows data
            return None
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            data = inflater.decompress(self._source.read_at(e.data_offset, e.span), e.size + 1)
        except zlib.error:
            return None
        return data if len(data) == e.size and zlib.crc32(data) == e.crc32 else None

    def _read_headers(self, zip_entries: dict[str, ZipEntry]) -> None:
        """Parse every safetensors header within the tensor caps (S011): each file may declare at most
        spec.MAX_TENSORS_PER_FILE tensors and at most what spec.MAX_TENSORS_PER_ARCHIVE leaves after the files
        before it; once the archive's cap is passed, the remaining headers are not read. So no archive costs
        more than the per-archive cap's worth of tensors, however its tensors are spread over files."""
        cap = spec.MAX_TENSORS_PER_ARCHIVE
        total = 0
        files = [(name, e) for name, e in zip_entries.items() if name.endswith(".safetensors") and not e.compressed]
        for done, (name, e) in enumerate(files):
            if total > cap:
                self.findings.append(finding("S011", None, f"the archive declares more than {cap} tensors (the "
                                             f"per-archive cap); {len(files) - done} more safetensors files not read"))
                return
            limit = min(spec.MAX_TENSORS_PER_FILE, cap - total)
            header, problems = read_safetensors_header(self._source.read_at, e.data_offset, e.size, name,
                                                       max_tensors=limit)
            over = any(f.code == "S011" for f in problems)
            if over and limit < spec.MAX_TENSORS_PER_FILE:  # the archive's cap, not this file's
                self.findings.extend(f for f in problems if f.code != "S011")
                self.findings.append(finding("S011", name, f"with this file the archive declares more than {cap} "
                                             f"tensors (the per-archive cap); {len(files) - done - 1} more safetensors files not read"))
                return
            self.findings.extend(problems)
            if header is not None:
                self.headers[name] = header
                self._check_alignment(e, header)
                total += len(header.tensors)
            elif over:
                total += spec.MAX_TENSORS_PER_FILE + 1  # at least that many

    def _check_alignment(self, e: ZipEntry, header: SafetensorsHeader) -> None:
        data_start = e.data_offset + header.data_start
        if data_start % spec.TENSOR_ALIGNMENT:
            self.findings.append(finding("S008", e.name, f"tensor data starts at {data_start}, not a multiple of 4096"))
        tensors = list(header.tensors.values())
        # Column-wise (C) for the common all-aligned case; the Python loop only finds the first offender.
        starts = list(map(add, repeat(data_start), map(_BEGIN, tensors)))
        widths = list(map(_ELEMENT_BYTES.__getitem__, map(_DTYPE, tensors)))
        if any(map(mod, starts, widths)):
            for t, start, width in zip(tensors, starts, widths, strict=True):
                if start % width:
                    self.findings.append(finding("S009", e.name, f"tensor {t.name} at {start} is not {width}-byte aligned"))
                    break

    def _check_index_agrees(self, index: dict[str, Any], zip_entries: dict[str, ZipEntry]) -> list[Finding]:
        out: list[Finding] = []
        files = index.get("files")
        if not isinstance(files, dict):  # check_index lets newer format versions through unchecked
            return [finding("I001", spec.INDEX_NAME, "index has no 'files' object")]
        absent: list[str] = []
        for name, rec in files.items():
            e = zip_entries.get(name)
            if e is None or not isinstance(rec, dict):
                absent.append(name)
                continue
            if type(rec.get("size")) is not int or rec["size"] != e.size or rec.get("offset") != e.data_offset:
                out.append(finding("I002", name, "size or offset differs from the ZIP records"))
                continue
            header = self.headers.get(name)
            tensors = rec.get("tensors")
            if header is not None and isinstance(tensors, dict) and not _tensor_records_agree(
                    tensors, header, e.data_offset + header.data_start):
                out.append(finding("I002", name, "tensor records differ from the safetensors header"))
        # One finding per file up to a point: an index may name 200,000 files (within its D013 budget), and a
        # verdict listing each of them costs more than the rest of the validation.
        out.extend(finding("I002", name, "indexed file is not in the archive") for name in absent[:_LISTED])
        if len(absent) > _LISTED:
            out.append(finding("I002", spec.INDEX_NAME, f"and {len(absent) - _LISTED} more indexed files are not "
                                                        "in the archive"))
        for name in zip_entries:
            if name != spec.INDEX_NAME and name not in files:
                out.append(finding("I002", name, "entry is missing from the index"))
        return out

    # --- entries -------------------------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, Entry]:
        return dict(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise DDUFEntryNotFoundError(f"{self.path} has no entry {name!r}") from None

    def read_bytes(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """An entry's bytes, or ``length`` of them from ``offset`` within the entry (a range read: pread
        locally, one HTTP range request remotely)."""
        e = self.entry(name)
        if length is None:
            length = e.length - offset
        if offset < 0 or length < 0 or offset + length > e.length:
            raise DDUFFormatError(f"{self.path}: bytes {offset}..{offset + length} are outside entry {name!r} "
                                  f"({e.length} bytes)")
        return self._source.read_at(e.offset + offset, length)

    def read_text(self, name: str, encoding: str = "utf-8") -> str:
        try:
            return self.read_bytes(name).decode(encoding)
        except UnicodeDecodeError as err:
            raise DDUFFormatError(f"{self.path}: entry {name!r} is not {encoding} text ({err.reason})") from None

    def read_json(self, name: str) -> Any:
        value, problems = parse_json(self.read_bytes(name), name)
        if problems:
            raise DDUFFormatError(f"{self.path}: {problems[0]}")
        return value

    @property
    def mmap(self) -> mmap.mmap:
        """One private (copy-on-write) mapping of the whole file; pages are shared with the page cache
        until written, which loaders never do."""
        if self._mmap is None:
            if is_url(self.path) or not hasattr(self._source, "fd"):
                raise DDUFError(f"{self.path}: memory mapping needs a local file")
            self._mmap = mmap.mmap(self._source.fd, 0, access=mmap.ACCESS_COPY)
        return self._mmap

    @property
    def fd(self) -> int | None:
        """The open descriptor of a local archive (the file whose structure was checked), else None."""
        fd = getattr(self._source, "fd", None)
        return fd if isinstance(fd, int) and fd >= 0 else None

    @property
    def size(self) -> int:
        """The archive's size in bytes when it was opened."""
        return self._source.size

    def view(self, name: str) -> memoryview:
        """A zero-copy, read-only ``memoryview`` of an entry's bytes."""
        e = self.entry(name)
        return memoryview(self.mmap)[e.offset : e.offset + e.length].toreadonly()

    # --- components ----------------------------------------------------------------------------------
    @property
    def references(self) -> dict[str, Any]:
        refs = self.model_index.get(spec.REFERENCES_KEY)
        return refs if isinstance(refs, dict) else {}

    @property
    def components(self) -> dict[str, Component]:
        """{name: Component} for every component model_index.json names (computed once: entries and
        model_index.json do not change after opening)."""
        if self._components is None:
            refs = self.references
            by_folder: dict[str, list[str]] = {}
            for n in self._entries:
                folder, sep, file = n.partition("/")
                if sep:
                    by_folder.setdefault(folder, []).append(file)
            self._components = {
                name: Component(name, library, cls, tuple(sorted(by_folder.get(name, ()))), refs.get(name))
                for name, (library, cls) in component_specs(self.model_index).items()
            }
        return dict(self._components)

    def component(self, name: str) -> Component:
        comps = self._components if self._components is not None else self.components
        if name not in comps:
            raise DDUFEntryNotFoundError(f"{self.path}: model_index.json names no component {name!r} (has: {', '.join(comps)})")
        return comps[name]

    def weight_files(self, component: str, variant: str | None = None) -> list[str]:
        """Entry names of the safetensors files that make up ``component``'s weights for ``variant``."""
        comp = self.component(component)
        return [f"{component}/{f}" for f in tensor_files(select_weights(comp.files, variant))]

    def tensor_infos(self, component: str, variant: str | None = None) -> dict[str, tuple[str, Any]]:
        """{tensor name: (entry name, TensorInfo)} over the component's weight files."""
        out = {}
        for entry in self.weight_files(component, variant):
            for tname, info in self.headers[entry].tensors.items():
                out[tname] = (entry, info)
        return out

    def tensors(self, component: str, variant: str | None = None) -> dict[str, torch.Tensor]:
        """The component's tensors as torch tensors viewing the archive's mmap (no copy). Tensors a
        foreign writer left misaligned for their dtype are copied; nothing else is."""
        import torch

        mm = self.mmap
        out: dict[str, torch.Tensor] = {}
        for tname, (entry, info) in self.tensor_infos(component, variant).items():
            start = self._entries[entry].offset + self.headers[entry].data_start + info.begin
            out[tname] = tensor_view(mm, start, info, torch)
        return out

    @property
    def index(self) -> dict[str, Any]:
        """The stored dduf_plus index, or one derived from the archive (no hashes) for foreign archives."""
        if self.stored_index is not None:
            return self.stored_index
        files = [FileRecord(e.name, e.length, e.offset, None, e.crc32) for e in self._entries.values() if e.name != spec.INDEX_NAME]
        return build_index(self.model_index, files, self.headers, created_by="derived", references=self.references)

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        # Never mmap.close(): torch.frombuffer holds a reference to the map, not a buffer export, so an
        # explicit close would unmap memory that live tensors still point into. Dropping our reference
        # unmaps it when the last tensor goes.
        self._mmap = None
        self._source.close()

    def __enter__(self) -> DDUFArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DDUFArchive({self.path!r}, entries={len(self._entries)})"


_BEGIN, _DTYPE, _SHAPE = attrgetter("begin"), attrgetter("dtype"), attrgetter("shape")
_ELEMENT_BYTES = {d.torch: max(1, d.bits // 8) for d in spec.DTYPES}
_GET_OFFSET, _GET_DTYPE, _GET_SHAPE = (methodcaller("get", key) for key in ("offset", "dtype", "shape"))


def _tensor_records_agree(records: dict[str, Any], header: SafetensorsHeader, data_start: int) -> bool:
    """The index's tensor records of one file name the header's tensors with the same archive offsets,
    dtypes and shapes. Column-wise (C): this runs for every tensor on every open."""
    if records.keys() != header.tensors.keys():
        return False
    infos = list(header.tensors.values())
    stored = list(map(records.__getitem__, header.tensors))
    if set(map(type, stored)) - {dict}:
        return False
    return (list(map(_GET_OFFSET, stored)) == list(map(add, repeat(data_start), map(_BEGIN, infos)))
            and list(map(_GET_DTYPE, stored)) == list(map(_DTYPE, infos))
            and list(map(_GET_SHAPE, stored)) == list(map(list, map(_SHAPE, infos))))



_TORCH_DTYPES: dict[str, tuple[Any, int]] = {}  # spec dtype name -> (torch dtype or None, bytes per element)


def torch_dtype_of(name: str, torch: Any) -> tuple[Any, int]:
    """(the torch dtype, its size in bytes) for a spec dtype name; (None, 0) where this torch lacks it or it
    is narrower than a byte. Looked up once per name: a pipeline views about a thousand tensors."""
    found = _TORCH_DTYPES.get(name)
    if found is None:
        dtype = spec.DTYPE_BY_TORCH[name]
        torch_dtype = getattr(torch, dtype.torch, None)
        found = _TORCH_DTYPES[name] = (torch_dtype, dtype.bits // 8) if torch_dtype is not None and dtype.bits >= 8 else (None, 0)
    return found


def tensor_view(buffer: Any, start: int, info: Any, torch: Any) -> torch.Tensor:
    torch_dtype, size = torch_dtype_of(info.dtype, torch)
    if torch_dtype is None:
        raise DDUFFormatError(f"tensor {info.name}: dtype {spec.DTYPE_BY_TORCH[info.dtype].torch} is not supported "
                              "by this torch")
    numel = info.nbytes // size
    if numel == 0:
        return torch.empty(info.shape, dtype=torch_dtype)
    if start % size:
        data = bytearray(buffer[start : start + info.nbytes])  # misaligned by a foreign writer: copy
        return torch.frombuffer(data, dtype=torch_dtype).view(info.shape)
    flat = torch.frombuffer(buffer, dtype=torch_dtype, count=numel, offset=start)
    return flat if len(info.shape) == 1 else flat.view(info.shape)

