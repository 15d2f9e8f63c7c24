"""The decompression budget of a ``.zst`` (:mod:`.zst`): a ``.zst`` is untrusted like the archive inside, so
decompressing has a budget (:class:`DecompressionBudget`: an absolute cap, a ratio cap above a floor, and the
free disk space), checked before writing when the stream announces its size and enforced while decoding when
it does not. Set by ``max_decompressed=``, ``--max-decompressed`` or ``$DDUF_PLUS_MAX_DECOMPRESSED``."""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..errors import DDUFError
from ..sizes import format_size, parse_size

MiB = 1 << 20

# A .zst is as untrusted as the archive inside: 65 KB of zstd can announce (and really hold) 2 GiB of
# zeros. Real DDUF weights compress 1.05-1.3x (bf16/fp16 mantissas are close to random); tokenizers and
# configs compress more but are small. So above a floor (small archives never trip it, and writing the
# floor costs well under a second), the output may be at most MAX_RATIO times the compressed size, and
# never more than MAX_BYTES (beyond the largest public pipelines, ~100 GB in fp32), whatever the ratio.
MAX_DECOMPRESSED_ENV = "DDUF_PLUS_MAX_DECOMPRESSED"
DEFAULT_MAX_BYTES = 256 << 30  # 256 GiB
DEFAULT_MAX_RATIO = 16.0  # an order of magnitude over real pipelines' 1.1x
RATIO_FLOOR = 256 * MiB  # any ratio is fine below this
DISK_RESERVE = 256 * MiB  # decompression never fills a disk to its last bytes
RAISE_HINT = f"max_decompressed= in Python, --max-decompressed on the command line, or ${MAX_DECOMPRESSED_ENV}"
_RATIO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$", re.IGNORECASE)


class DecompressionBudgetError(DDUFError):
    """Decompressing would pass the size/ratio budget or the free disk space (``dduf validate``: Z022)."""


@dataclass(frozen=True)
class DecompressionBudget:
    """How much a ``.zst`` may expand to: at most ``max_bytes`` (None: no absolute cap) and at most
    ``max_ratio`` times its compressed size once past :data:`RATIO_FLOOR` (None: no ratio cap). Free
    disk space is checked whatever the budget.

    Example:
        >>> DecompressionBudget.parse("64G")      # 64 GiB, any ratio (you vouch for the archive)
        >>> DecompressionBudget.parse("32x")      # 32x the compressed size, within the default cap
        >>> DecompressionBudget.parse("64G,32x")  # both; "unlimited": only the disk space check
    """

    max_bytes: int | None = DEFAULT_MAX_BYTES
    max_ratio: float | None = DEFAULT_MAX_RATIO
    origin: str = "the default budget"

    def limit(self, compressed_size: int) -> int | None:
        """The most bytes a stream of ``compressed_size`` bytes may decompress to (None: unbounded)."""
        limits = [] if self.max_bytes is None else [self.max_bytes]
        if self.max_ratio is not None:
            limits.append(max(RATIO_FLOOR, int(self.max_ratio * compressed_size)))
        return min(limits) if limits else None

    def __str__(self) -> str:
        parts = [] if self.max_bytes is None else [f"at most {format_size(self.max_bytes, binary=True)}"]
        if self.max_ratio is not None:
            parts.append(f"at most {self.max_ratio:g}x the compressed size above {format_size(RATIO_FLOOR, binary=True)}")
        return f"{self.origin} ({', '.join(parts) or 'unlimited'})"

    @classmethod
    def parse(cls, text: str, origin: str = "--max-decompressed") -> DecompressionBudget:
        """``SIZE`` (``500M``, ``64G``, ``1T``, bytes), ``RATIOx``, both comma-separated, or ``unlimited``.

        Raises:
            DDUFError: the text is none of these (the message names ``origin``).
        """
        if text.strip().lower() in ("unlimited", "none", "inf"):
            return cls(None, None, f"{origin}=unlimited")
        max_bytes: int | None = None
        max_ratio: float | None = None
        for part in text.split(","):
            if (size := parse_size(part)) is not None and max_bytes is None:
                max_bytes = size
            elif (m := _RATIO.match(part)) and max_ratio is None and float(m.group(1)) > 0:
                max_ratio = float(m.group(1))
            else:
                raise DDUFError(f"{origin}={text!r}: expected a size (500M, 64G, 1T), a ratio (32x), both "
                                "(64G,32x) or 'unlimited'")
        if max_bytes is not None and max_ratio is None:
            return cls(max_bytes, None, f"{origin}={text.strip()}")  # an explicit size: the user vouches
        return cls(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes, max_ratio, f"{origin}={text.strip()}")


