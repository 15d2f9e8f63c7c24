"""Packing floor: every way of writing a folder as DDUF (plain, partial, converted) goes through
:func:`pack`; ``complete`` turns a partial archive back into a whole one. Torch only for dtype conversion."""

from .pack import pack

__all__ = ["pack"]
