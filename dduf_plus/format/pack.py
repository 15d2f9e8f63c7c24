"""Pack a diffusers pipeline folder (or any list of entry sources) into a DDUF archive."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .._version import __version__
from ..assignments import PackNameError, check_names
from ..errors import DDUFNotFoundError, DDUFPackError, path_argument
from ..storage.progress import progress_bar
from . import spec
from .chat_template import TEMPLATE_DIR, TOKENIZER_CONFIG, Fold, fold, is_template_name, template_files
from .index import build_index
from .json_budget import budget_for
from .pipeline_kinds import COPY_NAME, alias_config, list_parts, part_owner, with_parts
from .safetensors_header import SafetensorsHeader, read_file_header
from .source_folder import (
    ESCAPE_HINT,
    MODEL_INDEX_LIMIT,
    SourceFile,
    boundary_of,
    escape_message,
    is_inside,
    read_entry_file,
    read_source,
    size_problem,
    source_file,
)
from .structure import component_specs, model_index_object
from .weights import classify, select_weights
from .writer import DDUFWriter, check_entry_name

logger = logging.getLogger(__name__)


class FileRegion(NamedTuple):
    """Bytes ``offset .. offset + length`` of the file at ``path``: an entry of an archive being re-packed
    (``dduf pack IN.dduf``), copied from where it is, never extracted. ``crc32`` and ``sha256`` are what
    that archive records for the entry: the writer checks the bytes it copies against them (H001, H002)."""

    path: Path
    offset: int
    length: int
    member: str  # the entry's name in that archive (messages, the verified-hash memory)
    crc32: int | None = None
    sha256: str | None = None

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), self.length, self.offset)
        if len(data) != self.length:
            raise DDUFPackError(f"{self.path}: entry {self.member!r} ends past the end of the file (it changed)")
        return data

    def __str__(self) -> str:
        return f"{self.path}#{self.member}"


class EntrySource(NamedTuple):
    """One entry to write: a file copied unchanged, a region of a file (an archive's entry) copied unchanged,
    bytes, or a stream of ``size`` bytes."""

    name: str
    path: Path | None = None
    data: bytes | None = None
    size: int = 0
    chunks: Callable[[], Iterable[Any]] | None = None
    header: SafetensorsHeader | None = None  # parsed safetensors header, for the index
    source_sha256: str | None = None  # sha256 of the original when the bytes were transformed
    folded: Fold | None = None  # tokenizer_config.json with chat templates folded in (format/chat_template.py)
    region: FileRegion | None = None  # an entry of another archive, copied from there unchanged
    # ``path`` is the file's real path, checked inside its folder's boundary when planned (plan_component): the
    # writer opens it without following links, so a link put in its place since (leading out) is refused
    real: bool = False

    @property
    def nbytes(self) -> int:
        if self.path is not None:
            return self.path.stat().st_size
        if self.region is not None:
            return self.region.length
        return len(self.data) if self.data is not None else self.size

    @property
    def file(self) -> Path | FileRegion | None:
        """Where the unchanged bytes are: a whole file, or a region of one (None for bytes and streams)."""
        return self.path if self.path is not None else self.region

    def read_bytes(self) -> bytes:
        """The entry's bytes (for small entries: configs, indexes)."""
        if self.path is not None:  # bounded by its kind's budget, never blocking (a FIFO put in its place)
            return read_entry_file(self.path, self.name, follow_links=not self.real)
        if self.region is not None:
            return self.region.read_bytes()
        if self.data is not None:
            return self.data
        assert self.chunks is not None
        return b"".join(bytes(c) for c in self.chunks())


LocalFile = Path | FileRegion  # a component's file on this machine: a whole file, or an entry of an archive


def file_size(file: Path | FileRegion) -> int:
    """Bytes of a whole file or of a region of one."""
    return file.length if isinstance(file, FileRegion) else file.stat().st_size


class Skipped(NamedTuple):
    path: str
    reason: str


class PackResult(NamedTuple):
    path: Path
    bytes_written: int
    entries: int
    seconds: float
    skipped: list[Skipped]
    index: dict[str, Any]  # type: ignore[assignment]  # public field name since 0.1; shadows tuple.index


class FolderPlan(NamedTuple):
    model_index: dict[str, Any]
    model_index_bytes: bytes
    sources: list[EntrySource]  # without model_index.json
    skipped: list[Skipped]
    folder: Path
    # An archive's plan (``dduf pack IN.dduf``): every component's entries, excluded ones included, as regions
    # of the archive (its local copies, which a folder plan finds in its folders). None for a folder.
    held: dict[str, list[EntrySource]] | None = None


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def plan_folder(folder: str | os.PathLike, *, variant: str | None = None, exclude: Sequence[str] = (),
                unsaved: Callable[[Mapping[str, Any], str], str | None] | None = None) -> FolderPlan:
    """Decide which files of a diffusers folder go into the archive, and why the others don't.

    A list component's further folders (``controlnet_1``... of a Multi-ControlNet) are stored and named in
    the archive's model_index.json (:mod:`~dduf_plus.format.pipeline_kinds`). ``unsaved(model_index, name)``
    says why a component named in model_index.json may have no folder (diffusers' from_pretrained does not
    load it from one: the packing layer asks diffusers), or None: then its missing folder is refused.

    Raises:
        DDUFNotFoundError: ``folder`` does not exist (also a FileNotFoundError).
        DDUFPackError: something DDUF cannot hold (sub-folder in a component, pickle-only weights,
            a non-UTF-8 name, a component without its folder or config, a broken safetensors file).
    """
    root = Path(folder)
    mi_path = root / spec.MODEL_INDEX
    if not root.exists():
        raise DDUFNotFoundError(f"{root} does not exist", str(root))
    if not root.is_dir():
        raise DDUFPackError(f"{root} is not a folder (a diffusers pipeline folder holds model_index.json)")
    boundary = boundary_of(root)
    raw = _read_model_index(mi_path, boundary)
    model_index = model_index_object(raw, str(mi_path), DDUFPackError)
    specs = component_specs(model_index)
    check_names(exclude, specs, what="--exclude", where=str(mi_path), error=PackNameError)

    sources: list[EntrySource] = []
    skipped: list[Skipped] = []
    parts = list_parts(model_index, [n for n in os.listdir(root) if (root / n).is_dir()])
    further = {part for names in parts.values() for part in names[1:]}
    for name in sorted(os.listdir(root)):
        path = root / name
        if name == spec.MODEL_INDEX:
            continue
        _check_utf8(name, root)
        if path.is_dir():
            if _is_hidden(name):
                skipped.append(Skipped(name + "/", "hidden folder"))
            elif name not in specs and name not in further:
                skipped.append(Skipped(name + "/", "folder is not a component of model_index.json"))
            elif name in specs and specs[name][0] is None:
                skipped.append(Skipped(name + "/", "component is null in model_index.json"))
            elif name in exclude or (name in further and part_owner(model_index, name) in exclude):
                skipped.append(Skipped(name + "/", "excluded"))
            else:
                comp_sources, comp_skipped = plan_component(root, name, variant, boundary=boundary)
                sources.extend(comp_sources)
                skipped.extend(comp_skipped)
        else:
            skipped.append(Skipped(name, "only model_index.json is packed at the root"))
    _check_variant(variant, sources, skipped, root)
    check_entry_count(len(sources), root)
    stored = {s.name.split("/")[0] for s in sources}
    for name, (library, _cls) in specs.items():
        if library is not None and name not in stored and name not in exclude:
            why = unsaved(model_index, name) if unsaved is not None else None
            if why is None:
                raise DDUFPackError(f"component {name!r} is named in model_index.json but {root / name} is missing "
                                    f"(exclude it with --exclude {name} and give a --ref)")
            logger.info("%s: not stored: %s", name, why)
            skipped.append(Skipped(name + "/", f"named in model_index.json, not saved: {why}"))
    named = with_parts(model_index, {k: [p for p in v if p in stored] for k, v in parts.items() if k in stored})
    if named is not None:  # the further list parts named, so that every DDUF reader accepts their folders
        model_index, raw = named
        for owner, names in parts.items():
            logger.info("%s: a list of %d (%s); model_index.json names each part", owner, len(names), ", ".join(names))
    return FolderPlan(model_index, raw, sources, skipped, root)


def check_entry_count(files: int, where: Path) -> None:
    """Refuse ``files`` files (+ model_index.json and the index) over the archive entry cap now (Z005), not after
    copying them all into an archive the final check refuses."""
    if files + 2 > spec.MAX_ENTRIES:
        raise DDUFPackError(f"{where}: Z005 {files + 2} entries is more than the {spec.MAX_ENTRIES} a DDUF archive "
                            "may hold (DDUF readers refuse it)")


def _read_model_index(mi_path: Path, boundary: Path) -> bytes:
    """model_index.json's bytes: inside the folder (Z008), a regular file, at most its D013 budget (a sparse
    10 GB one is refused from its size, and read bounded even if it grows after the stat)."""
    if not os.path.lexists(mi_path):
        raise DDUFPackError(f"{mi_path.parent}: no model_index.json (is this a diffusers pipeline folder?)")
    checked = _checked_small(mi_path, boundary, spec.MODEL_INDEX)
    return read_source(checked.real, mi_path, MODEL_INDEX_LIMIT, "D013", follow_links=False)


def _checked_small(path: Path, boundary: Path, entry: str) -> SourceFile:
    """``path`` checked before a byte of it is read (inside ``boundary``, a regular file: :func:`source_file`)
    and, stored as or folded into ``entry``, within that entry's budget from its size (D013, D014)."""
    checked = source_file(path, boundary)
    why = size_problem(entry, checked.size)
    if why is not None:
        raise DDUFPackError(f"{path}: {why}")
    return checked


def check_output(output: str | os.PathLike, plan: FolderPlan) -> None:
    """Refuse an output that is one of the files being packed: ``-o FOLDER/vae/config.json --force`` (or
    ``-o FOLDER/model_index.json``) would replace a source of the archive with the archive, losing it.

    Raises:
        DDUFPackError: naming the output and what to do.
    """
    out = Path(output).absolute()
    replaced = Path(os.path.realpath(out.parent)) / out.name  # the name the rename replaces (a link: itself)
    mine = [plan.folder / spec.MODEL_INDEX] + [s.path for s in plan.sources if s.path is not None]
    for path in mine:
        if replaced in (Path(os.path.realpath(path)), Path(os.path.realpath(path.absolute().parent)) / path.name):
            raise DDUFPackError(f"{output}: is {path}, a file of the folder being packed; writing the archive there "
                                "would lose it (choose another output)")


def _check_variant(variant: str | None, sources: Sequence[EntrySource], skipped: Sequence[Skipped], root: Path) -> None:
    """``variant`` must be some component's, as the loader requires (it refuses such an archive)."""
    if not variant:
        return
    if any((w := classify(s.name.rsplit("/", 1)[-1])) and w.variant == variant for s in sources):
        return
    present = sorted({w.variant for item in skipped if (w := classify(item.path.rsplit("/", 1)[-1])) and w.variant})
    raise DDUFPackError(f"--variant {variant}: no component of {root} has weights of variant {variant!r} "
                        f"(variants present: {', '.join(present) or 'none'}; pack without --variant for the default)")


def _check_utf8(name: str, where: Path) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise DDUFPackError(f"{where / shown}: Z007 file name is not valid UTF-8; rename it") from None


def plan_component(root: Path, component: str, variant: str | None, *,
                   boundary: Path | None = None) -> tuple[list[EntrySource], list[Skipped]]:
    """The entries of ``root/component`` and what is left out, why. Only files inside ``boundary`` (the folder's,
    :func:`~dduf_plus.format.source_folder.boundary_of` by default) are read, only regular ones, small ones within
    their budgets: each refused before a byte of it is read (:func:`_checked_sources`)."""
    folder = root / component
    boundary = boundary if boundary is not None else boundary_of(root)
    real_folder = Path(os.path.realpath(folder))
    if not is_inside(real_folder, boundary):  # the component folder itself is a link leading out
        raise DDUFPackError(f"{folder}/: Z008 {escape_message(real_folder, boundary, ESCAPE_HINT)}")
    names = sorted(os.listdir(folder))
    skipped: list[Skipped] = []
    candidates: list[str] = []
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    for name in names:
        rel = f"{component}/{name}"
        _check_utf8(name, folder)
        if _is_hidden(name):
            skipped.append(Skipped(rel, "hidden file"))
        elif name == TEMPLATE_DIR or is_template_name(name):
            continue  # chat templates: folded into tokenizer_config.json below
        elif (folder / name).is_dir():
            raise DDUFPackError(f"{folder / name}: DDUF allows no sub-folders inside a component folder")
        elif name.endswith(spec.PICKLE_EXTENSIONS):
            if not has_safetensors:
                raise DDUFPackError(f"{folder / name}: pickle weights are not allowed in DDUF and {component!r} has no "
                                    "safetensors weights; convert it (e.g. save_pretrained(safe_serialization=True))")
            skipped.append(Skipped(rel, "pickle weights (safetensors present)"))
        elif not name.endswith(spec.ALLOWED_EXTENSIONS):
            skipped.append(Skipped(rel, "file type not allowed in DDUF"))
        else:
            candidates.append(name)
    weights = set(select_weights(candidates, variant))
    classified = [w for w in map(classify, weights) if w]
    if variant and classified and not any(w.variant == variant for w in classified):
        # only components that have weights: a scheduler or tokenizer never has a variant
        logger.info("%s: no %s variant, using the default weights", component, variant)
    chosen = []
    for name in candidates:
        if classify(name) is not None and name not in weights:
            skipped.append(Skipped(f"{component}/{name}", "weights of another variant"))
        else:
            chosen.append(name)
    alias = alias_config(chosen)
    copy = alias is not None and COPY_NAME not in chosen  # guider_config.json: DDUF readers need a config.json
    if not copy and not any(n in spec.CONFIG_FILES for n in chosen):
        raise DDUFPackError(f"{folder}: component folder has no config file (one of {', '.join(spec.CONFIG_FILES)})")
    chosen, left_out = _fast_tokenizer_covers(chosen)
    skipped.extend(Skipped(f"{component}/{n}", why) for n, why in left_out)
    check_entry_count(len(chosen), folder)  # before any file is checked: a million files cost no million stats
    sources = _checked_sources(component, folder, chosen, boundary)
    if copy and alias is not None:
        sources.append(EntrySource(f"{component}/{COPY_NAME}", data=_alias_bytes(component, folder / alias, boundary)))
    sources, fold_skipped = fold_sources(component, folder, sources, boundary=boundary)
    return sources, skipped + fold_skipped


def _checked_sources(component: str, folder: Path, chosen: Sequence[str], boundary: Path) -> list[EntrySource]:
    """An entry per chosen file, each checked before it is read: inside ``boundary`` (Z008), a regular file
    (a FIFO would block the writer for ever), a small file within its budget from its size (D013, D014: a sparse
    10 GB tokenizer.json is never copied), a safetensors file by its header. The real path is stored (the
    writer opens it without following links)."""
    sources = []
    for name in chosen:
        entry = f"{component}/{name}"
        check_entry_name(entry)
        checked = _checked_small(folder / name, boundary, entry)
        header = read_safetensors_head(checked.real, entry) if name.endswith(".safetensors") else None
        sources.append(EntrySource(entry, path=checked.real, header=header, real=True))
    return sources


def _alias_bytes(component: str, alias: Path, boundary: Path) -> bytes:
    """The bytes of ``guider_config.json`` (checked by :func:`_checked_sources`) for its ``config.json`` copy,
    read bounded by the copy's budget (D013)."""
    checked = _checked_small(alias, boundary, f"{component}/{COPY_NAME}")
    return read_source(checked.real, alias, budget_for(f"{component}/{COPY_NAME}").bytes, "D013", follow_links=False)


def _fast_tokenizer_covers(chosen: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """A sentencepiece ``.model`` beside ``tokenizer.json`` is left out: the fast tokenizer holds the same
    vocabulary, and the npm checker (so ``--strict``) refuses ``.model`` (D009). Alone, it is kept
    (the tokenizer needs it) and the writer's check warns."""
    if "tokenizer.json" not in chosen:
        return chosen, []
    models = [n for n in chosen if n.endswith(".model")]
    return ([n for n in chosen if n not in models],
            [(n, "sentencepiece model: tokenizer.json (the fast tokenizer) covers it, and the npm checker "
                 "refuses .model (D009)") for n in models])


def fold_sources(component: str, folder: Path, sources: list[EntrySource], *,
                 boundary: Path | None = None) -> tuple[list[EntrySource], list[Skipped]]:
    """Chat template files of ``folder`` folded into its tokenizer_config.json entry (see
    :mod:`dduf_plus.format.chat_template`); without a tokenizer_config.json they are left out, said so. Each
    template is checked as a stored file is (inside ``boundary``, regular, within the budget of the config it
    is folded into: D013) before it is read."""
    templates = template_files(folder)
    if templates and boundary is not None:
        templates = {rel: _checked_template(component, path, boundary) for rel, path in templates.items()}
    if not templates:
        return sources, []
    entry = f"{component}/{TOKENIZER_CONFIG}"
    if not any(s.name == entry for s in sources):
        logger.warning("%s: chat template not stored: no tokenizer_config.json to fold it into", component)
        return sources, [Skipped(f"{component}/{rel}", "chat template: no tokenizer_config.json to fold it into")
                         for rel in templates]
    config = next(s.path for s in sources if s.name == entry)
    folded = fold(component, config if config is not None else folder / TOKENIZER_CONFIG, templates)
    out = [s if s.name != entry else EntrySource(entry, data=folded.data, source_sha256=folded.source_sha256,
                                                 folded=folded) for s in sources]
    return out, [Skipped(f"{component}/{rel}", "folded into tokenizer_config.json's chat_template")
                 for rel in templates]


def _checked_template(component: str, path: Path, boundary: Path) -> Path:
    """The real path of a chat template file, checked: inside ``boundary``, regular, within the budget of the
    tokenizer_config.json it is folded into (D013)."""
    return _checked_small(path, boundary, f"{component}/{TOKENIZER_CONFIG}").real


def read_safetensors_head(path: Path, entry: str) -> SafetensorsHeader:
    return read_file_header(path, entry, DDUFPackError)


HASH_AHEAD_FILES = 64  # the largest files are hashed ahead; the rest (small) as they are copied


def write_archive(
    output: str | os.PathLike,
    model_index: Mapping[str, Any],
    model_index_bytes: bytes,
    sources: Sequence[EntrySource],
    *,
    skipped: Sequence[Skipped] = (),
    references: Mapping[str, Any] | None = None,
    extra_components: Mapping[str, Mapping[str, Any]] | None = None,
    quiet: bool = False,
    fsync: bool = True,
    check: bool = True,
) -> PackResult:
    """Write model_index.json, then ``sources`` in a stable order, then the dduf_plus index.
    ``fsync=False`` skips flushing to disk before the atomic rename (see :class:`DDUFWriter`).
    The finished archive is validated before it appears (:func:`check_written`); ``check=False`` writes it
    even if ``dduf validate`` would refuse it (test archives for the loader's own refusals)."""
    started = time.perf_counter()
    ordered = sorted(sources, key=lambda s: s.name)
    extra_components = _with_fold_records(extra_components, ordered)
    total = len(model_index_bytes) + sum(s.nbytes for s in ordered)
    headers: dict[str, SafetensorsHeader] = {}
    bar = progress_bar(total, Path(output).name, quiet)
    try:
        checker = (lambda tmp: check_written(tmp, output)) if check else None
        with DDUFWriter(output, progress=bar.update, fsync=fsync, check=checker,
                        no_follow=[s.name for s in ordered if s.real]) as writer:
            files = sorted((s for s in ordered if s.path is not None), key=lambda s: -s.nbytes)
            writer.hash_ahead([(s.name, s.path) for s in files[:HASH_AHEAD_FILES] if s.path is not None])  # bounded: open descriptors
            writer.add_bytes(spec.MODEL_INDEX, model_index_bytes)
            bar.update(len(model_index_bytes))
            for source in ordered:
                if source.path is not None:
                    writer.add_file(source.name, source.path)
                elif source.region is not None:
                    r = source.region
                    writer.add_region(source.name, r.path, r.offset, r.length, crc32=r.crc32, sha256=r.sha256)
                elif source.data is not None:
                    writer.add_bytes(source.name, source.data, source_sha256=source.source_sha256)
                    bar.update(len(source.data))
                else:
                    assert source.chunks is not None
                    writer.add_chunks(source.name, source.size, source.chunks(), source_sha256=source.source_sha256)
                if source.header is not None:
                    headers[source.name] = source.header
            index = build_index(model_index, writer.records, headers, created_by=f"dduf_plus {__version__}",
                                references=references, extra_components=extra_components)
            if len(model_index_bytes) <= 64 << 10:  # its exact text: a remote open answers from the tail alone
                index["model_index_json"] = model_index_bytes.decode("utf-8", "surrogateescape")  # (remote/indexed.py)
            writer.add_bytes(spec.INDEX_NAME, json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
            entries = len(writer.records)
    finally:
        bar.close()
    size = Path(output).stat().st_size
    for item in skipped:  # debug: callers report result.skipped themselves (`dduf pack` prints it once)
        logger.debug("skipped %s: %s", item.path, item.reason)
    return PackResult(Path(output), size, entries, time.perf_counter() - started, list(skipped), index)


def _with_fold_records(extra: Mapping[str, Mapping[str, Any]] | None,
                       sources: Sequence[EntrySource]) -> Mapping[str, Mapping[str, Any]] | None:
    """``extra`` plus the index record of every folded chat template (:mod:`.chat_template`)."""
    from .chat_template import INDEX_KEY

    folds = {s.name.split("/")[0]: s.folded.record for s in sources if s.folded is not None}
    if not folds:
        return extra
    merged = {name: dict(record) for name, record in (extra or {}).items()}
    for name, record in folds.items():
        merged.setdefault(name, {})[INDEX_KEY] = record
    return merged


def check_written(tmp: Path, output: str | os.PathLike) -> None:
    """Every structural rule, run on the finished temporary file before it is renamed into place: pack never
    publishes an archive ``dduf validate`` refuses. Warnings are logged (``--strict`` would refuse them).

    Raises:
        DDUFPackError: naming each error's rule code and entry; nothing is written.
    """
    from .validate import validate

    report = validate(tmp)
    for f in report.warnings:
        if f.code == "R004":  # the packer said it once per path, with what to do (packing.partial.warn_local_paths)
            continue
        logger.warning("%s: %s %s: %s", output, f.code, f.entry or "archive", f.message)
    if report.errors:
        listed = "; ".join(f"{f.code} {f.entry or 'archive'}: {f.message}" for f in report.errors[:5])
        more = f" (and {len(report.errors) - 5} more)" if len(report.errors) > 5 else ""
        raise DDUFPackError(f"not writing {output}: dduf validate would refuse it: {listed}{more}")


def pack_folder(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    variant: str | None = None,
    quiet: bool = False,
    fsync: bool = True,
    check: bool = True,
) -> PackResult:
    """Pack a diffusers pipeline folder into ``output`` (entries byte-identical to the source files).
    ``check=False``: see :func:`write_archive`.

    Example:
        >>> result = pack_folder("stable-diffusion-v1-5", "sd15.dduf", variant="fp16")
        >>> result.skipped  # README.md, images, .gitattributes, other variants...

    Raises:
        DDUFPackError: the folder holds something DDUF cannot (see :func:`plan_folder`).
    """
    folder, output = path_argument(folder, "pack_folder(folder=...)"), path_argument(output, "pack_folder(output=...)")
    plan = plan_folder(folder, variant=variant)
    check_output(output, plan)
    return write_archive(output, plan.model_index, plan.model_index_bytes, plan.sources, skipped=plan.skipped, quiet=quiet,
                         fsync=fsync, check=check)
