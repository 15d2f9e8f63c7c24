"""materialize(): zero copy on CPU, tensor-by-tensor conversion, the streaming (pinned ring) path run
synchronously on the CPU, and the real CUDA path where a GPU exists; prefetch()."""

from __future__ import annotations

import gc
import mmap
import weakref
from collections.abc import Iterator, Mapping

import pytest
import torch

from dduf_plus.format.archive import DDUFArchive
from dduf_plus.loading.transfer import (
    VIEW_ALIGNMENT,
    _Job,
    _stream,
    _SyncCopier,
    _windows,
    component_ranges,
    materialize,
    prefetch,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(1000, generator=g),
        "w16": torch.randn(3, 5, generator=g).half(),
        "empty": torch.empty(0, 4),
        "ids": torch.randint(0, 100, (77,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "wbf": torch.randn(4097, generator=g).bfloat16(),
        "mask": torch.rand(33, generator=g) > 0.5,
        "big": torch.randn(70, 130, generator=g),
    }


def _rule(name: str, t: torch.Tensor) -> torch.dtype | None:
    return {"w32": torch.float16, "wbf": torch.float32, "scalar": torch.bfloat16, "big": torch.bfloat16}.get(name)


def _expected(tensors: Mapping[str, torch.Tensor], rule) -> dict[str, torch.Tensor]:
    return {k: v.to(rule(k, v) or v.dtype) for k, v in tensors.items()}


# --- CPU ---------------------------------------------------------------------------------------------
def test_cpu_same_dtype_returns_the_archive_views(packed):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        tensors = archive.tensors("unet")
        out = materialize(tensors, device="cpu", dtype_for=lambda n, t: None)
        assert list(out) == list(tensors)
        assert all(out[k] is tensors[k] for k in tensors)
        base = torch.frombuffer(archive.mmap, dtype=torch.uint8).data_ptr()
        for t in out.values():  # inside the file mapping: no copy was made
            assert base <= t.data_ptr() < base + len(archive.mmap)
        # a rule answering the tensor's own dtype is "unchanged" too
        same = materialize(tensors, device=torch.device("cpu"), dtype_for=lambda n, t: t.dtype)
        assert all(same[k] is tensors[k] for k in tensors)


@pytest.mark.parametrize(("src", "dst"), [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                          (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.bfloat16)])
def test_cpu_conversion_matches_to(src, dst):
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": (torch.randn(17, 9, generator=g) * 100).to(src) for i in range(4)}
    out = materialize(tensors, device="cpu", dtype_for=lambda n, t: dst)
    for k, v in tensors.items():
        assert out[k].dtype == dst
        assert torch.equal(out[k], v.to(dst))


class _LazySources(Mapping):
    """Creates each source tensor on access (as a loader reading from disk would), remembering it weakly."""

    def __init__(self, n: int):
        self.names = [f"layer{i}" for i in range(n)]
        self.created: list[weakref.ref] = []
        self.log: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        self.log.append(f"get {name}")
        t = torch.full((256, 256), float(self.names.index(name)))
        self.created.append(weakref.ref(t))
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def test_cpu_conversion_goes_tensor_by_tensor():
    sources = _LazySources(6)
    alive_at_call: list[int] = []

    def rule(name: str, t: torch.Tensor) -> torch.dtype:
        sources.log.append(f"dtype {name}")
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in sources.created))
        return torch.float16

    out = materialize(sources, device="cpu", dtype_for=rule)
    # read one, decide, convert; then the next: never all sources first
    assert sources.log == [s for n in sources.names for s in (f"get {n}", f"dtype {n}")]
    # when deciding tensor k, the fp32 sources of tensors < k are gone: one full-precision tensor at a time
    assert alive_at_call == [1] * len(sources)
    assert [out[n][0, 0].item() for n in sources.names] == list(range(6))


