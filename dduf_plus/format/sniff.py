"""What a file that is not a DDUF archive is, in words, and what to do with it.

``dduf validate``, ``dduf info``, ``load_dduf`` and the service all open archives through the ZIP reader;
when it finds no ZIP (rule Z001) or a ZIP that is no pipeline (D001), the finding names what the file is
instead (a single-file safetensors checkpoint, a GGUF file, a pickle, a PyTorch ``torch.save`` ZIP, JSON, an
HTML page, a Git LFS pointer, zstd, an empty file) rather than ZIP jargon. Only the first bytes and the entry
names are looked at; nothing is parsed beyond that."""

from __future__ import annotations

from collections.abc import Sequence

HEAD_BYTES = 64  # what :func:`non_zip_kind` needs to see

PACK_HINT = "pack a diffusers pipeline folder with `dduf pack FOLDER -o NAME.dduf`"
SINGLE_FILE = ("a single-file safetensors checkpoint, not a DDUF archive: `dduf info FILE` describes it, and "
               "`dduf pack FILE --base BASE -o NAME.dduf` makes an archive of it (BASE: the diffusers pipeline it "
               "was fine-tuned from, a folder or Hub repo id)")
_SIMPLE = (  # (magic at offset 0, what it is)
    (b"GGUF", "a GGUF file (llama.cpp / ComfyUI-GGUF quantized weights), not a DDUF archive (DDUF holds "
              "safetensors weights): " + PACK_HINT),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed stream: name it NAME.dduf.zst (validate, info and load_dduf "
                          "decompress .dduf.zst files), or decompress it with `dduf decompress`"),
    (b"\x1f\x8b", "a gzip-compressed file, not a DDUF archive: decompress it first (gunzip)"),
    (b"version https://git-lfs", "a Git LFS pointer, not the file itself: fetch the real file (`git lfs pull`, "
                                 "or download it from the Hub)"),
)


ZST_NAMED = ("a zstd-compressed archive: dduf validate, dduf info and load_dduf read a .dduf.zst directly; "
             "for this, decompress it first with `dduf decompress`")


def non_zip_kind(head: bytes, size: int, name: str = "") -> str | None:
    """What a file that has no ZIP end record is ("the file is ..."), from its first bytes (``head``, up to :data:`HEAD_BYTES`)
    and its size; None when it is nothing recognisable (then it is a truncated or foreign file).

    Example:
        >>> non_zip_kind(b"", 0)
        'empty (0 bytes): an interrupted download or copy?'
    """
    if name.endswith(".zst") and _is_zstd(head):  # named as one, given to a reader of plain archives
        return ZST_NAMED
    if size == 0:
        return "empty (0 bytes): an interrupted download or copy?"
    if _is_safetensors(head, size):
        return SINGLE_FILE
    for magic, what in _SIMPLE:
        if head.startswith(magic):
            return what
    if _is_zstd(head):
        return _SIMPLE[1][1]
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return ("a pickle file (a legacy PyTorch .ckpt/.pt/.bin checkpoint?), not a DDUF archive; pickle runs code "
                "when loaded: load it only if you trust it, save the pipeline with diffusers (safetensors), then " + PACK_HINT)
    if head.startswith(b"PK\x03\x04"):
        return ("a truncated ZIP archive (it starts as one but its end record is missing): re-download or "
                "re-create it")
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] in (b"{", b"["):
        return "a JSON file, not a DDUF archive (a ZIP holding model_index.json and the component folders): " + PACK_HINT
    if text[:1] == b"<":
        return "an HTML or XML page (an error or login page saved instead of the file?), not a DDUF archive"
    return None


def _is_zstd(head: bytes) -> bool:
    """A zstd frame, or a skippable frame first (``dduf compress`` writes one)."""
    return head.startswith(b"\x28\xb5\x2f\xfd") or (head[1:4] == b"\x2a\x4d\x18" and head[:1] >= b"\x50"
                                                        and head[:1] <= b"\x5f")


def _is_safetensors(head: bytes, size: int) -> bool:
    """safetensors: an 8-byte little-endian header length, then a JSON object that fits in the file."""
    if len(head) < 10:
        return False
    length = int.from_bytes(head[:8], "little")
    return 2 <= length <= size - 8 and head[8:9] == b"{" and head[9:10] in b'" \n\t}'


def torch_zip_kind(names: Sequence[str]) -> str | None:
    """A ZIP that is a ``torch.save`` checkpoint (``ARCHIVE/data.pkl``, ``ARCHIVE/data/0``...), in words."""
    if not any(n.endswith("/data.pkl") and n.count("/") == 1 for n in names):
        return None
    return ("a PyTorch checkpoint (torch.save's ZIP of data.pkl: a .pt/.ckpt/.bin file), not a DDUF archive; it "
            "holds pickle, which runs code when loaded: load it only if you trust it, save the pipeline with diffusers "
            "(safetensors), then " + PACK_HINT)

