"""The DDUF format, written down once as data: ZIP signatures and layouts, DDUF rules, the safetensors
dtype table, alignment. Reader, writer and validator all import from here."""

from __future__ import annotations

from typing import NamedTuple

# --- ZIP ---------------------------------------------------------------------------------------------
SIG_LOCAL = 0x04034B50
SIG_CENTRAL = 0x02014B50
SIG_EOCD = 0x06054B50
SIG_EOCD64 = 0x06064B50
SIG_EOCD64_LOCATOR = 0x07064B50
SIG_DATA_DESCRIPTOR = 0x08074B50

LOCAL_HEADER_FMT = "<IHHHHHIIIHH"  # sig, version, flags, method, time, date, crc, csize, usize, nlen, xlen
LOCAL_HEADER_SIZE = 30
CENTRAL_HEADER_FMT = "<IHHHHHHIIIHHHHHII"
CENTRAL_HEADER_SIZE = 46
EOCD_FMT = "<IHHHHIIH"  # sig, disk, cd disk, entries here, entries, cd size, cd offset, comment len
EOCD_SIZE = 22
EOCD64_FMT = "<IQHHIIQQQQ"  # sig, record size, made by, needed, disk, cd disk, entries here, entries, cd size, cd off
EOCD64_SIZE = 56
LOCATOR_FMT = "<IIQI"  # sig, disk with eocd64, eocd64 offset, total disks
LOCATOR_SIZE = 20
MAX_COMMENT = 0xFFFF

EXTRA_ZIP64 = 0x0001
EXTRA_ALIGN = 0xD935  # Android zipalign's id: u16 alignment, then zero padding. Readers skip it.
EXTRA_ALIGN_MIN = 6

U16_MAX = 0xFFFF
U32_MAX = 0xFFFFFFFF
ZIP_VERSION = 45  # ZIP64
MADE_BY_UNIX = 3
METHOD_STORED = 0
METHOD_DEFLATED = 8
FLAG_ENCRYPTED = 0x0001
FLAG_DATA_DESCRIPTOR = 0x0008
FLAG_STRONG_ENCRYPTION = 0x0040
FLAG_UTF8 = 0x0800
FLAG_MASKED_HEADER = 0x2000
DOS_TIME = 0  # 00:00:00
DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: fixed so identical input gives identical bytes
UNIX_FILE_MODE = 0o100644
S_IFMT = 0o170000
S_IFLNK = 0o120000
S_IFDIR = 0o040000

# Bounds on what we trust from a file before using it (more under "budgets" below).
MAX_CENTRAL_DIRECTORY = 64 << 20
MAX_NAME_BYTES = 1024

# --- DDUF --------------------------------------------------------------------------------------------
MODEL_INDEX = "model_index.json"
ALLOWED_EXTENSIONS = (".json", ".safetensors", ".model", ".txt")
# The npm checker (@huggingface/dduf 0.0.2) accepts .safetensors/.json/.gguf/.txt: not .model.
NPM_CHECKER_EXTENSIONS = (".json", ".safetensors", ".txt", ".gguf")
CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "scheduler_config.json")
PICKLE_EXTENSIONS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# dduf_plus' own root entry: ignored by every other reader (a root-level .json is allowed by DDUF).
INDEX_NAME = "dduf_plus.index.json"
INDEX_FORMAT = "dduf_plus.index"
INDEX_VERSION = 1
# Key dduf_plus adds to model_index.json for components that live elsewhere (other readers ignore "_" keys).
REFERENCES_KEY = "_dduf_plus_references"

TENSOR_ALIGNMENT = 4096  # safetensors data sections start on a page boundary: mmap + DMA friendly
ENTRY_ALIGNMENT = 64  # every other entry


# --- safetensors -------------------------------------------------------------------------------------
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit
SAFETENSORS_METADATA_KEY = "__metadata__"


# --- budgets: what a reader takes from an untrusted archive -----------------------------------------
# Every reader (validate, info, refs, DDUFArchive) answers any archive of at most 64 MB within 3 s and
# 500 MB on two cores (tests/test_security_budgets.py, bench/bench_budgets.py); work per archive is linear
# in its size and these caps bound what cannot be made cheap enough. Each cap has a rule code and is far
# above what real pipelines hold (docs/security.md, docs/validation.md give the reasoning).

