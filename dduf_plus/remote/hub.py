"""DDUF archives and pipeline folders on the Hugging Face Hub, through huggingface_hub and its cache.

- :func:`hub_archive`: the ``.dduf`` file of a repo, downloaded with ``hf_hub_download`` (its progress bars,
  tokens, ``HF_HUB_OFFLINE``, resumable downloads, its cache) and returned as a local path to map;
- :func:`hub_folder_for_pack`: only the files ``dduf pack`` will store of a diffusers repo (the components
  model_index.json names, their configs and tokenizer files, the chosen variant's safetensors weights),
  through ``snapshot_download`` with allow patterns.

Both work offline from the cache (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``: no request at all).
huggingface_hub is imported when called, never at import: this floor starts fast and imports no torch."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFPackError, DDUFUsageError
from ..format import spec
from ..format.chat_template import is_template_name
from ..format.json_budget import read_json
from ..format.weights import classify, select_weights
from ..storage.cache_dirs import hf_hub_cache
from ..storage.hub_env import is_offline

logger = logging.getLogger("dduf_plus.remote.hub")

T = TypeVar("T")
DDUF_SUFFIXES = (".dduf", ".dduf.zst")
MAX_MODEL_INDEX_BYTES = 256 << 10  # the same budget `dduf validate` applies to model_index.json (D013)
# Tokenizer and processor files a component keeps besides its config (the types DDUF allows).
_KEEP_EXTENSIONS = spec.ALLOWED_EXTENSIONS


class HubSourceNotFoundError(DDUFNotFoundError, DDUFPackError):
    """A Hub source of ``dduf pack`` (``--base``, ``--ref``) that is neither in the cache nor reachable: an I/O
    error (exit 2), as for a Hub SOURCE, and a :class:`DDUFPackError` for callers of ``pack()``."""


class HubFileNotFoundError(DDUFNotFoundError):
    """The Hub answered: the repo exists and has no such file at that revision (not: offline, not cached)."""


def is_repo_id(text: str, *, namespaced: bool = True) -> bool:
    """Whether ``text`` is a Hub repo id, as huggingface_hub's ``validate_repo_id`` decides, and no file or path
    (no ``.dduf`` suffix, no leading ``.``, ``/`` or ``~``; no ``@`` revision, see :func:`split_revision`).

    ``namespaced`` (the default) asks for ``org/name``: where a bare word could as well be a local path (a
    command's SOURCE, ``load_dduf("name")``). A reference SPEC (``--ref vae=gpt2``) passes ``namespaced=False``:
    the Hub's legacy ids without an owner are repo ids there.

        >>> is_repo_id("org/name"), is_repo_id("gpt2"), is_repo_id("gpt2", namespaced=False), is_repo_id("a/b.dduf")
        (True, False, True, False)
    """
    if (namespaced and text.count("/") != 1) or text.endswith(DDUF_SUFFIXES) or text.startswith((".", "/", "~")):
        return False
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # pragma: no cover - a dependency
        return bool(re.fullmatch(r"(?:[\w.\-]+/)?[\w.\-]+", text))
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_repo_of(source: str | os.PathLike) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``source`` names a Hub repo (``org/name[@revision]``) and no local path, else None.

    The one answer to "is this a Hub repo?" for every command and loader: an existing path always wins (as in
    ``from_pretrained``), and so does a missing one under an existing folder (``models/x`` with ``./models``
    here is a mistyped path, not the repo ``models/x``).

        >>> hub_repo_of("stabilityai/stable-diffusion-2@main"), hub_repo_of("./weights.dduf")
        (('stabilityai/stable-diffusion-2', 'main'), None)
    """
    text = os.fspath(source)
    if os.path.exists(text):
        return None
    repo, revision = split_revision(text)
    if not is_repo_id(repo) or os.path.isdir(repo.split("/", 1)[0]):
        return None
    return repo, revision


def split_revision(source: str) -> tuple[str, str | None]:
    """``org/repo@rev`` -> (``org/repo``, ``rev``); no ``@``: (source, None)."""
    repo, sep, rev = source.partition("@")
    return (repo, rev) if sep and rev else (source, None)




def cache_only(local_files_only: bool) -> bool:
    """Work from the cache only: asked to (``local_files_only``, ``HF_HUB_OFFLINE``), or the Hub cannot be
    reached (:func:`hub_unreachable`), so huggingface_hub's retries (5, about 23 s) are never spent."""
    return is_offline(local_files_only) or hub_unreachable() is not None


def _offline_reason(local_files_only: bool) -> str:
    """Why nothing is downloaded, and how to allow it: the setting that is in effect, named."""
    if local_files_only:
        return "offline: local_files_only=True (local_files_only=False lets it download)"
    if is_offline(local_files_only):
        return "offline mode: HF_HUB_OFFLINE is set (unset it, or HF_HUB_OFFLINE=0, to let it download)"
    return f"the Hub cannot be reached ({hub_unreachable()}): download it once online"


PROBE_ENV = "DDUF_PLUS_HUB_PROBE"  # "0": never probe (huggingface_hub alone decides, with its retries)
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 5.0  # one connect; a Hub that does not accept one in 5 s would not serve a download either
PROBE_TTL = 30.0  # a long-running process (dduf serve) asks again after this
_probes: dict[str, tuple[float, str | None]] = {}


def hub_unreachable() -> str | None:
    """Why the Hub endpoint (``HF_ENDPOINT``) cannot be reached now, from one TCP connect (DNS failure,
    refused, no answer within :data:`PROBE_SECONDS`); None when it can, or when a proxy is configured (the
    probe would not go through it) or ``$DDUF_PLUS_HUB_PROBE=0``: then huggingface_hub is left to try.
    Remembered for :data:`PROBE_TTL` seconds."""
    import socket
    import time
    from urllib.parse import urlsplit

    if any(os.environ.get(var) for var in _PROXY_VARS) or os.environ.get(PROBE_ENV, "").strip() == "0":
        return None
    from huggingface_hub import constants

    endpoint = str(constants.ENDPOINT)
    now = time.monotonic()
    known = _probes.get(endpoint)
    if known is not None and now - known[0] < PROBE_TTL:
        return known[1]
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number: huggingface_hub will say so
        return None
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            why = None
    except socket.gaierror as e:
        why = f"cannot resolve host {host!r} (DNS: {e.strerror or e})"
    except ConnectionRefusedError:
        why = f"connection refused by {host}:{port}"
    except TimeoutError:
        why = f"no answer from {host} within {PROBE_SECONDS:g} s"
    except OSError as e:
        why = f"{host}:{port}: {e.strerror or e}"
    _probes[endpoint] = (now, why)
    if why is not None:
        logger.info("the Hub (%s) cannot be reached: %s; using the Hugging Face cache only", endpoint, why)
    return why


def _check_args(repo_id: str, revision: str | None) -> None:
    """Refuse what is no repo id or revision before it reaches a URL or a cache path."""
    from ..format.references import revision_problem

    if not is_repo_id(repo_id):
        raise DDUFUsageError(f"{repo_id!r} is neither a local path nor a Hub repo id (org/name)")
    if revision is not None and (why := revision_problem(revision)) is not None:
        raise DDUFUsageError(f"{repo_id}: {why}")


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id + (f"@{revision}" if revision else "")


def _hub_call(what: str, repo_id: str, revision: str | None, call: Callable[[], T], *, filename: str | None = None,
              offline: str = "") -> T:
    """Run a huggingface_hub call; its errors become DDUFErrors that name the repo, revision and file.
    ``offline``: why the call works from the cache only (:func:`_offline_reason`), "" when it may go online."""
    from huggingface_hub import errors as hf_errors

    where = _where(repo_id, revision)
    try:
        return call()
    except hf_errors.RevisionNotFoundError:
        raise DDUFNotFoundError(f"{what}: the Hub repo {repo_id} has no revision {revision!r}", where) from None
    except hf_errors.GatedRepoError:
        raise DDUFIOError(f"{what}: {repo_id} is gated: accept its terms on the Hub and pass token= "
                          "(or run `hf auth login`)") from None
    except hf_errors.RepositoryNotFoundError:
        raise DDUFNotFoundError(f"{what}: no Hub repo {repo_id} (or it is private: pass token= or run "
                                f"`hf auth login`){_no_local(repo_id)}", repo_id) from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        # (a subclass of EntryNotFoundError: caught first) not cached, and offline or the Hub unreachable
        if offline:
            raise DDUFNotFoundError(f"{what}: {filename or 'the files'} of the Hub repo {where} not in the Hugging "
                                    f"Face cache and {offline}{_no_local(repo_id)}", filename) from None
        raise DDUFNotFoundError(f"{what}: {filename or where} of the Hub repo {where} is not in the Hugging Face "
                                f"cache and the Hub cannot be reached ({_first_line(e)}){_no_local(repo_id)}",
                                filename) from None
    except hf_errors.EntryNotFoundError:  # the repo has no such file at that revision
        raise HubFileNotFoundError(f"{what}: {where} has no file {filename}", filename) from None
    except hf_errors.HfHubHTTPError as e:
        raise DDUFIOError(f"{what}: the Hub answered for {where}: {_first_line(e)}") from None
    except DDUFError:
        raise
    except Exception as e:  # connection errors (the HTTP client's own classes), disk full, an unwritable cache
        raise DDUFIOError(f"{what}: {where}: {type(e).__name__}: {_first_line(e)}") from None


@contextlib.contextmanager
def _bars(quiet: bool | None) -> Iterator[None]:
    """huggingface_hub's progress bars only on a terminal, never with ``quiet`` (restored afterwards)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hide = quiet if quiet is not None else not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    if not hide or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _no_local(repo_id: str) -> str:
    return "" if os.path.exists(repo_id) else f"; no local path {repo_id} either"


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


# --- listing -----------------------------------------------------------------------------------------------
def _snapshot(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> Path | None:
    """The cached snapshot folder of repo_id at revision (a branch or tag through refs/, or a commit)."""
    cache = Path(cache_dir).expanduser() if cache_dir else _default_cache()
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev
    ref = storage / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
    snap = storage / "snapshots" / commit
    return snap if commit and "/" not in commit and snap.is_dir() else None


def _default_cache() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return hf_hub_cache()


def list_repo_files(repo_id: str, *, revision: str | None = None, token: str | bool | None = None,
                    cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> list[str]:
    """The files of a repo: from the Hub (one ``model_info`` call), or offline from the cached snapshot
    (what has been downloaded of it)."""
    if cache_only(local_files_only):
        snap = _snapshot(repo_id, revision, cache_dir)
        if snap is None:
            raise DDUFNotFoundError(f"the Hub repo {_where(repo_id, revision)} is not in the Hugging Face cache and "
                                    f"{_offline_reason(local_files_only)}"
                                    f"{_no_local(repo_id)}", repo_id)
        return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    from huggingface_hub import HfApi

    info = _hub_call("listing", repo_id, revision,
                     lambda: HfApi().model_info(repo_id, revision=revision, token=token))
    return sorted(s.rfilename for s in info.siblings or [])


# --- archives ------------------------------------------------------------------------------------------------
def hub_archive(repo_id: str, dduf_file: str | None = None, *, revision: str | None = None,
                token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                local_files_only: bool = False, quiet: bool | None = None) -> Path:
    """The local path of ``dduf_file`` of the Hub repo ``repo_id`` (downloaded into the Hugging Face cache
    if not there yet; a link into the cache's content-named blobs, which is what the loader maps).

    With ``dduf_file=None`` the repo must hold exactly one ``.dduf`` (or ``.dduf.zst``) file.

    Raises:
        DDUFNotFoundError: no such repo, revision or file; offline and not cached.
        DDUFUsageError: ``dduf_file`` not given and the repo holds zero or several archives (listed).
        DDUFIOError: the Hub cannot be reached or refuses (gated, private without a token).
    """
    _check_args(repo_id, revision)
    if dduf_file is None:
        files = list_repo_files(repo_id, revision=revision, token=token, cache_dir=cache_dir,
                                local_files_only=local_files_only)
        archives = [f for f in files if f.endswith(DDUF_SUFFIXES)]
        if len(archives) != 1:
            where = _where(repo_id, revision)
            if not archives:
                cached = " cached" if cache_only(local_files_only) else ""
                raise DDUFUsageError(f"{where} holds no{cached} .dduf file ({len(files)} files: "
                                     f"{', '.join(files[:8])}{', ...' if len(files) > 8 else ''}); "
                                     "is it a diffusers folder? `dduf pack " + where + " -o X.dduf` packs it")
            raise DDUFUsageError(f"{where} holds {len(archives)} .dduf files: {', '.join(archives)}; "
                                 f"choose one: load_dduf({repo_id!r}, dduf_file={archives[0]!r})")
        dduf_file = archives[0]
    if not dduf_file.endswith(DDUF_SUFFIXES):
        raise DDUFUsageError(f"dduf_file={dduf_file!r}: not a .dduf file name")
    from huggingface_hub import hf_hub_download

    offline = cache_only(local_files_only)
    why = _offline_reason(local_files_only) if offline else ""
    with _bars(quiet):  # quiet=None: bars on a terminal only
        path = _hub_call(f"{repo_id}/{dduf_file}", repo_id, revision, lambda: hf_hub_download(
            repo_id, dduf_file, revision=revision, token=token, cache_dir=_as_path(cache_dir),
            local_files_only=offline), filename=dduf_file, offline=why)
    logger.info("%s/%s: %s", _where(repo_id, revision), dduf_file, path)
    return Path(path)


# --- folders for `dduf pack` --------------------------------------------------------------------------------
def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _components(model_index: Any) -> list[str]:
    if not isinstance(model_index, dict):
        return []
    return sorted(k for k, v in model_index.items() if not k.startswith("_") and isinstance(v, (list, tuple))
                  and len(v) == 2 and v[0] is not None and v[1] is not None and "/" not in k and k not in (".", ".."))


def pack_selection(files: Sequence[str], components: Sequence[str], variant: str | None) -> list[str]:
    """The repo files ``dduf pack`` stores: model_index.json and, per component, its files of the types
    DDUF allows (configs, tokenizer files, safetensors weights of ``variant``, else the default ones);
    never pickles (``.bin``), READMEs, images, onnx or flax weights, nor files of sub-folders."""
    chosen = [spec.MODEL_INDEX]
    for comp in components:
        prefix = comp + "/"
        names = [f[len(prefix):] for f in files if f.startswith(prefix) and "/" not in f[len(prefix):]]
        allowed = [n for n in names if n.endswith(_KEEP_EXTENSIONS) and not n.startswith(".")]
        if any(n.endswith(spec.PICKLE_EXTENSIONS) for n in names) and not any(n.endswith(".safetensors") for n in allowed):
            raise DDUFPackError(f"{comp}: only pickle weights ({', '.join(n for n in names if n.endswith(spec.PICKLE_EXTENSIONS))}); "
                                "DDUF stores safetensors only: convert them first")
        weights = set(select_weights(allowed, variant))
        chosen += [prefix + n for n in sorted(allowed) if classify(n) is None or n in weights]
        # chat templates: pack folds them into tokenizer_config.json (format/chat_template.py)
        chosen += sorted(f for f in files if f.startswith(prefix) and is_template_name(f[len(prefix):]))
    return chosen


def hub_folder_for_pack(repo_id: str, *, revision: str | None = None, variant: str | None = None,
                        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                        local_files_only: bool = False, quiet: bool | None = None) -> Path:
    """The snapshot folder of a diffusers repo holding (at least) the files ``dduf pack`` will store, which
    are the only ones downloaded: model_index.json first, then :func:`pack_selection` of the listing.

    Raises:
        DDUFNotFoundError: no such repo / revision, no model_index.json, offline and not cached.
        DDUFIOError: the Hub cannot be reached or refuses.
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    _check_args(repo_id, revision)
    offline = cache_only(local_files_only)
    why = _offline_reason(local_files_only) if offline else ""
    where = _where(repo_id, revision)
    try:
        mi_path = Path(_hub_call(where, repo_id, revision, lambda: hf_hub_download(
            repo_id, spec.MODEL_INDEX, revision=revision, token=token, cache_dir=_as_path(cache_dir),
            local_files_only=offline), filename=spec.MODEL_INDEX, offline=why))
    except HubFileNotFoundError:
        if offline:
            raise
        archives = [f for f in list_repo_files(repo_id, revision=revision, token=token) if f.endswith(DDUF_SUFFIXES)]
        if not archives:
            raise
        raise DDUFNotFoundError(f"{where} is no diffusers folder (no model_index.json); it holds "
                                f"{', '.join(archives)}: load it with load_dduf({repo_id!r}, dduf_file="
                                f"{archives[0]!r}), or download it", spec.MODEL_INDEX) from None
    if mi_path.stat().st_size > MAX_MODEL_INDEX_BYTES:
        raise DDUFIOError(f"{where}: model_index.json is {mi_path.stat().st_size} bytes "
                          f"(at most {MAX_MODEL_INDEX_BYTES}); not a diffusers pipeline")
    model_index = read_json(mi_path.read_bytes(), spec.MODEL_INDEX, where=where)  # D013/D007 budgets, as archives
    components = _components(model_index)
    if offline:
        snap = mi_path.parent  # the snapshot model_index.json was found in
        files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file() or p.is_symlink())
    else:
        files = list_repo_files(repo_id, revision=revision, token=token, cache_dir=cache_dir)
    wanted = pack_selection(files, components, variant)
    logger.info("%s: %d of %d files are packed (%s)", where, len(wanted), len(files), ", ".join(components))
    with _bars(quiet):
        folder = _hub_call(where, repo_id, revision, lambda: snapshot_download(
            repo_id, revision=revision, token=token, cache_dir=_as_path(cache_dir), local_files_only=offline,
            allow_patterns=[_glob_escape(f) for f in wanted]), offline=why)
    return Path(folder)


__all__ = ["cache_only", "hub_archive", "hub_folder_for_pack", "hub_repo_of", "is_repo_id", "list_repo_files", "pack_selection", "split_revision"]


def _as_path(folder: str | os.PathLike | None) -> Path | None:
    """diffusers' ``cache_dir`` (str or PathLike) as huggingface_hub's functions declare it."""
    return Path(folder) if folder is not None else None
