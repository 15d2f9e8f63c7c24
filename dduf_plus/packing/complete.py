"""``complete``: a partial archive plus its resolved references -> one self-contained archive.

Stored entries are streamed from the partial archive and referenced files from where they resolve, both
byte-identical (except a weights file found by its tensors in an app's model folder: the same tensors in that
file's bytes, said), through the same writer (alignment, order, index, atomic rename). ``model_index.json``
loses ``_dduf_plus_references``; when the partial was packed from a canonical (diffusers-written)
model_index.json, or recorded the original text, the output equals a direct full pack of the same
components byte for byte, whole file included."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import DDUFReferenceError, DDUFValidationError
from ..format import spec
from ..format.archive import DDUFArchive
from ..format.chat_template import INDEX_KEY, TOKENIZER_CONFIG, fold, is_template_name, restore_plan
from ..format.json_budget import parse_json_entry
from ..format.pack import EntrySource, PackResult, read_safetensors_head, write_archive
from ..format.weights import classify
from ..refs import model_dirs, tensor_digest
from ..refs import model_dirs as model_dirs_search  # the module: ``model_dirs`` is a parameter here
from ..refs.resolve import Located, SpecLike, check_ref_names, locate_component, with_files_on_disk
from ..refs.shard_dirs import ShardSet, check_shard_folder
from ..storage.confined import Confined
from ..storage.signed import StatKey, stat_key
from .partial import ORIGINAL_MODEL_INDEX_KEY, canonical_model_index_bytes

logger = logging.getLogger(__name__)

CHUNK = 64 << 20
MODEL_FOLDER = "model folder"  # Located.how of a component found by its tensors in an app's model folder
# index keys build_index derives itself; any other key of a stored component (e.g. a dtype conversion's
# record) is carried over through extra_components
_DERIVED_KEYS = {"library", "class", "files", "summary", "variants", "external"}


def _chunks(archive: DDUFArchive, name: str) -> Iterable[memoryview]:
    view = archive.view(name)
    for at in range(0, len(view), CHUNK):
        yield view[at : at + CHUNK]


def _stream(archive: DDUFArchive, entry: str, name: str | None = None, *, sha: str | None = None) -> EntrySource:
    e = archive.entry(entry)
    return EntrySource(name or entry, size=e.length, chunks=lambda: _chunks(archive, entry),
                       header=archive.headers.get(entry), source_sha256=sha)


def full_model_index(model_index: Mapping[str, Any], partial_bytes: bytes | None = None) -> tuple[dict[str, Any], bytes]:
    """model_index.json without the reference keys, as the original file when it can be restored."""
    stripped = {k: v for k, v in model_index.items() if k not in (spec.REFERENCES_KEY, ORIGINAL_MODEL_INDEX_KEY)}
    original = model_index.get(ORIGINAL_MODEL_INDEX_KEY)
    if isinstance(original, dict) and isinstance(original.get("text"), str):
        raw = original["text"].encode("utf-8")
        # an edited partial must not get the stale original back; budgeted like the archive's own model_index
        same = parse_json_entry(raw, spec.MODEL_INDEX)[0] == stripped
        if same and hashlib.sha256(raw).hexdigest() == original.get("sha256"):
            return stripped, raw
    if partial_bytes is not None and spec.REFERENCES_KEY not in model_index and ORIGINAL_MODEL_INDEX_KEY not in model_index:
        return stripped, partial_bytes  # already complete: keep its bytes
    return stripped, canonical_model_index_bytes(stripped)


def complete_archive(
    partial: str | os.PathLike,
    output: str | os.PathLike,
    *,
    refs: Mapping[str, SpecLike] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    quiet: bool = False,
    model_dirs: Sequence[str | os.PathLike] | None = None,
) -> PackResult:
    """Write ``output``: ``partial`` with every referenced component pulled in, verified by sha256.

    Example:
        >>> complete_archive("finetune.partial.dduf", "finetune.dduf")

    Raises:
        DDUFReferenceError: a reference cannot be resolved or its files do not match (nothing is written).
        DDUFValidationError: ``partial`` is not a valid archive, or one of its chat-template records (carried
            into the output, for unpack to restore) restores a file that may not be written (I002, D013, D014,
            Z005, as ``dduf validate`` reports them).
    """
    started = time.perf_counter()
    with DDUFArchive(partial) as archive:
        restores = restore_plan(archive.stored_index, {n: e.length for n, e in archive.entries.items()},
                                archive.read_bytes)
        if restores.findings:  # the record would be carried over as it is: refused here, not at unpack
            raise DDUFValidationError(str(partial), restores.findings)
        references = archive.references
        check_ref_names(refs, archive.components, references, what="--ref", where=str(partial))  # typos: never ignored
        located = _locate_references(references, refs=refs, local_files_only=local_files_only, token=token,
                                     cache_dir=cache_dir, model_dirs=model_dirs)
        model_index, model_index_bytes = full_model_index(archive.model_index, archive.read_bytes(spec.MODEL_INDEX))
        sources = _stored_sources(archive, references)
        others: list[DDUFArchive] = []  # archives the references resolve into, open while writing
        try:
            for name, loc in located.items():
                sources.extend(_referenced_sources(name, loc, _written_files(references[name]["files"], loc), others))
            extra = _extra_components(archive, references)
            result = write_archive(output, model_index, model_index_bytes, sources, extra_components=extra or None,
                                   quiet=quiet)
        finally:
            for other in others:
                other.close()
    _check_copied(result, references, located, output)
    return result._replace(seconds=time.perf_counter() - started)


def _locate_references(references: Mapping[str, Any], *, refs: Mapping[str, SpecLike] | None,
                       local_files_only: bool, token: str | bool | None,
                       cache_dir: str | os.PathLike | None,
                       model_dirs: Sequence[str | os.PathLike] | None = None) -> dict[str, Located]:
    """Every reference resolved and verified against its recorded files, in name order."""
    from .model_dir_layouts import install

    install()  # model folders: original layouts and full checkpoints' parts are read too
    located: dict[str, Located] = {}
    with model_dirs_search.search_session():  # model folders walked and read once for every reference
        for name in sorted(references):
            ref = references[name]
            if not isinstance(ref, dict) or not ref.get("files"):
                raise DDUFReferenceError(f"component {name!r}: the reference records no files, so there is nothing "
                                         "to verify a copy against; complete it by packing the full pipeline instead")
            # a model-folder part used in place: written here as a file in diffusers' names (the entry is copied
            # from a file); the copy is hashed as it is written, so it is not hashed again
            located[name] = with_files_on_disk(locate_component(
                name, ref, refs=refs, local_files_only=local_files_only, token=token, cache_dir=cache_dir, verify=True,
                model_dirs=model_dirs))
    return located


def _stored_sources(archive: DDUFArchive, references: Mapping[str, Any]) -> list[EntrySource]:
    """The partial's own entries (not model_index.json, the index or referenced components), in archive
    order, each with the source sha256 its index recorded."""
    index_files = archive.index.get("files", {})
    sources: list[EntrySource] = []
    for entry in archive.entries:
        if entry in (spec.MODEL_INDEX, spec.INDEX_NAME) or entry.split("/")[0] in references:
            continue
        rec = index_files.get(entry) if isinstance(index_files, dict) else None
        sha = rec.get("source_sha256") if isinstance(rec, dict) else None
        sources.append(_stream(archive, entry, sha=sha))
    return sources


def _referenced_sources(name: str, loc: Located, files: Iterable[str], others: list[DDUFArchive]) -> list[EntrySource]:
    """Component ``name``'s files from where its reference resolved: a member of another archive (opened
    here and appended to ``others``, which the caller closes) or files on disk."""
    if loc.archive is not None:
        other = DDUFArchive(loc.archive)
        others.append(other)
        return [_stream(other, f"{loc.member}/{fname}", f"{name}/{fname}") for fname in sorted(files)]
    sources = []
    missing = sorted(set(files) - set(loc.files))
    if missing:  # a model folder gives weights and config only
        raise DDUFReferenceError(f"component {name!r}: {loc.source} has no {', '.join(missing)}, which the reference "
                                 "records; complete it from a copy with every file (--ref)")
    templates = {f: loc.files[f] for f in sorted(files) if is_template_name(f)}
    for fname in sorted(files):
        path = loc.files[fname]
        entry = f"{name}/{fname}"
        if fname in templates:
            continue  # folded into tokenizer_config.json below, as pack does
        if fname == TOKENIZER_CONFIG and templates:
            folded = fold(name, path, templates)
            sources.append(EntrySource(entry, data=folded.data, source_sha256=folded.source_sha256, folded=folded))
            continue
        header = read_safetensors_head(path, entry) if fname.endswith(".safetensors") else None
        sources.append(EntrySource(entry, path=path, header=header))
    return sources


def _extra_components(archive: DDUFArchive, references: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Index keys of stored components that build_index does not derive (e.g. a dtype conversion's record)."""
    extra = {n: {k: v for k, v in c.items() if k not in _DERIVED_KEYS}
             for n, c in archive.index.get("components", {}).items()
             if isinstance(c, dict) and n not in references}
    return {n: e for n, e in extra.items() if e}


