"""The package version (one place: pyproject reads it, ``dduf_plus.__version__`` re-exports it)."""

__version__ = "0.14.0"
