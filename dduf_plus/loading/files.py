"""Where a component's files come from: the :class:`ComponentFiles` protocol and its two implementations,
one over a component folder inside a DDUF archive and one over a plain diffusers component folder.

Builders only ever see this protocol, so a component stored in the archive, one resolved from an external
reference (``dduf_plus.refs``) and one on disk are loaded by the same code. Weights are handed out as torch
tensors that view a memory map (no copy), or, with ``use_mmap=False``, read tensor by tensor with
``os.preadv`` into their own buffers (for network file systems where mmap page faults are slow)."""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import stat
import tempfile
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast, runtime_checkable

from ..errors import (
    DDUFError,
    DDUFFormatError,
    DDUFIntegrityError,
    DDUFIOError,
    DDUFLoadError,
    DDUFPathError,
    DDUFReferenceError,
)
from ..format import spec
from ..format.archive import DDUFArchive, tensor_view
from ..format.json_budget import json_budget_problem, over_size, read_json
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, checked, read_safetensors_header
from ..format.tokenizer_budget import applies as tokenizer_applies
from ..format.tokenizer_budget import tokenizer_problem
from ..format.weights import classify, select_weights, shard_map, tensor_files
from ..sizes import format_size
from ..storage import cache_dirs
from ..storage.cache_dirs import CACHE_ENV
from ..storage.confined import Confined, plain_name
from ..storage.fd_io import open_regular, pread_upto
from ..storage.signed import StatKey

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .prefetch import Prefetcher

logger = logging.getLogger(__name__)

# local_dir copies tokenizer/processor files out of an archive into the cache: a hostile archive must not get
# gigabytes written there under a tokenizer's name (real ones are at most a few tens of MB)
MAX_LOCAL_FILE = 64 << 20


@runtime_checkable
class ComponentFiles(Protocol):
    """The files of one pipeline component, wherever they are stored.

    ``tensors`` returns torch tensors that view the storage where possible (no copy); ``local_dir``
    materialises *small non-weight* files (tokenizers, processors) for libraries that insist on a path."""

    name: str
    description: str  # for messages: "model.dduf:unet", "/path/to/unet"

    def listdir(self) -> list[str]: ...

    def read_bytes(self, filename: str) -> bytes: ...

    def read_json(self, filename: str) -> Any: ...

    def tensors(self, filenames: Sequence[str]) -> Mapping[str, torch.Tensor]: ...

    def local_dir(self, filenames: Iterable[str] | None = None) -> str: ...

    def weight_files(self, variant: str | None = None) -> list[str]: ...


# --- shared helpers ------------------------------------------------------------------------------------
def choose_weight_files(files: ComponentFiles, variant: str | None) -> list[str]:
    """The safetensors files holding ``files``' weights for ``variant``, as diffusers picks them: the
    variant's files if the component has them, else the default ones; for sharded weights, the shards
    the index's ``weight_map`` names (each must be present)."""
    listing = files.listdir()
    selected = select_weights(listing, variant)
    indexes = [f for f in selected if (w := classify(f)) is not None and w.is_index]
    if not indexes:
        return tensor_files(selected)
    shards: set[str] = set()
    for index_name in indexes:
        index = files.read_json(index_name)
        weight_map = shard_map(index)
        if weight_map is None:
            raise DDUFLoadError(f"{files.description}: {index_name} has no valid 'weight_map' (D011)", code="D011")
        shards.update(weight_map.values())
    missing = sorted(shards - set(listing))
    if missing:
        raise DDUFLoadError(
            f"{files.description}: the shard index names {', '.join(missing)}, which is missing "
            f"(has: {', '.join(listing)}); re-pack the component with all its shards (D011)", code="D011"
        )
    return sorted(shards)


def json_from_bytes(raw: bytes, entry: str, where: str) -> Any:
    """``entry`` ("unet/config.json") of ``where`` (the archive or folder) through the one archive JSON reader
    (:func:`~dduf_plus.format.json_budget.read_json`): refused as ``validate`` refuses it, with its code."""
    return read_json(raw, entry, where=where)


def _refuse_over_size(length: int, entry: str, where: str) -> None:
    """A JSON entry over its kind's byte budget is refused (D013) before it is read."""
    why = over_size(length, entry)
    if why is not None:
        raise DDUFFormatError(f"{where}: D013 [{entry}]: {why}", code="D013")