def _written_files(files: Mapping[str, Any], loc: Located) -> dict[str, str | None]:
    """The files a referenced component is written as, with the sha256 each must have (None: none recorded;
    "": checked by its tensors' digest): the recorded ones; for a sharded component found as one file in a model
    folder, that one file (under the shards' name without their numbers) in place of its shards and index:
    the shards cannot be cut again as they were, their index is not recorded."""
    out = {f: (r.get("sha256") or None if isinstance(r, dict) else None) for f, r in files.items()}
    found = tensor_digest.recorded_weights(files)
    if loc.how != MODEL_FOLDER or found is None or found.shard_index is None:
        return out
    if found.loaded_as in loc.files:
        written = [found.loaded_as]
    else:  # a folder of shards, cut as that folder cuts them (its own shards and index)
        written = [f for f in loc.files if classify(f) is not None]
        if not written or set(written) == {*found.shards, found.shard_index}:
            return out
    for f in (*found.shards, found.shard_index):
        out.pop(f, None)
    return {**out, **dict.fromkeys(written, "")}


def _check_copied(result: PackResult, references: Mapping[str, Any], located: Mapping[str, Located],
                  output: str | os.PathLike) -> None:
    """The writer hashed every byte it copied: a file that changed after it was verified is caught here,
    and the archive this call just wrote is removed. A weights file found by content in a model folder has
    other bytes than the recorded ones by design: it is checked to be unchanged since its tensors were verified
    (their digest is still remembered for it), and the difference is said."""
    written = result.index["files"]
    for name in references:
        folded = result.index["components"].get(name, {}).get(INDEX_KEY, {}).get("files", {})
        for fname, want in _written_files(references[name]["files"], located[name]).items():
            got_rec = folded.get(fname) or written.get(f"{name}/{fname}", {})  # a template: its fold record
            got = got_rec.get("source_sha256") or got_rec.get("sha256")  # folded tokenizer_config: the original's
            if want is None or got == want:
                continue
            why = _by_content(name, fname, located[name], references[name], got)
            if why is None:
                continue
            out = Path(output).absolute()  # a relative path would be taken relative to the Confined root
            Confined(out.parent).unlink(out)
            recorded = want or "as its tensors' digest"
            raise DDUFReferenceError(f"component {name!r}: {fname} from {located[name].source} {why} "
                                     f"(sha256 {got}, recorded {recorded}); nothing was written")