def test_other_devices_fall_back_to_to():
    tensors = _mixed()
    out = materialize(tensors, device="meta", dtype_for=_rule)
    assert all(out[k].device.type == "meta" and out[k].dtype == (_rule(k, v) or v.dtype) for k, v in tensors.items())


# --- the streaming path, synchronously on the CPU ----------------------------------------------------
@pytest.mark.parametrize("chunk", [VIEW_ALIGNMENT, 512, 4096, 1 << 20])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_stream_path_values_and_single_allocation(chunk, buffers):
    tensors = _mixed()
    out = _stream(tensors, torch.device("cpu"), _rule, chunk, buffers, _SyncCopier())
    assert list(out) == list(tensors)
    expected = _expected(tensors, _rule)
    for k, v in expected.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k], v), k
    storages = {t.untyped_storage().data_ptr() for t in out.values() if t.numel()}
    assert len(storages) == 1  # one flat buffer for the whole component
    for t in out.values():
        if t.numel():
            assert (t.data_ptr() - next(iter(storages))) % VIEW_ALIGNMENT == 0


def test_stream_path_without_conversion_and_empty_inputs():
    tensors = _mixed()
    out = _stream(tensors, torch.device("cpu"), lambda n, t: None, 1024, 3, _SyncCopier())
    assert all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in tensors.items())
    assert _stream({}, torch.device("cpu"), lambda n, t: None, 1024, 3, _SyncCopier()) == {}
    only_empty = _stream({"e": torch.empty(0)}, torch.device("cpu"), lambda n, t: None, 1024, 3, _SyncCopier())
    assert only_empty["e"].shape == (0,)


def test_stream_path_handles_non_contiguous_sources():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    out = _stream({"t": t}, torch.device("cpu"), lambda n, x: torch.float16, 256, 2, _SyncCopier())
    assert torch.equal(out["t"], t.half())


class _DescribedSources(_LazySources):
    """A lazy mapping that can describe its tensors without reading them (like the loader's pread one)."""

    def __init__(self, n: int, dtype: torch.dtype):
        super().__init__(n)
        self.dtype = dtype
        self.max_alive = 0

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: ((256, 256), self.dtype) for n in self.names}

    def __getitem__(self, name: str) -> torch.Tensor:
        gc.collect()
        self.max_alive = max(self.max_alive, sum(r() is not None for r in self.created))
        return super().__getitem__(name).to(self.dtype)


@pytest.mark.parametrize("target", [None, torch.float16])
def test_stream_path_reads_described_sources_lazily(target):
    sources = _DescribedSources(8, torch.float32)
    seen: list[str] = []

    def rule(name: str, t: torch.Tensor) -> torch.dtype | None:
        seen.append(t.device.type)
        return target

    out = _stream(sources, torch.device("cpu"), rule, 64 << 10, 3, _SyncCopier())
    assert set(seen) == {"meta"}  # planning read nothing
    assert sources.log == [f"get {n}" for n in sources.names]  # each read once, in order
    assert sources.max_alive <= 1  # 256 KiB tensors, 64 KiB windows: one source at a time
    for i, n in enumerate(sources.names):
        assert out[n].dtype == (target or torch.float32) and torch.equal(out[n], torch.full((256, 256), float(i)).to(out[n].dtype))


def test_windows_cover_every_byte_once():
    sizes = [10, 300, 0, 1024, 7, 5000, 256]
    jobs, offset = [], 0
    for i, n in enumerate(sizes):
        jobs.append(_Job(f"t{i}", torch.Size([n]), n, torch.uint8, torch.uint8, offset, offset))
        offset = (offset + n + VIEW_ALIGNMENT - 1) // VIEW_ALIGNMENT * VIEW_ALIGNMENT
    covered = {j.name: 0 for j in jobs}
    for start, length, pieces in _windows(jobs, 512):
        assert start % 512 == 0 and 0 < length <= 512
        for p in pieces:
            assert p.begin % 8 == 0  # every piece starts on an element boundary of any dtype
            assert 0 <= p.window_offset and p.window_offset + p.end - p.begin <= length
            assert p.job.stream_offset + p.begin == start + p.window_offset
            covered[p.job.name] += p.end - p.begin
    assert covered == {j.name: j.nbytes for j in jobs}