def _check_tokenizer_file(data: bytes, entry: str, where: str) -> None:
    """A tokenizer file (tokenizer.json, vocab.json, merges.txt, a SentencePiece .model, special tokens...)
    within its budget before transformers, tokenizers or sentencepiece see it: the checks ``validate`` runs
    (format/tokenizer_budget.py), refused with the same code (D014, or D013 for JSON over its budget)."""
    found = tokenizer_problem(entry, data)
    if found is not None:
        raise DDUFFormatError(f"{where}: {found[0]} [{entry}]: {found[1]}", code=found[0])


def _check_small_json(data: bytes, entry: str, where: str) -> None:
    """A JSON file handed to a library by path (tokenizers, processors) passes the same budget first (D013)."""
    found = json_budget_problem(data, entry)
    if found is not None:
        raise DDUFFormatError(f"{where}: {found[0]} [{entry}]: {found[1]}", code=found[0])


def _check_name(files: ComponentFiles, filename: str, listing: Sequence[str]) -> None:
    if filename not in listing:
        raise DDUFLoadError(f"{files.description} has no file {filename!r} (has: {', '.join(listing) or 'nothing'})")


class LazyTensors(Mapping):
    """Tensors read on first access with ``os.preadv`` into buffers of their own (the non-mmap path).

    A consumer that takes tensors one at a time (``materialize``) never holds a whole component in
    anonymous memory on the way to a device."""

    def __init__(self, path: str, records: dict[str, tuple[int, TensorInfo]], *, fd: int | None = None):
        self._records = records  # name -> (absolute offset, info)
        # the descriptor whose headers were read (``fd``, duplicated) when there is one: opening ``path`` again
        # would read whatever file has been put there since
        self._fd = os.dup(fd) if fd is not None else os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self._path = path
        weakref.finalize(self, os.close, self._fd)

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, info = self._records[name]
        return pread_tensor(self._fd, offset, info, self._path)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} from the headers, reading no data: lets ``materialize`` plan one device
        allocation and then read tensor by tensor (never the whole component in host memory)."""
        return _specs((name, info) for name, (_offset, info) in self._records.items())


def pread_tensor(fd: int, offset: int, info: TensorInfo, where: str) -> torch.Tensor:
    import torch

    dtype = spec.DTYPE_BY_TORCH[info.dtype]
    torch_dtype = getattr(torch, dtype.torch, None)
    if torch_dtype is None or dtype.bits < 8:
        raise DDUFFormatError(f"tensor {info.name}: dtype {dtype.torch} is not supported by this torch")
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=torch_dtype)
    buffer = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only on Python >= 3.12
    done = 0
    while done < info.nbytes:  # preadv may return short counts (Linux caps one call near 2 GiB)
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except (OSError, OverflowError) as e:  # EIO, ESTALE on a network file system: said, not a traceback
            raise DDUFIOError(f"{where}: cannot read tensor {info.name}: {getattr(e, 'strerror', None) or e}") from None
        if n <= 0:
            raise DDUFError(f"{where}: file ended while reading tensor {info.name}")
        done += n
    return buffer.view(torch_dtype).view(info.shape)


# --- local materialisation of small files -----------------------------------------------------------
def cache_root() -> Path:
    """Where tokenizer/processor files are materialised: ``cache_dir("files")`` (see :mod:`dduf_plus.storage.cache_dirs`)."""
    return cache_dirs.cache_dir("files")


def materialize_files(contents: Mapping[str, bytes]) -> str:
    """A directory holding exactly ``contents`` ({file name: bytes}), shared by every load of the same
    bytes: keyed by the files' sha256 (computed here, never taken from the archive's claims), created
    once, atomically (written in a temporary folder, then renamed).

    An existing folder is used only if it holds exactly these files with exactly these bytes (each one
    re-hashed: they are small, and a file planted or edited there would otherwise reach the tokenizer);
    anything else is replaced, atomically. Every write and removal goes through ``Confined`` (the root)."""
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    digest = hashlib.sha256()
    for name in sorted(contents):
        digest.update(name.encode() + b"\0" + bytes.fromhex(digests[name]))
    key = digest.hexdigest()[:32]
    for where in (cache_root, _private_temp_root):  # the fallback is made only when the cache fails
        root = where()
        if root is None:
            continue
        try:
            box = Confined(root)
            final = box.root / key  # not resolved: a link planted there is replaced below, never followed
            if _complete(final, digests):
                return str(final)
            with box.temp_dir(prefix=f".tmp-{key}-") as tmp:
                for name, data in contents.items():
                    box.write_bytes(box.path(tmp.name, plain_name(name, "tokenizer/processor file")), data)
                try:
                    box.replace(tmp, final)  # a folder only replaces a missing or empty one
                except OSError:  # another process won the race, or a stale or tampered copy is in the way
                    if not _complete(final, digests):
                        if final.is_symlink() or not final.is_dir():
                            box.remove_tree(final)  # a link is removed itself, never followed
                        else:  # moved aside first: a reader sees the old folder or the new one, never half
                            stale = box.path(f".stale-{key}-{uuid.uuid4().hex[:8]}")
                            try:
                                box.replace(final, stale)
                            except OSError:
                                pass  # gone meanwhile
                            box.remove_tree(stale)
                        box.replace(tmp, final)
            if _complete(final, digests):
                return str(final)
        except (OSError, DDUFPathError) as e:
            logger.debug("cannot use the file cache under %s (%s); trying the next location", root, e)
    raise DDUFLoadError(f"cannot write tokenizer/processor files to {cache_root()} (set ${CACHE_ENV})")


def _private_temp_root() -> Path | None:
    """The fallback under the temporary folder, per user; None when someone else owns it or can write
    into it (on a shared /tmp another user could otherwise plant files there)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    root = Path(tempfile.gettempdir()) / (f"dduf_plus-files-{uid}" if uid is not None else "dduf_plus-files")
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return None
    if uid is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022):
        logger.debug("not using %s: not a private folder of this user", root)
        return None
    return root