BudgetLike = DecompressionBudget | int | str | None


def decompression_budget(value: BudgetLike = None) -> DecompressionBudget:
    """The budget to apply: ``value`` (a budget, a byte count or a string for :meth:`DecompressionBudget.parse`),
    else ``$DDUF_PLUS_MAX_DECOMPRESSED``, else the default (256 GiB, 16x above 256 MiB)."""
    if isinstance(value, DecompressionBudget):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return DecompressionBudget(value, None, f"max_decompressed={value}")
    if isinstance(value, str):
        return DecompressionBudget.parse(value, "max_decompressed")
    env = os.environ.get(MAX_DECOMPRESSED_ENV)
    if env:
        return DecompressionBudget.parse(env, f"${MAX_DECOMPRESSED_ENV}")
    return DecompressionBudget()


def free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free - DISK_RESERVE
    except OSError:  # a file system that does not say: let the writes themselves fail
        return 1 << 62


class Allowance(NamedTuple):
    """What one decompression may write: ``cutoff`` bytes (None: unbounded) and why it stops there."""

    cutoff: int | None
    over_budget: bool  # the cutoff is the budget's (else the free disk space's)


def allowance_for(name: str, compressed: int, announced: int | None, budget: DecompressionBudget,
               out_dir: Path) -> Allowance:
    """Check an announced size against the budget and the free space *before* writing; for a stream
    that announces nothing, the point where decoding must stop."""
    limit = budget.limit(compressed)
    if announced is not None and limit is not None and announced > limit:
        raise over_budget(name, compressed, announced, limit, budget, announced=True)
    free = free_bytes(out_dir)
    if announced is not None:
        if announced > free:
            raise no_space(name, announced, free, out_dir)
        return Allowance(announced, False)
    if free <= 0:
        raise no_space(name, None, 0, out_dir)
    if limit is not None and limit <= free:
        return Allowance(limit, True)
    return Allowance(free, False)


def over_budget(name: str, compressed: int, size: int, limit: int, budget: DecompressionBudget, *,
                 announced: bool) -> DecompressionBudgetError:
    ratio = size / compressed if compressed else float("inf")
    what = (f"announces {format_size(size, binary=True)} of output" if announced
            else f"decompressed past {format_size(size, binary=True)} without announcing its size (stopped there)")
    return DecompressionBudgetError(
        f"{name}: the stream {what} from {format_size(compressed, binary=True)} ({ratio:,.0f}x), over the decompression "
        f"budget: {format_size(limit, binary=True)} for this file under {budget}. If you trust the archive, raise the "
        f"budget ({RAISE_HINT}: e.g. {_suggest(size if announced else 2 * size)} or 'unlimited')")


def _suggest(size: int) -> str:
    """A round budget that admits ``size`` bytes, written as the option takes it (``3G``)."""
    return f"{max(1, math.ceil(size / (1 << 30)))}G"


def no_space(name: str, size: int | None, free: int, out_dir: Path) -> DecompressionBudgetError:
    """``size``: what the stream announces; None: it announces nothing and was cut off at ``free``."""
    what = (f"decompressing needs {format_size(size, binary=True)}, but {out_dir} has {format_size(max(free, 0), binary=True)} free" if size
            is not None else f"the stream announces no size and decoded past the {format_size(max(free, 0), binary=True)} "
            f"free in {out_dir}")
    return DecompressionBudgetError(
        f"{name}: {what} (keeping {format_size(DISK_RESERVE, binary=True)} spare): free disk space or decompress elsewhere "
        "(-o, $DDUF_PLUS_CACHE, $TMPDIR)")
