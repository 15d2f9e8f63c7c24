"""Stable rule codes and the :class:`Finding` record that carries one.

The codes are public API: hubs key on them. Never renumber; add new codes at the end of a group."""

from __future__ import annotations

from typing import NamedTuple


class Rule(NamedTuple):
    code: str
    severity: str  # "error" | "warning"
    title: str
    fix: str


_RULES = (
    # ZIP container
    Rule("Z001", "error", "no end-of-central-directory record", "The file is truncated or not a ZIP archive; re-create it."),
    Rule("Z002", "error", "bytes after the end record (or an archive comment)", "Strip trailing data; DDUF archives carry no comment."),
    Rule("Z003", "error", "ZIP64 end records missing, misplaced or inconsistent", "Re-pack with a ZIP64 writer such as `dduf pack`."),
    Rule("Z004", "error", "multi-disk archive", "Join the parts into one file."),
    Rule("Z005", "error", "central directory out of bounds, truncated or with an absurd entry count", "The file is truncated or forged; re-create it."),
    Rule("Z006", "error", "malformed central directory record", "Re-create the archive."),
    Rule("Z007", "error", "entry name is not valid UTF-8, or holds NUL/control characters", "Rename the file with a plain UTF-8 name."),
    Rule("Z008", "error", "entry name is absolute, uses backslashes, or escapes the archive ('..')", "Use relative '/'-separated names inside the archive."),
    Rule("Z009", "error", "duplicate entry name", "Each name may appear once."),
    Rule("Z010", "warning", "names collide after Unicode normalisation or case folding", "Rename one of them: they clash on macOS/Windows file systems."),
    Rule("Z011", "error", "entry is compressed (DDUF requires STORED)", "Re-pack without compression (`dduf pack`)."),
    Rule("Z012", "error", "entry is encrypted", "DDUF entries must be plain."),
    Rule("Z013", "error", "entry is a symbolic link or directory record", "Store regular files only."),
    Rule("Z014", "error", "local header missing or disagrees with the central directory", "The archive was altered after writing; re-create it."),
    Rule("Z015", "error", "entries overlap", "The archive is forged; re-create it."),
    Rule("Z016", "error", "bytes before the first entry or between entries (polyglot or gap)", "Re-create the archive without foreign data."),
    Rule("Z017", "error", "entry data extends past the central directory or the end of the file", "The file is truncated; re-download it."),
    Rule("Z018", "warning", "entry has no ZIP64 extra field", "DDUF asks for ZIP64 on every entry; re-pack with `dduf pack`."),
    Rule("Z019", "error", "compressed and uncompressed sizes differ", "STORED entries have equal sizes; re-create the archive."),
    Rule("Z020", "error", "non-ASCII entry name without the UTF-8 flag (zipfile reads it as CP437)", "Re-pack with a writer that sets the UTF-8 flag (`dduf pack`)."),
    Rule("Z021", "error", "a .zst archive cannot be decompressed (truncated, corrupted or not zstd)", "Re-download or re-create it with `dduf compress` (needs `pip install zstandard`)."),
    Rule("Z022", "error", "a .zst archive would decompress past the size/ratio budget or the free disk space", "Raise the budget (`--max-decompressed`, DDUF_PLUS_MAX_DECOMPRESSED) if the archive is genuine, or free disk space."),
    # DDUF structure
    Rule("D001", "error", "model_index.json missing", "Put the pipeline's model_index.json at the archive root."),
    Rule("D002", "error", "model_index.json is not a JSON object", "Fix the JSON in model_index.json."),
    Rule("D003", "error", "file type not allowed in DDUF", "Only .json, .safetensors, .model and .txt entries are allowed; convert pickles to safetensors."),
    Rule("D004", "error", "entry nested more than one folder deep", "Flatten the component folder."),
    Rule("D005", "error", "folder is not a component named in model_index.json", "Add the component to model_index.json or remove the folder."),
    Rule("D006", "error", "component folder has no config file", "Add config.json, tokenizer_config.json, preprocessor_config.json or scheduler_config.json."),
    Rule("D007", "error", "a JSON entry does not parse", "Fix the JSON."),
    Rule("D008", "warning", "component in model_index.json has neither a folder nor a reference", "Add the component's files or a reference (`dduf pack --ref`)."),
    Rule("D009", "warning", "entry type not accepted by the npm @huggingface/dduf checker (.model)", "Prefer tokenizer.json; the Hub's JS checker rejects .model entries."),
    Rule("D010", "error", "model_index.json is not the first entry", "Re-pack with `dduf pack` (it writes model_index.json first)."),
    Rule("D011", "error", "sharded-weights index names a file that is not in the component folder", "Add the missing shards or fix the index's weight_map."),
    Rule("D012", "error", "component, reference or subfolder name is not a plain name (path separator, '..', control character, not an identifier)", "Use plain names: components are Python identifiers, subfolders one path component."),
    Rule("D013", "error", "a JSON entry is larger or deeper than the cap (model_index.json, configs, the index)", "Keep configs small; see docs/security.md for the caps."),
    # safetensors
    Rule("S001", "error", "safetensors header length runs past the entry or over 100 MB", "The file is truncated or forged."),
    Rule("S002", "error", "safetensors header is not valid JSON object", "Re-save the weights with safetensors."),
    Rule("S003", "error", "unknown tensor dtype", "Use a dtype safetensors defines."),
    Rule("S004", "error", "tensor shape is negative, non-integer or overflows", "Re-save the weights."),
    Rule("S005", "error", "tensor byte span does not match shape x dtype", "Re-save the weights."),
    Rule("S006", "error", "tensor offsets out of bounds, overlapping or leaving holes", "Re-save the weights."),
    Rule("S007", "error", "__metadata__ is not a mapping of strings to strings", "Store only strings in safetensors metadata."),
    Rule("S008", "warning", "tensor data section not page-aligned in the archive (no zero-copy mmap)", "Re-pack with `dduf pack` to align tensor data to 4096 bytes."),
    Rule("S009", "warning", "tensor not aligned to its element size (loader must copy it)", "Re-pack with `dduf pack`."),
    Rule("S010", "error", "safetensors header repeats a key (readers disagree on which one counts)", "Re-save the weights with safetensors."),
    Rule("S011", "error", "more tensors than the cap (per file or per archive)", "Split the weights; see docs/security.md for the caps."),
    # dduf_plus index
    Rule("I001", "error", "dduf_plus index does not parse or has an unknown format", "Re-pack with `dduf pack`."),
    Rule("I002", "error", "dduf_plus index disagrees with the archive entries", "The archive was altered after packing; re-pack it."),
    Rule("I003", "warning", "no dduf_plus index (foreign archive): hashes unknown", "Re-pack with `dduf pack` to record sha256 and tensor offsets."),
    # references
    Rule("R001", "error", "external reference malformed", "Re-pack with `dduf pack --ref`."),
    Rule("R002", "error", "referenced component also stored in the archive", "A component is either stored or referenced, not both."),
    Rule("R003", "warning", "external reference names no source (the loader cannot resolve it by itself)", "Pass the component to `load_dduf` (`refs=` or the component itself), or re-pack with `--ref NAME=SPEC`."),
    # data (only with verify)
    Rule("H001", "error", "CRC-32 mismatch", "The entry's bytes are damaged; re-download the file."),
    Rule("H002", "error", "sha256 mismatch with the dduf_plus index", "The entry's bytes are damaged or were replaced; re-download it."),
    # the validator itself
    Rule("X000", "error", "internal error while checking (a validator bug; the verdict is incomplete)", "Report it to dduf_plus with the file."),
)
RULES: dict[str, Rule] = {rule.code: rule for rule in _RULES}


class Finding(NamedTuple):
    code: str
    entry: str | None
    message: str
    severity: str

    def __str__(self) -> str:
        where = f" [{self.entry}]" if self.entry else ""
        return f"{self.code}{where}: {self.message}"

    def as_dict(self) -> dict:
        return {"code": self.code, "entry": self.entry, "message": self.message}


def finding(code: str, entry: str | None, message: str) -> Finding:
    return Finding(code, entry, message, RULES[code].severity)