def _complete(folder: Path, digests: Mapping[str, str]) -> bool:
    """``folder`` is a real folder holding exactly the files of ``digests``, each a regular file whose
    sha256 is the recorded one (an extra file, a link, a FIFO or edited bytes make it incomplete)."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return False
        with os.scandir(folder) as listing:
            names = {e.name for e in listing}
        if names != set(digests):
            return False
        for name, want in digests.items():
            opened = open_regular(folder / name, follow_links=False)  # nor a FIFO block it, nor a link redirect it
            if opened is None:
                return False
            fd = opened[0]
            try:
                h = hashlib.sha256()
                while block := os.read(fd, 1 << 20):
                    h.update(block)
                if h.hexdigest() != want:
                    return False
            finally:
                os.close(fd)
        return True
    except OSError:
        return False


def small_files(files: ComponentFiles, filenames: Iterable[str] | None,
                 size_of: Callable[[str], int] | None = None) -> dict[str, bytes]:
    """The bytes of non-weight files to materialise; each at most MAX_LOCAL_FILE (checked by ``size_of``
    before it is read, where given)."""
    listing = files.listdir()
    wanted = [f for f in listing if not f.endswith(".safetensors")] if filenames is None else list(filenames)
    out = {}
    for name in wanted:
        if name.endswith(".safetensors"):
            raise DDUFLoadError(f"{files.description}: weights ({name}) are never extracted to disk")
        size = size_of(name) if size_of is not None else 0
        if name.endswith(".json"):
            _refuse_over_size(size, f"{files.name}/{name}", files.description)
        if size <= MAX_LOCAL_FILE:
            out[name] = files.read_bytes(name)
            size = len(out[name])
            if name.endswith(".json"):
                _check_small_json(out[name], f"{files.name}/{name}", files.description)
            _check_tokenizer_file(out[name], f"{files.name}/{name}", files.description)
        if size > MAX_LOCAL_FILE:
            raise DDUFLoadError(f"{files.description}: {name} is {size} bytes; a tokenizer/processor file written "
                                f"to the cache may be at most {format_size(MAX_LOCAL_FILE, binary=True)}")
    return out


# --- archive ---------------------------------------------------------------------------------------------
class ArchiveComponentFiles:
    """A component folder inside a :class:`DDUFArchive`.

    ``verify`` checks the CRC-32 of every non-weight entry read (they are small); weight data is not
    hashed on load (that would cost more than the load itself; ``dduf validate --verify`` does it)."""

    def __init__(self, archive: DDUFArchive, component: str, *, use_mmap: bool = True, verify: bool = True,
                 prefetcher: Prefetcher | None = None):
        self.archive = archive
        self.name = component
        self.description = f"{archive.path}:{component}"
        self.use_mmap = use_mmap
        self.verify = verify
        self._prefetcher = prefetcher
        self._files = list(archive.component(component).files)

    def __repr__(self) -> str:
        return f"ArchiveComponentFiles({self.description!r})"

    def listdir(self) -> list[str]:
        return list(self._files)

    def _entry(self, filename: str) -> str:
        _check_name(self, filename, self._files)
        return f"{self.name}/{filename}"

    def read_bytes(self, filename: str) -> bytes:
        entry = self._entry(filename)
        data = self.archive.read_bytes(entry)
        if self.verify:
            record = self.archive.entry(entry)
            if zlib.crc32(data) != record.crc32:
                raise DDUFIntegrityError(f"{self.archive.path}: H001 [{entry}]: does not match its CRC-32 (damaged "
                                         "archive)", code="H001")
            # CRC-32 is forged with 4 bytes: where the index records a sha256, that is what the bytes must match
            if record.sha256 is not None and hashlib.sha256(data).hexdigest() != record.sha256:
                raise DDUFIntegrityError(f"{self.archive.path}: H002 [{entry}]: does not match the sha256 the index "
                                         "records (altered archive)", code="H002")
        return data

    def read_json(self, filename: str) -> Any:
        entry = self._entry(filename)
        _refuse_over_size(self.archive.entry(entry).length, entry, self.archive.path)
        return json_from_bytes(self.read_bytes(filename), entry, self.archive.path)

    def tensor_infos(self, filenames: Sequence[str]) -> dict[str, tuple[int, TensorInfo]]:
        """{tensor name: (absolute offset in the archive, info)}: metadata only, nothing read."""
        out: dict[str, tuple[int, TensorInfo]] = {}
        for filename in filenames:
            entry = self._entry(filename)
            header = self.archive.headers.get(entry)
            if header is None:
                raise DDUFFormatError(f"{self.description}/{filename} is not a readable safetensors file")
            start = self.archive.entry(entry).offset + header.data_start
            for tname, info in header.tensors.items():
                if tname in out:
                    raise DDUFFormatError(f"{self.description}: tensor {tname!r} is stored in two weight files")
                out[tname] = (start + info.begin, info)
        return out

    def tensors(self, filenames: Sequence[str]) -> Mapping[str, torch.Tensor]:
        records = self.tensor_infos(filenames)
        if not self.use_mmap:
            return LazyTensors(self.archive.path, records, fd=self.archive.fd)
        import torch

        self.check_unchanged()
        mm = self.archive.mmap
        return {name: tensor_view(mm, offset, info, torch) for name, (offset, info) in records.items()}

    def check_unchanged(self) -> None:
        """Refuse (:class:`DDUFIOError`) when the archive file is shorter than when it was opened: it was
        truncated or rewritten under the loader. Checked before tensors view the file's mapping and after a
        model is built (``build_component``): touching a mapped page past the new end of the file would
        kill the process with SIGBUS, which Python cannot catch. A truncation between this check and a page
        access cannot be caught at all (docs/security.md, "Truncation while reading"); ``use_mmap=False``
        reads with ``preadv``, where a short read is an error."""
        fd, size = self.archive.fd, self.archive.size  # the archive's own descriptor, its size at open
        if fd is None:
            return
        try:
            now = os.fstat(fd).st_size
        except OSError as e:
            raise DDUFIOError(f"{self.archive.path}: cannot check the file while loading {self.name}: {e}") from None
        if now < size:
            raise DDUFIOError(f"{self.archive.path}: the file shrank from {size} to {now} bytes while {self.name} was "
                              "loading (truncated or replaced); its weights can no longer be read")

    def byte_ranges(self, filenames: Sequence[str]) -> list[tuple[int, int]]:
        """(offset, length) of each file's tensor data in the archive, for read-ahead."""
        out = []
        for filename in filenames:
            entry = self._entry(filename)
            e, header = self.archive.entry(entry), self.archive.headers.get(entry)
            skip = header.data_start if header is not None else 0
            out.append((e.offset + skip, e.length - skip))
        return out

    def prefetch(self, filenames: Sequence[str]) -> None:
        if self._prefetcher is not None:
            self._prefetcher.add(self.byte_ranges(filenames))

    def local_dir(self, filenames: Iterable[str] | None = None) -> str:
        return materialize_files(small_files(self, filenames, lambda f: self.archive.entry(self._entry(f)).length))

    def weight_files(self, variant: str | None = None) -> list[str]:
        return choose_weight_files(self, variant)