# Z005. Real pipelines hold a few dozen entries (Flux, Wan 2.1 14B: 30-40 with every shard; both weight
# variants: ~80). Parsing costs ~15 us per entry; the classic ZIP limit (65,535) would be 1-2 s of it.
MAX_ENTRIES = 10_000

# S011. Flux's transformer has ~1,200 tensors, an 8B LLM text encoder ~300 per shard, a 128-expert MoE
# merged into one file ~19,000; a whole pipeline (HiDream: 4 text encoders + MoE transformer) ~5,000.
# Halved once from 65,536 / 131,072: an indexed archive at the old per-archive cap took 3.2 s of CPU to open,
# past the 3 s budget; these still leave 1.7x / 13x headroom over the largest real cases above.
MAX_TENSORS_PER_FILE = 32_768
MAX_TENSORS_PER_ARCHIVE = 65_536
# Before a header is parsed, its JSON values are bounded from its bytes (commas and brackets, see
# JsonBudget); a tensor record is ~10 values (rank-4 shape), so this leaves room for 5-dimensional ones.
HEADER_VALUES_PER_TENSOR = 16

# D013. JSON entries a reader parses on every open or validation.
MAX_JSON_DEPTH = 64  # model_index.json with references nests 5 deep, the dduf_plus index 6, configs ~4


class JsonBudget(NamedTuple):
    """Caps on one JSON entry, checked on its bytes before it is parsed. ``values`` bounds what the parsed
    object may hold: commas + '[' + '{' + 1, counted on the raw bytes (so also inside strings), is at least the
    number of JSON values, and each costs a parser up to ~100 bytes of memory (an empty dict: 64)."""

    bytes: int
    values: int


# model_index.json is ~1 KB (with a reference per component and sha256 per file: ~20 KB, ~1,000 values);
# every component and reference it names costs work in every command (`dduf refs` ~0.5 ms per reference:
# 16,384 values allow ~1,600 references). Configs: Gemma 3's tokenizer_config.json is 1.2 MB (6k added
# tokens, ~50k values). The index records each tensor in ~140 bytes / ~10 values: 9 MB and 0.7M values at
# MAX_TENSORS_PER_ARCHIVE. Parsing costs ~1 s per million values on the 2-core reference machine.
JSON_BUDGETS = {
    MODEL_INDEX: JsonBudget(256 << 10, 1 << 14),
    INDEX_NAME: JsonBudget(16 << 20, 1 << 20),
}
CONFIG_JSON_BUDGET = JsonBudget(8 << 20, 1 << 20)


def json_budget(entry: str) -> JsonBudget | None:
    """The D013 budget of a JSON entry: model_index.json, the dduf_plus index and component configs (what
    every command parses); None for data files such as vocab.json / tokenizer.json, parsed only when
    validating with ``verify`` (their depth is still capped)."""
    if entry in JSON_BUDGETS:
        return JSON_BUDGETS[entry]
    if entry.rsplit("/", 1)[-1] in CONFIG_FILES:
        return CONFIG_JSON_BUDGET
    return None


class DType(NamedTuple):
    safetensors: str
    torch: str  # attribute name on the torch module
    bits: int
    floating: bool


DTYPES: tuple[DType, ...] = (
    DType("BOOL", "bool", 8, False),
    DType("U8", "uint8", 8, False),
    DType("I8", "int8", 8, False),
    DType("I16", "int16", 16, False),
    DType("U16", "uint16", 16, False),
    DType("I32", "int32", 32, False),
    DType("U32", "uint32", 32, False),
    DType("I64", "int64", 64, False),
    DType("U64", "uint64", 64, False),
    DType("F16", "float16", 16, True),
    DType("BF16", "bfloat16", 16, True),
    DType("F32", "float32", 32, True),
    DType("F64", "float64", 64, True),
    DType("C64", "complex64", 64, False),
    DType("F8_E4M3", "float8_e4m3fn", 8, True),
    DType("F8_E5M2", "float8_e5m2", 8, True),
    DType("F8_E8M0", "float8_e8m0fnu", 8, True),
    DType("F4", "float4_e2m1fn_x2", 4, True),
    DType("F6_E2M3", "float6_e2m3", 6, True),
    DType("F6_E3M2", "float6_e3m2", 6, True),
)
DTYPE_BY_SAFETENSORS = {d.safetensors: d for d in DTYPES}
DTYPE_BY_TORCH = {d.torch: d for d in DTYPES}
FP8_TORCH_NAMES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"})
