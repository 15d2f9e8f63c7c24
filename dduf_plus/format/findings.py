"""Stable rule codes and the :class:`Finding` record that carries one.

The codes are public API: hubs key on them. Never renumber; add new codes at the end of a group."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple


class Rule(NamedTuple):
    """One rule. ``title`` is its one-line name; the rest is what docs/validation.md's table shows
    (generated from this data by :func:`rules_markdown`, checked by tests/test_rules_doc.py)."""

    code: str
    severity: str  # "error" | "warning" | "info" (what each means: SEVERITIES)
    title: str
    checked_by: str  # "open" (DDUFArchive on open and validate), "validate", "verify", or a mix in words
    meaning: str
    why: str
    fix: str


_RULES = (
    # ZIP container
    Rule("Z001", "error", "no end-of-central-directory record",
         checked_by="open",
         meaning="no end-of-central-directory record in the last 64 KiB (or the file is under 22 bytes); the message names what the file is when its first bytes say so (a single-file safetensors checkpoint, GGUF, pickle, JSON, an HTML page, a Git LFS pointer, zstd, empty, a truncated ZIP)",
         why="the file is truncated or is not a ZIP archive at all: nothing in it can be located",
         fix="re-download or re-create it; a single-file checkpoint is no archive: load it with diffusers (`from_single_file`) and `save_dduf`, or pack a pipeline folder with `dduf pack`"),
    Rule("Z002", "error", "bytes after the end record (or an archive comment)",
         checked_by="open",
         meaning="bytes after the end record, or an archive comment",
         why="trailing data is how polyglots (a file that is also HTML, a script, a second archive) are made; DDUF writers never write a comment",
         fix="strip the trailing data; re-pack with `dduf pack`"),
    Rule("Z003", "error", "ZIP64 end records missing, misplaced or inconsistent",
         checked_by="open",
         meaning="ZIP64 end records missing, misplaced or disagreeing with the classic end record",
         why="readers fall back to 16/32-bit values and see a different archive, or none",
         fix="re-pack with a ZIP64 writer (`dduf pack`)"),
    Rule("Z004", "error", "multi-disk archive",
         checked_by="open",
         meaning="multi-disk (split) archive",
         why="DDUF is one file; split archives are not read consistently",
         fix="join the parts"),
    Rule("Z005", "error", "central directory out of bounds, truncated or with an absurd entry count",
         checked_by="open",
         meaning="central directory out of bounds or truncated, or more entries than DDUF allows (> 10,000: pipelines hold a few dozen)",
         why="forged counts and sizes are how readers are made to allocate gigabytes or read past the file",
         fix="re-create the archive"),
    Rule("Z006", "error", "malformed central directory record",
         checked_by="open",
         meaning="malformed central directory record (bad signature, malformed extra field)",
         why="the directory cannot be trusted past this point",
         fix="re-create the archive"),
    Rule("Z007", "error", "entry name is not valid UTF-8, or holds NUL/control characters",
         checked_by="open",
         meaning="entry name not UTF-8, or holding NUL/control characters, or over 1024 bytes",
         why="NUL truncates names in C readers; escape sequences inject into terminals; undecodable names differ per reader",
         fix="rename the file with a plain UTF-8 name"),
    Rule("Z008", "error", "entry name is absolute, uses backslashes, or escapes the archive ('..')",
         checked_by="open",
         meaning="entry name absolute, with backslashes, a drive letter, or empty/`.`/`..` segments",
         why="path traversal: extracting it writes outside the target folder",
         fix="use relative `/`-separated names"),
    Rule("Z009", "error", "duplicate entry name",
         checked_by="open",
         meaning="the same name twice",
         why="readers pick different copies (first vs last), so what was validated is not what is loaded",
         fix="keep one entry per name"),
    Rule("Z010", "warning", "names collide after Unicode normalisation or case folding",
         checked_by="open",
         meaning="two names equal after NFC normalisation and case folding",
         why="they overwrite each other when extracted on macOS/Windows",
         fix="rename one of them"),
    Rule("Z011", "error", "entry is compressed (DDUF requires STORED)",
         checked_by="open",
         meaning="entry compressed (method ≠ 0, STORED)",
         why="DDUF entries are memory-mapped; compressed data cannot be",
         fix="re-pack without compression (`dduf pack`)"),
    Rule("Z012", "error", "entry is encrypted",
         checked_by="open",
         meaning="entry has an encryption flag",
         why="encrypted data cannot be mapped or checked",
         fix="store it plain"),
    Rule("Z013", "error", "entry is a symbolic link or directory record",
         checked_by="open",
         meaning="entry is a symbolic link or a directory record",
         why="a symlink extracted to disk can point anywhere (classic extraction attack)",
         fix="store regular files only"),
    Rule("Z014", "error", "local header missing or disagrees with the central directory",
         checked_by="open",
         meaning="local header missing, or disagreeing with the central directory on name, CRC-32, sizes, method or flags",
         why="streaming readers use the local header, others the directory: two readers, two archives",
         fix="re-create the archive"),
    Rule("Z015", "error", "entries overlap",
         checked_by="open",
         meaning="entries overlap",
         why="two names for the same bytes (overlap \"zip bombs\", content smuggled under a second name)",
         fix="re-create the archive"),
    Rule("Z016", "error", "bytes before the first entry or between entries (polyglot or gap)",
         checked_by="open",
         meaning="bytes before the first entry, between entries, or between the central directory and the end records",
         why="polyglot prefixes (self-extracting scripts, other formats) and hidden payloads live in gaps",
         fix="re-create the archive without foreign data"),
    Rule("Z017", "error", "entry data extends past the central directory or the end of the file",
         checked_by="open",
         meaning="an entry's data runs into the central directory or past the end of the file",
         why="truncated download or forged sizes; such an entry is never read",
         fix="re-download the file"),
    Rule("Z018", "info", "entry has no ZIP64 extra field",
         checked_by="open",
         meaning="entry without a ZIP64 extra field",
         why="the DDUF spec asks for ZIP64 on every entry; some readers assume it",
         fix="re-pack with `dduf pack`"),
    Rule("Z019", "error", "compressed and uncompressed sizes differ",
         checked_by="open",
         meaning="compressed and uncompressed sizes differ on a STORED entry",
         why="readers disagree on where the entry ends",
         fix="re-create the archive"),
    Rule("Z020", "error", "non-ASCII entry name without the UTF-8 flag (zipfile reads it as CP437)",
         checked_by="open",
         meaning="non-ASCII name without the UTF-8 flag (bit 11)",
         why="Python's `zipfile` (so `huggingface_hub`) decodes it as CP437: `café.txt` becomes `cafÃ©.txt`, a different name than other readers see",
         fix="re-pack with a writer that sets the flag (`dduf pack`)"),
    Rule("Z021", "error", "a .zst archive cannot be decompressed (truncated, corrupted or not zstd)",
         checked_by="validate (`.zst` files)",
         meaning="a `.dduf.zst` cannot be decompressed: truncated, a frame's checksum or size wrong, seek table inconsistent, not zstd at all, or `zstandard` not installed",
         why="no archive can be recovered from it, so nothing inside can be checked or loaded",
         fix="re-download it, or re-create it with `dduf compress`; `pip install zstandard` if the message says so"),
    Rule("Z022", "error", "a .zst archive would decompress past the size/ratio budget or the free disk space",
         checked_by="validate (`.zst` files)",
         meaning="a `.dduf.zst` would decompress past the budget (default: 256 GiB, and 16x its compressed size above 256 MiB) or past the free disk space (keeping 256 MiB spare); checked before anything is written when the stream announces its size (header frame, seek table, frame headers), else where decoding passes the budget",
         why="65 KB of zstd can hold 2 GiB of zeros: every upload a checker decompresses can fill its disk",
         fix="if the archive is genuine (weights that compress far better than the usual 1.1x), raise the budget: `--max-decompressed SIZE` (`64G`, `32x`, `64G,32x`, `unlimited`), `DDUF_PLUS_MAX_DECOMPRESSED`, `validate(..., max_decompressed=...)`; or free disk space"),
    # DDUF structure
    Rule("D001", "error", "model_index.json missing",
         checked_by="open",
         meaning="no `model_index.json` (a `torch.save` ZIP, `.pt`/`.ckpt`, is named as such: one D001, no finding per pickle entry)",
         why="not a pipeline: nothing says which components exist",
         fix="add the pipeline's `model_index.json` at the root"),
    Rule("D002", "error", "model_index.json is not a JSON object",
         checked_by="open",
         meaning="`model_index.json` does not parse or is not a JSON object",
         why="no loader can read the pipeline",
         fix="fix the JSON"),
    Rule("D003", "error", "file type not allowed in DDUF",
         checked_by="open",
         meaning="file type not allowed (only `.json`, `.safetensors`, `.model`, `.txt`)",
         why="pickles (`.bin`, `.pt`, `.ckpt`...) execute code when loaded",
         fix="convert weights to safetensors"),
    Rule("D004", "error", "entry nested more than one folder deep",
         checked_by="open",
         meaning="entry nested more than one folder deep",
         why="the DDUF spec allows one folder level",
         fix="flatten the component folder"),
    Rule("D005", "error", "folder is not a component named in model_index.json",
         checked_by="open",
         meaning="a folder that `model_index.json` does not name",
         why="unreferenced content that no loader uses but that ships anyway",
         fix="add the component or remove the folder"),
    Rule("D006", "error", "component folder has no config file",
         checked_by="open",
         meaning="a component folder without `config.json`, `tokenizer_config.json`, `preprocessor_config.json` or `scheduler_config.json`",
         why="the component cannot be built",
         fix="add its config"),
    Rule("D007", "error", "a JSON entry does not parse",
         checked_by="validate (open for `model_index.json` and the index size)",
         meaning="a JSON entry does not parse as UTF-8 JSON (a BOM, UTF-16 or UTF-32 text, a string holding half "
                 "a UTF-16 surrogate pair such as `\\udc80`), or a component config is not an object",
         why="the loader fails at load time instead of at upload time; a lone surrogate is kept by Python's "
             "`json` until something encodes it, and refused by Rust readers (`tokenizers`, serde_json)",
         fix="fix the JSON"),
    Rule("D008", "warning", "component in model_index.json has neither a folder nor a reference",
         checked_by="open",
         meaning="a component named in `model_index.json` has neither a folder nor a reference",
         why="the pipeline will not load without that component from elsewhere",
         fix="add its files, or a reference (`dduf pack --ref`)"),
    Rule("D009", "warning", "entry type not accepted by the npm @huggingface/dduf checker (.model)",
         checked_by="open",
         meaning="a `.model` entry (e.g. SentencePiece)",
         why="valid DDUF, but the npm `@huggingface/dduf` checker (0.0.2) rejects it",
         fix="prefer `tokenizer.json` if the Hub's checker must accept it"),
    Rule("D010", "error", "model_index.json is not the first entry",
         checked_by="open",
         meaning="`model_index.json` is not the first entry",
         why="the DDUF spec puts it first so readers find it without the central directory",
         fix="re-pack with `dduf pack`"),
    Rule("D011", "error", "sharded-weights index names a file that is not in the component folder",
         checked_by="validate",
         meaning="a sharded-weights index (`*.safetensors.index*.json`) names a file the folder does not hold, or has no `weight_map`",
         why="loading fails halfway through the shards",
         fix="add the missing shards or fix `weight_map`"),
    Rule("D012", "error", "component, reference or subfolder name is not a plain name (path separator, '..', control character, not an identifier)",
         checked_by="open",
         meaning="a component name is not a Python identifier, or a reference name, `subfolder`, `variant` or `revision` is not a plain name (path separator, `.`/`..`, control or format characters, `:`)",
         why="names become paths in caches and views: `../..` or `/abs` made `dduf refs` remove and recreate folders outside its cache",
         fix="use plain names; components are identifiers"),
    Rule("D013", "error", "a JSON entry is over the budget of its kind (size, values, depth, numbers)",
         checked_by="open",
         meaning="a JSON entry is larger, holds more values, nests deeper or holds a longer or non-finite number literal than the budget of its kind allows (model_index.json, the dduf_plus index, configs, shard indexes, other JSON: docs/security.md); the loader refuses the same entries with the same code",
         why="a 60 MB model_index.json took 56 s and 1.3 GB to validate; a 60 MB config loaded in 157 s and 4.3 GB; deep nesting is a stack bomb",
         fix="keep configs small and flat"),
    Rule("D014", "error", "a tokenizer file is over its budget (vocabulary, pieces, merges, added tokens)",
         checked_by="validate (the loader too)",
         meaning="a tokenizer file holds more than its cap: over 1,048,576 tokens (`tokenizer.json`, `vocab.json`, `vocab.txt`) or SentencePiece pieces (`*.model`), over 1,048,576 merges (`merges.txt`), over 65,536 added or special tokens (`special_tokens_map.json`, `added_tokens.json`, `tokenizer_config.json` and the `extra_ids` it asks T5's tokenizers to add, the added tokens of `tokenizer.json`), over 64 MiB, or a `.model` that is not a readable protobuf (docs/security.md)",
         why="tokenizer files go to transformers, tokenizers and sentencepiece with no limit of their own: a 61 MB special_tokens_map.json, a 56 MB spiece.model (3 M pieces) and a 50 MB tokenizer.json (2.5 M tokens) loaded in 1.4-1.9 GB and up to minutes, all reported valid; real vocabularies hold 32 k to 262 k tokens",
         fix="ship the tokenizer the model was trained with"),
    Rule("D015", "error", "a number in a scheduler or guider config is out of range",
         checked_by="validate (the loader: every config-only component)",
         meaning="`scheduler_config.json` or `guider_config.json` (the loader: the config of every scheduler, guider or image processor it builds) holds a number, integer or float, over 1,048,576 in magnitude (`Infinity`/`NaN` pass: diffusers writes `-Infinity` itself, and they size nothing)",
         why="config-only components allocate in proportion to some of their numbers: `num_train_timesteps: 1e8` (a float) took 1.9 GB from a 1.4 MB archive, `solver_order: 4294967296` asked for 32 GB; real configs stay far below (`num_train_timesteps` 1000)",
         fix="fix the config"),
    Rule("D016", "error", "a model component has its config but no weights",
         checked_by="validate (the loader too)",
         meaning="a stored component whose class is a model (not a scheduler, tokenizer, feature extractor, processor or guider: known from its library's class name, its config file or, when its class is unknown, `config.json` with no other config) holds a config but no `.safetensors` weights (also when its shard index names none)",
         why="the loader has nothing to give the model: it refuses, or random weights would load",
         fix="add the component's `.safetensors` files, or reference it (`dduf pack --ref`)"),
    Rule("D017", "error", "a component class its library does not have",
         checked_by="validate (the loader too; only for diffusers and transformers, when installed)",
         meaning="`model_index.json` names a component class (`[library, class]`) that the installed diffusers or transformers does not export (old names diffusers itself maps, such as `CLIPFeatureExtractor`, pass); the message says the closest name; looked up in the libraries' source text, without importing torch. The pipeline class (`_class_name`) is `dduf pack`'s warning and the loader's error, not a rule",
         why="no loader can build it: a typo (`UNet2DConditionModle`) makes an archive every tool accepts and none loads",
         fix="fix the class name; if it is a newer class, upgrade the library the validator runs with"),
    Rule("D018", "error", "a part of a list component (Multi-ControlNet, Multi-Adapter) is misnamed or after a gap",
         checked_by="open",
         meaning="a further part of a list component (`controlnet_1`, `controlnet_2`... of a `MultiControlNetModel`, `MultiControlNetUnionModel` or `MultiAdapter` component) is named in `model_index.json` with a class other than the list's part class (`ControlNetModel`, `ControlNetUnionModel`, `T2IAdapter`), or comes after a part that is not stored",
         why="the loader builds each part with the list's part class, as diffusers does; a part after a gap is a folder diffusers never reads (it stops at the first missing one)",
         fix="re-pack the folder diffusers saved (`dduf pack` names each part), or remove the stray part"),
    Rule("D019", "error", "a component's config.json differs from the config diffusers reads (guider_config.json)",
         checked_by="validate (the loader too)",
         meaning="a component folder holding `guider_config.json` (a config name outside DDUF's four) also holds a `config.json` that is not its byte-identical copy",
         why="DDUF readers read `config.json`, diffusers reads `guider_config.json`: two readers would see two different configs",
         fix="re-pack: `dduf pack` and `save_dduf` store the copy themselves"),
    # safetensors
    Rule("S001", "error", "safetensors header length runs past the entry or over 100 MB",
         checked_by="open",
         meaning="safetensors header length runs past the entry or over 100 MB",
         why="forged lengths make readers allocate or read unbounded amounts",
         fix="re-save the weights with safetensors"),
    Rule("S002", "error", "safetensors header is not valid JSON object",
         checked_by="open",
         meaning="safetensors header not a UTF-8 JSON object (NaN/Infinity, UTF-16, `-0` and lone surrogates refused, as the Rust reader does)",
         why="Python's `json` accepts what `safetensors` refuses: readers would disagree",
         fix="re-save the weights"),
    Rule("S003", "error", "unknown tensor dtype",
         checked_by="open",
         meaning="unknown tensor dtype",
         why="no reader can interpret the bytes",
         fix="use a dtype safetensors defines"),
    Rule("S004", "error", "tensor shape is negative, non-integer or overflows",
         checked_by="open",
         meaning="tensor shape negative, non-integer, of rank > 64, or with a product that overflows",
         why="overflowing shapes make size checks wrap around",
         fix="re-save the weights"),
    Rule("S005", "error", "tensor byte span does not match shape x dtype",
         checked_by="open",
         meaning="tensor byte span ≠ shape × dtype size",
         why="the tensor reads neighbouring bytes or leaves some unread",
         fix="re-save the weights"),
    Rule("S006", "error", "tensor offsets out of bounds, overlapping or leaving holes",
         checked_by="open",
         meaning="tensor offsets out of bounds, overlapping, or leaving holes (also at the end)",
         why="overlaps alias tensors; holes hide payloads that no tensor accounts for",
         fix="re-save the weights"),
    Rule("S007", "error", "__metadata__ is not a mapping of strings to strings",
         checked_by="open",
         meaning="`__metadata__` is not a mapping of strings to strings",
         why="the safetensors format requires it; other readers fail",
         fix="store only strings in metadata"),
    Rule("S008", "info", "tensor data section not page-aligned in the archive (no zero-copy mmap)",
         checked_by="open",
         meaning="tensor data section not 4096-byte aligned in the archive",
         why="no zero-copy mmap or page-aligned DMA: loaders copy",
         fix="re-pack with `dduf pack`"),
    Rule("S009", "info", "tensor not aligned to its element size (loader must copy it)",
         checked_by="open",
         meaning="a tensor not aligned to its element size",
         why="every loader must copy it before use",
         fix="re-pack with `dduf pack`"),
    Rule("S010", "error", "safetensors header repeats a key (readers disagree on which one counts)",
         checked_by="open",
         meaning="the safetensors header repeats a key (a tensor, or a field of one)",
         why="Python keeps the last, others the first or refuse: each reader sees different tensors",
         fix="re-save the weights"),
    Rule("S011", "error", "more tensors than the cap (per file or per archive)",
         checked_by="open",
         meaning="a safetensors header (or the archive in all) declares more tensors than the cap (32,768 per file, 65,536 per archive; JSON values counted on the header's bytes before parsing)",
         why="one 60 MB header with a million empty tensors took 15 s and 900 MB in every command",
         fix="split the weights"),
    Rule("S012", "error", "a tensor name holds NUL or control characters",
         checked_by="open",
         meaning="a safetensors header names a tensor with NUL or another control character (U+0000-U+001F, U+007F; JSON spells them as escapes)",
         why="C and C++ readers cut a name at NUL, so `a\\u0000x` shadows or duplicates `a` (safetensors#748); no model has such a parameter",
         fix="re-save the weights under the model's own parameter names"),
    # dduf_plus index
    Rule("I001", "error", "dduf_plus index does not parse or has an unknown format",
         checked_by="open (format) and validate (digests)",
         meaning="dduf_plus index does not parse, has an unknown format, lacks `files`, or holds a malformed sha256/CRC-32",
         why="the recorded hashes and offsets cannot be used",
         fix="re-pack with `dduf pack`"),
    Rule("I002", "error", "dduf_plus index disagrees with the archive entries",
         checked_by="open (sizes, offsets, tensors, coverage) and validate (CRC-32, tensor data offsets, components, references)",
         meaning="the index disagrees with the archive",
         why="the archive was edited after packing; index-based fast paths would read the wrong bytes",
         fix="re-pack"),
    Rule("I003", "info", "no dduf_plus index (foreign archive): hashes unknown",
         checked_by="open",
         meaning="no dduf_plus index (a foreign archive)",
         why="no sha256s: `--verify` can only check CRC-32",
         fix="re-pack with `dduf pack` to record sha256s and tensor offsets"),
    # references
    Rule("R001", "error", "external reference malformed",
         checked_by="open (not an object) and validate (each reference)",
         meaning="a `_dduf_plus_references` entry is malformed: it needs `pretrained_model_name_or_path` (string, or null for no source), optional `subfolder`/`revision`/`variant` (string or null), and `files`: plain file name → `{\"size\": int ≥ 0, \"sha256\": 64 lowercase hex}` and/or `\"git_sha1\": 40 lowercase hex` (small non-LFS Hub files are known by their git blob id only); non-empty when a source is named; the component must be in `model_index.json`",
         why="without sizes and hashes a stale or wrong local copy would be used silently; a file name with `/` or `..` would escape the component folder when resolved",
         fix="re-pack with `dduf pack --ref`"),
    Rule("R002", "error", "referenced component also stored in the archive",
         checked_by="open",
         meaning="a component both stored and referenced",
         why="which one loads is ambiguous",
         fix="store it or reference it, not both"),
    Rule("R003", "warning", "external reference names no source (the loader cannot resolve it by itself)",
         checked_by="validate",
         meaning="a reference with no source (`pretrained_model_name_or_path: null`, what `dduf pack --exclude` writes without `--ref`)",
         why="the loader cannot resolve it alone: the archive loads only when the caller passes the component (`refs=` or the component itself)",
         fix="pass it to `load_dduf`, or re-pack with `--ref NAME=SPEC`"),
    Rule("R004", "warning", "external reference names a local path (it resolves only on a machine with that path)",
         checked_by="validate",
         meaning="a reference whose source is a local folder or `.dduf` (an absolute or relative path, what `dduf pack --base /models/sd15` records for a folder outside the Hugging Face cache)",
         why="the archive loads where that path holds the same files (or where the caller passes the component, or its files are in the Hugging Face cache by content); anywhere else the reference cannot resolve",
         fix="reference the Hub repo the copy came from (`--base org/repo`, or pack against its Hugging Face cache snapshot), or pass the component to `load_dduf`"),
    # data (only with verify)
    Rule("H001", "error", "CRC-32 mismatch",
         checked_by="verify",
         meaning="an entry's CRC-32 differs from the ZIP records",
         why="the bytes are damaged (bad download, bit rot)",
         fix="re-download the file"),
    Rule("H002", "error", "sha256 mismatch with the dduf_plus index",
         checked_by="verify",
         meaning="an entry's sha256 differs from the dduf_plus index",
         why="the bytes are damaged or were replaced (a CRC-32 is easy to forge, a sha256 is not)",
         fix="re-download the file"),
    # load check (only with `load_check=True` / `--load-check`: models built on the meta device, no weight read)
    Rule("L001", "error", "a tensor the model needs is not stored",
         checked_by="load check",
         meaning="the model the component's class and config build (on the meta device, no weight read) has a parameter or persistent buffer that no stored tensor provides (after the library's own key renames)",
         why="the loader refuses the component, or it would run with random weights",
         fix="re-save the component with its library's save_pretrained, or fix its config"),
    Rule("L002", "error", "a stored tensor the model does not have",
         checked_by="load check",
         meaning="a stored tensor names no parameter or buffer of the model the config builds (and the class does not list it as ignorable)",
         why="the weights are for another model or config: the loader drops them silently and the output is not what was saved",
         fix="re-save the component with its library's save_pretrained, or fix its config"),
    Rule("L003", "error", "a stored tensor's shape or dtype kind does not fit the model",
         checked_by="load check",
         meaning="a stored tensor has another shape than the model's tensor of that name, or stores integers or booleans where the model holds floats (or the reverse)",
         why="the loader refuses it (shape), or it would compute with the wrong values",
         fix="re-save the component with its library's save_pretrained, or fix its config"),
    Rule("L004", "error", "the model cannot be built from its config",
         checked_by="load check",
         meaning="the component's class refused its config, or the config asks for a model far bigger than the weights stored for it (the construction budget, docs/security.md)",
         why="the loader fails on this component",
         fix="fix the config"),
    Rule("L005", "info", "component not load-checked",
         checked_by="load check",
         meaning="a component the load check leaves out: quantized (its layers are rebuilt by a backend), referenced (stored elsewhere), of a library that is not installed, or not a model",
         why="its tensors are checked by the other rules only (Q001-Q006 for quantized ones)",
         fix="nothing to fix"),
    # quantized components (torchao, bitsandbytes, SDNQ), checked without importing the backend
    Rule("Q001", "error", "quantization_config names no method or no scheme",
         checked_by="validate",
         meaning="a component's config.json has a quantization_config without a quant_method, or a torchao / bitsandbytes / SDNQ one naming no scheme (SDNQ: a weights_dtype SDNQ does not know)",
         why="diffusers picks the quantizer from these fields: without them the weights cannot be rebuilt as they were saved",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q002", "error", "a quantized weight lacks its scales or quant state",
         checked_by="validate",
         meaning="a quantized weight is stored without one of its parts (torchao qdata/scale/zero_point, bitsandbytes absmax/quant_map/quant_state or SCB, SDNQ scale, and zero_point for unsigned schemes), or torchao's tensor_names lists a tensor that is not stored",
         why="the loader would leave the layer unloaded or random, or fail deep inside the backend",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q003", "error", "quantized data and scales disagree in shape or dtype",
         checked_by="validate",
         meaning="a quantized weight's data, scales or zero points have dtypes or shapes that do not fit each other (SDNQ: a scale that is not a float tensor with one value per group and its reduced axis kept as 1, a zero_point unlike its scale; bitsandbytes: a quant_state whose shape or blocksize does not fit its packed data and absmax; torchao float8: qdata, scale and block_size that do not tile each other; optimum-quanto: data, scale and shift unlike the qtype quanto_qmap.json names)",
         why="the backend would read past a tensor or dequantize garbage",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q004", "error", "the config's quantization scheme does not match the stored tensors",
         checked_by="validate",
         meaning="the scheme in quantization_config (e.g. torchao int8, bitsandbytes nf4, SDNQ int8 / uint4) differs from what the tensors hold, a torchao / bitsandbytes config has no stored tensor quantized (SDNQ's may: its minimum layer sizes skip every layer of a small model), or a weight SDNQ's modules_to_not_convert names is stored quantized",
         why="the loader builds the modules the config names over tensors of another layout",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q005", "error", "backend metadata malformed or over budget",
         checked_by="validate",
         meaning="torchao's per-tensor JSON in the safetensors __metadata__ (over 16 KiB, deeper than 6, naming a class outside torchao's allow-list or an unknown dtype), bitsandbytes' packed quant_state (over 4 KiB, not JSON, values or fields bitsandbytes never writes, a nested_dtype that is no float dtype, a nested_offset that is no finite number) or SDNQ's quantization_config (unknown dtype names, integers out of range, over 8,192 module patterns, over 256 with '*', or patterns that are not module paths with at most 3 '*') is malformed",
         why="the backend parses this metadata and instantiates the classes it names: it is hostile input",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q006", "error", "a quantized layer's stored shape does not fit the model's layer",
         checked_by="load (it needs the model class)",
         meaning="a quantized weight's stored tensors (bitsandbytes quant_state shape, 8-bit weight, SDNQ weight / scale / zero_point, optimum-quanto `_data` / `_scale` / `_shift`, 8-bit and packed 4/2-bit) have another shape or dtype than the layer the component's class and quantization_config (or quanto's map) build",
         why="the backend would dequantize into the wrong shape: garbage outputs or an out-of-bounds read",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q007", "error", "a quantization field a native kernel indexes with does not fit its tensors",
         checked_by="validate and load",
         meaning="a field a quantized backend's native kernels use as an index, count, size or dtype does not fit what they read: bitsandbytes 4-bit quant_map not 16 float32 values, nested_quant_map not 256, nested_absmax not one float32 per nested block of absmax, absmax not uint8 with double quantization (float32 without), nested_blocksize / nested_dtype / nested_offset missing or stray, a quant_state shape that is no matrix or names no dtype; torchao Int8Tensor block_size not dividing qdata or unlike its scale's grid",
         why="the kernels read through raw pointers what these fields promise: a nested_quant_map of 1 value made bitsandbytes' C kernel read 816 bytes past it (the next tensor, or the heap); the result is a crash or a silently different model",
         fix="re-save the component with diffusers' save_pretrained"),
    Rule("Q008", "warning", "a quanto int8 weight is not 64-byte aligned (the loader copies it)",
         checked_by="validate and load",
         meaning="an optimum-quanto int8 weight (`._data`) starts at an archive offset that is not a multiple of 64 (a foreign writer's tensor order)",
         why="quanto's bf16 CPU kernel (torch._weight_int8pack_mm) crashes (SIGSEGV) on int8 data that is not 16-byte aligned, and which kernel runs depends on the dtype the model is used in, not on the file: dduf_plus copies every such weight at load (memory: those weights' size), never hands it to the kernel in place",
         fix="save the component with `save_quanto_component` (it orders tensors so that none needs a copy) and re-pack"),
    Rule("Q009", "warning", "a bitsandbytes 4-bit layer's shape does not fit the AVX512-BF16 CPU repack",
         checked_by="validate and load",
         meaning="a bitsandbytes 4-bit layer whose out_features is not a multiple of 32 or whose in_features is not a whole number (at least one) of quantization blocks; the finding names the first such layer, the limit it breaks and how many more there are",
         why="on CPUs with avx512_bf16, bitsandbytes' Linear4bit.forward first repacks the weight for its fused kernel and fails in the first forward on such shapes (diffusers' own load of this component does); the plain CPU path takes any shape, and dduf_plus keeps these layers on it",
         fix="nothing is needed to load with dduf_plus; to run it elsewhere on such CPUs, keep those layers unquantized (modules_to_not_convert)"),
    Rule("Q010", "warning", "the quantization left every layer unquantized",
         checked_by="validate",
         meaning="a component whose `quantization_config` names SDNQ but none of whose stored weights is quantized (SDNQ skips every layer under its minimum sizes: 16,384 weights, 32 channels by default)",
         why="it loads, as diffusers loads it, but in full precision: none of the memory the quantization was meant to save is saved",
         fix="lower `minimum_allowed_numel` / `minimum_allowed_channel_size`, or drop the quantization_config"),
    # LoRA adapters (docs/lora.md)
    Rule("A001", "error", "_lora/config.json is malformed or names a file the archive lacks",
         checked_by="open (validate) and the loader",
         meaning="`_lora/config.json` is not an object with an `adapters` list, or an adapter's name is not a plain unique name, its file is not a `.safetensors` entry in `_lora/`, or its weight is not a finite number (or there are more than 64 adapters)",
         why="the loader applies what the config lists: a name becomes an adapter name in peft, a file an entry read",
         fix="re-pack with `dduf pack LORA.safetensors --base BASE` or `save_dduf(pipe, path, base=BASE)`"),
    Rule("A002", "error", "an adapter file holds no LoRA pair, or tensors of no LoRA role",
         checked_by="validate, pack and the loader",
         meaning="a file given or stored as a LoRA adapter has no lora_A/lora_B (lora_down/lora_up, down/up) pair, or holds tensors that are neither pair halves, alphas nor the extras diffusers reads (DoRA magnitudes, biases, norm diffs)",
         why="diffusers' LoRA loaders refuse such files (\"Invalid LoRA checkpoint\"), or it is a checkpoint given as a LoRA",
         fix="give the LoRA file itself; a full checkpoint packs with `dduf pack CKPT.safetensors --base BASE`"),
    Rule("A003", "error", "a LoRA pair does not fit together (half missing, ranks differ, not 2-D/4-D, not floating point)",
         checked_by="validate, pack and the loader",
         meaning="a module has a down half without an up half (or the reverse), their ranks differ or lie outside 1..8192, they are not 2-D (linear) or 4-D (conv), or they are not floating point",
         why="peft builds each layer from these shapes: a forged pair fails halfway through loading, or allocates a huge rank",
         fix="re-export the LoRA from its trainer"),
    Rule("A004", "error", "a LoRA alpha is not a finite number in (0, 4096 x rank]",
         checked_by="validate (reads the scalars), pack and the loader",
         meaning="a module's `.alpha` is not a one-element float tensor holding a finite number above 0 and at most 4096 times its rank",
         why="the layer's output is scaled by alpha / rank: NaN, infinite, zero or huge alphas make every image garbage",
         fix="re-export the LoRA from its trainer"),
    Rule("A005", "error", "an adapter targets a component the base pipeline does not have",
         checked_by="validate, pack and the loader",
         meaning="an adapter has modules for a component (e.g. `text_encoder_2` via `lora_te2_`) that the base's model_index.json does not name, or that is not a model",
         why="a LoRA for another family (an SDXL LoRA on SD 1.5) loads partly, or not at all",
         fix="pack the LoRA against the base it was trained on"),
    Rule("A006", "error", "a LoRA module is not in the base component, or its shapes do not fit the base weight",
         checked_by="pack and the loader (validate: where the base component is stored in the archive)",
         meaning="a module named in the base's own naming has no weight there, or its up/down shapes do not match that weight's out/in features",
         why="peft would fail on it mid-load, or the adapter was trained on another model of the same family (SD 2 vs SD 1.5)",
         fix="pack the LoRA against the base it was trained on"),
    Rule("A007", "warning", "an adapter's metadata names another family than the base's",
         checked_by="validate, pack",
         meaning="the file's ModelSpec `modelspec.architecture` or kohya `ss_base_model_version` names another model family than the base pipeline's class (SDXL vs StableDiffusion, Flux, SD3)",
         why="trainers record what they trained on; a mismatch is usually the wrong base",
         fix="check the base; pack against the one the metadata names"),
    # the validator itself
    Rule("X000", "error", "internal error while checking (a validator bug; the verdict is incomplete)",
         checked_by="validate",
         meaning="a rule raised an unexpected exception",
         why="the verdict is incomplete: a validator bug, never silently \"valid\"",
         fix="report it to dduf_plus with the file"),
)
RULES: dict[str, Rule] = {rule.code: rule for rule in _RULES}


class Severity(NamedTuple):
    """What a severity means, and the words every surface shows for it (the CLI, ``dduf serve``'s page and
    its JavaScript through ``/v1/rules``, docs/validation.md): one table, so they never drift apart."""

    name: str
    label: str  # one finding: "error"
    plural: str  # counts: "2 errors"
    meaning: str


SEVERITIES: dict[str, Severity] = {s.name: s for s in (
    Severity("error", "error", "errors",
             "the archive will not load, is unsafe to load, or loads differently than it says: it is invalid"),
    Severity("warning", "warning", "warnings",
             "it loads, but a user must know (`--strict` counts warnings as errors)"),
    Severity("info", "info", "infos",
             "a foreign or slower archive (no dduf_plus index, unaligned tensors, no ZIP64): it loads as it "
             "says; never an error, not even with `--strict`"),
)}
VERDICT_LABELS = {True: "VALID", False: "INVALID"}  # a report's verdict, as the CLI and the page show it


def count_text(counts: Mapping[str, int], *, all_severities: bool = False) -> str:
    """``{"error": 2, "warning": 1}`` as ``2 errors, 1 warning``, in severity order; severities with no finding
    are left out unless ``all_severities`` (the page always shows the three).

    Example:
        >>> count_text({"error": 0, "warning": 1, "info": 2})
        '1 warning, 2 infos'
    """
    parts = []
    for s in SEVERITIES.values():
        n = counts.get(s.name, 0)
        if n or all_severities:
            parts.append(f"{n} {s.label if n == 1 else s.plural}")
    return ", ".join(parts)


class Finding(NamedTuple):
    code: str
    entry: str | None
    message: str
    severity: str
    offset: int | None = None  # the byte in the archive the finding is about, where one applies (ZIP records)

    def __str__(self) -> str:
        where = f" [{self.entry}]" if self.entry else ""
        return f"{self.code}{where}: {self.message}"

    def as_dict(self) -> dict:
        return {"code": self.code, "entry": self.entry, "message": self.message}


def finding(code: str, entry: str | None, message: str, offset: int | None = None) -> Finding:
    return Finding(code, entry, message, RULES[code].severity, offset)


class FindingGroup(NamedTuple):
    """Findings of one rule and severity, for people to read: an archive written without ZIP64 extras has
    the same Z018 warning on every entry, shown once with the entries listed (JSON keeps every finding)."""

    code: str
    severity: str
    message: str  # the shared message; the rule's title when the messages differ (then see ``findings``)
    entries: list[str]  # the entries named, in order, once each (empty: archive-wide findings)
    findings: list[Finding]  # every finding of the group, in order

    @property
    def same_message(self) -> bool:
        return len({f.message for f in self.findings}) <= 1


def _as_finding(item: Finding | Mapping[str, Any]) -> Finding:
    if isinstance(item, Finding):
        return item
    code = str(item["code"])
    rule = RULES.get(code)
    severity = item.get("severity") or (rule.severity if rule else "error")
    return Finding(code, item.get("entry"), str(item.get("message", "")), str(severity))


def group_findings(findings: Iterable[Finding | Mapping[str, Any]]) -> list[FindingGroup]:
    """Group findings (:class:`Finding` records or their ``as_dict()`` / report dicts, whose ``severity`` is
    taken from the rule when absent) by (severity, code), groups in order of first appearance.

    Example:
        >>> [(g.code, g.entries) for g in group_findings([finding("Z018", "a", "m"), finding("Z018", "b", "m")])]
        [('Z018', ['a', 'b'])]
    """
    groups: dict[tuple[str, str], list[Finding]] = {}
    for item in findings:
        f = _as_finding(item)
        groups.setdefault((f.severity, f.code), []).append(f)
    out = []
    for (severity, code), members in groups.items():
        messages = {f.message for f in members}
        rule = RULES.get(code)
        message = members[0].message if len(messages) == 1 or rule is None else rule.title
        entries = list(dict.fromkeys(f.entry for f in members if f.entry))
        out.append(FindingGroup(code, severity, message, entries, members))
    return out


RULES_TABLE_BEGIN = "<!-- rules table: generated from dduf_plus/format/findings.py; do not edit by hand -->"
RULES_TABLE_END = "<!-- end of rules table -->"


def rules_markdown() -> str:
    """The rule table of docs/validation.md, generated from the rule data (one source for both)."""
    rows = ["| code | severity | checked by | what it means | why it matters | how to fix |",
            "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {r.code} | {r.severity} | {r.checked_by} | {r.meaning} | {r.why} | {r.fix} |" for r in _RULES]
    return "\n".join(rows)


def write_rules_table(doc: str) -> bool:
    """Rewrite the generated table between the markers in ``doc`` (a path); True if it changed."""
    from pathlib import Path

    path = Path(doc)
    text = path.read_text(encoding="utf-8")
    head, _, rest = text.partition(RULES_TABLE_BEGIN + "\n")
    _, _, tail = rest.partition(RULES_TABLE_END)
    new = f"{head}{RULES_TABLE_BEGIN}\n{rules_markdown()}\n{RULES_TABLE_END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":  # python -m dduf_plus.format.findings docs/validation.md
    import sys

    changed = write_rules_table(sys.argv[1] if len(sys.argv) > 1 else "docs/validation.md")
    print("rewritten" if changed else "up to date")