# --- plain folder ----------------------------------------------------------------------------------------
class FolderComponentFiles:
    """A diffusers component folder on disk (``pipeline/unet``), weights memory-mapped per file."""

    def __init__(self, path: str | os.PathLike, name: str | None = None, *, use_mmap: bool = True,
                 verified: Mapping[str, StatKey] | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise DDUFLoadError(f"{self.path} is not a component folder")
        self.name = name or self.path.name
        self.description = str(self.path)
        self.use_mmap = use_mmap
        # {file name: its stat when its content was verified} (a folder of shards found in a model folder): a
        # file opened with another stat was replaced since, and is refused rather than read
        self._verified = dict(verified or {})
        self._maps: dict[str, tuple[mmap.mmap | int, SafetensorsHeader]] = {}  # a map, or a descriptor (no mmap)

    def __repr__(self) -> str:
        return f"FolderComponentFiles({self.description!r})"

    def listdir(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if not n.startswith(".") and (self.path / n).is_file())

    def read_bytes(self, filename: str) -> bytes:
        """``filename``'s bytes as long as it was when opened (a file a writer keeps growing is never read
        without end), from the descriptor whose stat is checked."""
        _check_name(self, filename, self.listdir())
        with _open_listed(self.path / filename) as f:
            self._check_verified(filename, f.fileno())
            return f.read(os.fstat(f.fileno()).st_size)

    def _check_verified(self, filename: str, fd: int) -> None:
        key = self._verified.get(filename)
        if key is not None and StatKey.of(os.fstat(fd)) != key:
            raise DDUFReferenceError(f"component {self.name!r}: {os.path.realpath(self.path / filename)} changed since "
                                     "its tensors were verified (search the model folders again: load again)")

    def read_json(self, filename: str) -> Any:
        _check_name(self, filename, self.listdir())
        entry, where = f"{self.name}/{filename}", str(self.path.parent)
        _refuse_over_size(os.stat(self.path / filename).st_size, entry, where)
        data = self.read_bytes(filename)
        _refuse_over_size(len(data), entry, where)  # it grew between the stat and the read
        return json_from_bytes(data, entry, where)

    def _open(self, filename: str) -> tuple[mmap.mmap | int, SafetensorsHeader]:
        if filename not in self._maps:
            _check_name(self, filename, self.listdir())
            where = str(self.path / filename)
            with _open_listed(Path(where)) as f:
                self._check_verified(filename, f.fileno())
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise DDUFFormatError(f"{where} is empty, not a safetensors file")
                handle: mmap.mmap | int
                if self.use_mmap:
                    handle = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                else:  # nothing mapped (network file systems): the header and the tensors read from this descriptor
                    handle = os.dup(f.fileno())
                    weakref.finalize(self, os.close, handle)
            header = checked(*read_safetensors_header(functools.partial(_read_at, handle), 0, size, filename), where)
            self._maps[filename] = (handle, header)
        return self._maps[filename]

    def safetensors_header(self, filename: str) -> SafetensorsHeader:
        """The parsed header of weight file ``filename`` (mapped once, checked as every header is)."""
        return self._open(filename)[1]

    def tensor_infos(self, filenames: Sequence[str]) -> dict[str, tuple[str, int, TensorInfo]]:
        out: dict[str, tuple[str, int, TensorInfo]] = {}
        for filename in filenames:
            _, header = self._open(filename)
            for tname, info in header.tensors.items():
                if tname in out:
                    raise DDUFFormatError(f"{self.description}: tensor {tname!r} is stored in two weight files")
                out[tname] = (filename, header.data_start + info.begin, info)
        return out

    def tensors(self, filenames: Sequence[str]) -> Mapping[str, torch.Tensor]:
        records = self.tensor_infos(filenames)
        if not self.use_mmap:
            readers = {f: LazyTensors(str(self.path / f), {}, fd=cast(int, self._open(f)[0])) for f in filenames}
            return _FolderLazyTensors(readers, records)
        import torch

        return {name: tensor_view(cast(mmap.mmap, self._open(f)[0]), offset, info, torch)
                for name, (f, offset, info) in records.items()}

    def prefetch(self, filenames: Sequence[str]) -> None:
        pass  # per-file maps: the kernel's own read-ahead on sequential faults does well enough

    def local_dir(self, filenames: Iterable[str] | None = None) -> str:
        # already on disk; its JSON files pass the archive JSON budget first, as an archive's would
        names = self.listdir() if filenames is None else list(filenames)
        for name in (n for n in names if n.endswith(".json")):
            entry = f"{self.name}/{name}"
            _refuse_over_size(os.stat(self.path / name).st_size, entry, str(self.path.parent))
            _check_small_json(self.read_bytes(name), entry, str(self.path.parent))
        for name in (n for n in names if tokenizer_applies(n)):  # tokenizer files: their own budgets (D014)
            entry = f"{self.name}/{name}"
            if os.stat(self.path / name).st_size > MAX_LOCAL_FILE:
                raise DDUFFormatError(f"{self.path.parent}: D014 [{entry}]: over {MAX_LOCAL_FILE} bytes", code="D014")
            _check_tokenizer_file(self.read_bytes(name), entry, str(self.path.parent))
        return str(self.path)

    def weight_files(self, variant: str | None = None) -> list[str]:
        return choose_weight_files(self, variant)


def _open_listed(path: Path) -> BinaryIO:
    """A listed folder file opened to read: a FIFO, device or folder put in its place is refused, never waited
    on (:func:`~dduf_plus.storage.fd_io.open_regular`)."""
    opened = open_regular(path)
    if opened is None:
        raise DDUFLoadError(f"{path} is not a regular file (a FIFO, a device or a folder put in its place)")
    return open(opened[0], "rb")


def _read_at(handle: mmap.mmap | int, offset: int, length: int) -> bytes:
    return pread_upto(handle, length, offset) if isinstance(handle, int) else handle[offset : offset + length]


class _FolderLazyTensors(Mapping):
    def __init__(self, readers: dict[str, LazyTensors], records: dict[str, tuple[str, int, TensorInfo]]):
        self._readers, self._records = readers, records

    def __getitem__(self, name: str) -> torch.Tensor:
        filename, offset, info = self._records[name]
        reader = self._readers[filename]
        return pread_tensor(reader._fd, offset, info, reader._path)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """As :meth:`LazyTensors.tensor_specs`."""
        return _specs((name, info) for name, (_filename, _offset, info) in self._records.items())


def _specs(infos: Iterable[tuple[str, TensorInfo]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    import torch

    out = {}
    for name, info in infos:
        dtype = getattr(torch, spec.DTYPE_BY_TORCH[info.dtype].torch, None)
        if dtype is None:
            raise DDUFFormatError(f"tensor {info.name}: dtype {info.dtype} is not supported by this torch")
        out[name] = (tuple(info.shape), dtype)
    return out


def tensor_metadata(files: ComponentFiles, filenames: Sequence[str]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """{tensor name: (torch dtype name, shape, nbytes)} without reading tensor data where the
    implementation allows it (protocol objects without ``tensor_infos`` are asked for their tensors)."""
    infos = getattr(files, "tensor_infos", None)
    if infos is not None:
        return {n: (rec[-1].dtype, rec[-1].shape, rec[-1].nbytes) for n, rec in infos(filenames).items()}
    out = {}
    for name, t in files.tensors(filenames).items():
        out[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
    return out


def resolve_component(
    name: str,
    reference: Mapping[str, Any],
    *,
    refs: Mapping[str, Any] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    verify: bool = True,
    model_dirs: Any = None,
    use_mmap: bool = True,
) -> Any:
    """The referenced component's files as a ``ComponentFiles`` (see :mod:`dduf_plus.loading.files`):
    ``FolderComponentFiles`` over a folder holding exactly the verified files,
    ``ArchiveComponentFiles`` over another ``.dduf``'s component, or ``MappedPartFiles`` over a part of a file
    in an app's model folder (another layout, used in place: :mod:`dduf_plus.loading.in_place`). With
    ``use_mmap=False`` none of them maps a file: tensors are read into buffers of their own, as the archive's.

    Raises:
        DDUFReferenceError: see :func:`locate_component`.
    """
    from ..packing.model_dir_layouts import install
    from ..refs.resolve import locate_component

    install()  # model folders: original layouts and full checkpoints' parts are read too
    located = locate_component(name, reference, refs=refs, local_files_only=local_files_only, token=token,
                               revision=revision, cache_dir=cache_dir, verify=verify, model_dirs=model_dirs)
    if located.archive is not None and located.member is not None:
        return ArchiveComponentFiles(DDUFArchive(located.archive), located.member, use_mmap=use_mmap)
    if located.folder is None:  # pragma: no cover - a Located is a folder or an archive member
        raise DDUFLoadError(f"component {name!r}: {located.source} resolved to neither a folder nor an archive")
    if located.in_place is not None:  # a model-folder part in another layout: views of the user's file
        from .in_place import MappedPartFiles

        return MappedPartFiles(FolderComponentFiles(located.folder, name), name, located.in_place, use_mmap=use_mmap)
    return FolderComponentFiles(located.folder, name, use_mmap=use_mmap, verified=located.keys)
