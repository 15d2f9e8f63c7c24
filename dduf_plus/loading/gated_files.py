"""Loading while the archive is still arriving (``load_dduf(url)``): a component's files whose reads wait for the
entries they read to arrive and match their recorded hashes. A model is constructed (on the meta device, from its
config) while its weights are still arriving, and its tensors view only checked bytes.

The fetch (:class:`dduf_plus.remote.fetch.RemoteFetch`) knows what has arrived and matched; when to wait is the
loader's decision, so the gate lives here, on the loading floor."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .files import ComponentFiles


class Arrivals(Protocol):
    """What a fetch in progress tells the loader (:class:`~dduf_plus.remote.fetch.RemoteFetch`)."""

    verified: bool  # every entry has arrived and matched

    def wait_entries(self, names: list[str] | None = None) -> None: ...

    def wait_component(self, component: str) -> None: ...


class GatedFiles:
    """A component's files over a fetch in progress: configs and tokenizer files are read once their own
    entries have matched, tensors once every entry of the component has; everything else (listings,
    safetensors header metadata) is the wrapped object's."""

    def __init__(self, fetch: Arrivals, component: str, files: ComponentFiles):
        self._fetch, self._component, self._files = fetch, component, files

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)

    def read_bytes(self, filename: str) -> bytes:
        self._fetch.wait_entries([f"{self._component}/{filename}"])
        return self._files.read_bytes(filename)

    def read_json(self, filename: str) -> Any:
        self._fetch.wait_entries([f"{self._component}/{filename}"])
        return self._files.read_json(filename)

    def tensors(self, filenames: Sequence[str]) -> Any:
        self._fetch.wait_component(self._component)
        return self._files.tensors(filenames)

    def local_dir(self, filenames: Iterable[str] | None = None) -> str:
        self._fetch.wait_component(self._component)
        return self._files.local_dir(filenames)


def gate(fetch: Arrivals, component: str, files: ComponentFiles) -> ComponentFiles:
    """``files`` (one component's :class:`~dduf_plus.loading.files.ComponentFiles`) gated on ``fetch``; as they
    are once everything has matched, or for a referenced component (it is not in this archive)."""
    if fetch.verified or not hasattr(files, "archive"):
        return files
    return GatedFiles(fetch, component, files)