def _shard_folder_now(shard_set: Mapping[str, Path], record: Mapping[str, Any],
                      keys: Mapping[str, StatKey] | None) -> dict[str, Path] | None:
    """The folder of shards found in a model folder, checked again: each file still at the stat it was verified
    at (``keys``: a write while it was copied moves its change time, even with its bytes and mtime put back
    after), the same shards and index, their digest remembered (nothing is hashed again)."""
    try:
        if keys is None or any(stat_key(p) != keys.get(f) for f, p in shard_set.items()):
            return None
    except OSError:
        return None
    found = check_shard_folder(next(iter(shard_set.values())).parent, record)
    return found.files if isinstance(found, ShardSet) else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a shard index: within its JSON budget


def _by_content(name: str, fname: str, loc: Located, reference: Mapping[str, Any], got: str) -> str | None:
    """None when ``fname`` came from a model-folder file whose tensors are the reference's (verified by their
    digest when it was found, and the file unchanged since): said, and accepted with its own bytes. Else why
    the copy is refused."""
    if loc.how != MODEL_FOLDER or classify(fname) is None or fname not in loc.files:
        return "changed while it was copied"
    record = reference.get(tensor_digest.RECORD_KEY)
    digest = record.get("sha256") if isinstance(record, dict) else None
    found = tensor_digest.recorded_weights(reference.get("files") or {})
    shard_set = {f: p for f, p in loc.files.items() if classify(f) is not None}
    if len(shard_set) > 1:  # a folder of shards: still the one verified (its digest remembered), its index too
        now = _shard_folder_now(shard_set, record, loc.keys) if isinstance(record, dict) else None
        if digest is None or now != shard_set or (fname.endswith(".json") and _sha256(loc.files[fname]) != got):
            return "changed after its tensors were verified"
        instead = f" (cut into {len(shard_set) - 1} shards in place of {len(found.shards) if found else '?'})"
    elif digest is None or not fname.endswith(".safetensors") or model_dirs.verified_digest(loc.files[fname]) != digest:
        return "changed after its tensors were verified"
    else:
        instead = (f" (one file in place of its {len(found.shards)} shards and index)"
                   if found is not None and found.shard_index is not None and fname == found.loaded_as else "")
    logger.warning("component %r: %s written from %s%s: the same tensors as the reference (verified by their "
                   "digest) in other bytes than it recorded; the archive's index records their sha256 %s",
                   name, fname, loc.source, instead, got)
    return None