def test_num_buffers_must_be_positive():
    with pytest.raises(ValueError):
        _stream(_mixed(), torch.device("cpu"), _rule, 1024, 0, _SyncCopier())


# --- prefetch ----------------------------------------------------------------------------------------
def test_prefetch_archive_ranges(packed):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        ranges = component_ranges(archive, "unet")
        assert len(ranges) == 2  # the fixture's unet is sharded
        for (offset, length), name in zip(ranges, archive.weight_files("unet"), strict=True):
            header = archive.headers[name]
            assert offset % 4096 == 0  # page-aligned tensor data
            assert length == sum(t.nbytes for t in header.tensors.values())
        assert prefetch(archive, ranges) >= sum(n for _, n in ranges)
        assert prefetch(archive.mmap, populate=True) == len(archive.mmap)
        assert prefetch(archive, [(len(archive.mmap) + 10, 5)]) == 0  # out of range: nothing, no error


def test_prefetch_plain_mmap(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 3 * mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert prefetch(mm, [(mmap.PAGESIZE + 1, 10)]) == 1 + 10  # from the start of its page


# --- CUDA --------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("chunk", [4096, 1 << 20, 32 << 20])
def test_cuda_matches_to_device(chunk):
    tensors = _mixed()
    out = materialize(tensors, device="cuda", dtype_for=_rule, chunk_bytes=chunk)
    # no explicit synchronize: results must be usable on the current stream right away
    for k, v in tensors.items():
        expected = v.to("cuda").to(_rule(k, v) or v.dtype)
        assert out[k].device.type == "cuda" and out[k].dtype == expected.dtype and out[k].shape == expected.shape
        assert torch.equal(out[k], expected), k
    storages = {t.untyped_storage().data_ptr() for t in out.values() if t.numel()}
    assert len(storages) == 1


@cuda
def test_cuda_archive_component(packed):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        tensors = archive.tensors("unet")
        out = materialize(tensors, device=torch.device("cuda", 0), dtype_for=lambda n, t: torch.float32,
                          chunk_bytes=64 << 10)
        torch.cuda.synchronize()
        for k, v in tensors.items():
            assert torch.equal(out[k].cpu(), v.float())


# --- the loader's pread-backed mappings describe themselves (no full host copy on the way to a device) ---
@pytest.mark.parametrize("where", ["archive", "folder"])
def test_pread_tensors_are_described_and_streamed_lazily(packed, monkeypatch, where):
    from conftest import PIPELINES
    from dduf_plus.loading import files as files_mod
    from dduf_plus.loading.files import ArchiveComponentFiles, FolderComponentFiles

    if where == "archive":
        archive = DDUFArchive(packed["tiny-sd"])
        component = ArchiveComponentFiles(archive, "unet", use_mmap=False)
    else:
        component = FolderComponentFiles(PIPELINES / "tiny-sd" / "unet", use_mmap=False)
    lazy = component.tensors(component.weight_files())
    reads: list[int] = []
    real = files_mod.pread_tensor
    monkeypatch.setattr(files_mod, "pread_tensor", lambda *a: (reads.append(1), real(*a))[1])
    specs = lazy.tensor_specs()
    assert reads == []  # described from the headers alone
    assert list(specs) == list(lazy)
    reference = FolderComponentFiles(PIPELINES / "tiny-sd" / "unet").tensors(component.weight_files())
    for name, (shape, dtype) in specs.items():
        assert shape == tuple(reference[name].shape) and dtype == reference[name].dtype, name
    out = _stream(lazy, torch.device("cpu"), lambda n, t: torch.float32, 64 << 10, 3, _SyncCopier())
    assert len(reads) == len(specs)  # each tensor read once, while streaming
    for name, t in out.items():
        assert torch.equal(t, reference[name].float()), name
