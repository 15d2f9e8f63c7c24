"""Byte sizes, read and written in one place.

Reading: ``256M``, ``1.5G``, ``64GiB``, ``1048576``: a number with an optional ``k``/``m``/``g``/``t`` (an ``iB``
or ``B`` after it changes nothing); the units are binary (``1M`` = 1,048,576 bytes), as ``zstd``, ``dd`` and
``ulimit`` read them. Every flag and variable that takes a size (``--frame-size``, ``--max-upload``,
``--max-decompressed``, ``$DDUF_PLUS_REMOTE_PARTIALS_MAX``) reads it with :func:`parse_size`.

Writing: :func:`format_size` shows sizes in decimal units (1 kB = 1000 bytes), as the Hub and huggingface_hub
show them; with ``binary=True`` in binary units, for limits a user set in those units (a ``64G`` budget is
echoed as ``64.0 GiB``, not ``68.72 GB``)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int | None:
    """``text`` as a number of bytes, or None when it is not a size (the caller words its own error).

        >>> parse_size("256M"), parse_size("1.5k"), parse_size("64GiB") == 64 << 30, parse_size("lots")
        (268435456, 1536, True, None)
    """
    match = _SIZE.match(text)
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: float, *, binary: bool = False) -> str:
    """``155.82 kB``, ``1.26 MB`` (decimal units, two decimals); with ``binary``, ``72.0 MiB``; bytes stay whole.

        >>> format_size(1_260_000), format_size(999), format_size(72 << 20, binary=True)
        ('1.26 MB', '999 B', '72.0 MiB')
    """
    step, units, places = (1024, ("B", "KiB", "MiB", "GiB", "TiB"), 1) if binary else \
        (1000, ("B", "kB", "MB", "GB", "TB"), 2)
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{places}f} {unit}"
        n /= step
    return f"{n} B"  # pragma: no cover - the loop returns at its last unit
