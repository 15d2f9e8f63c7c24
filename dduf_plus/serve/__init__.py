"""``dduf serve``: DDUF validation as an HTTP service (validation API, a page, a Hub webhook receiver).

Needs the ``serve`` extra (``pip install "dduf_plus[serve]"``, from a checkout ``pip install -e ".[serve]"``:
starlette, uvicorn, python-multipart).

Example:
    >>> from dduf_plus.serve import Settings, create_app
    >>> app = create_app(Settings(allow_url_prefixes=("https://huggingface.co/",)))  # any ASGI server runs it
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .settings import Settings

if TYPE_CHECKING:
    from starlette.applications import Starlette


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app (see :mod:`dduf_plus.serve.app`); starlette is imported here, not on import."""
    from .app import create_app as _create_app

    return _create_app(settings)


__all__ = ["Settings", "create_app"]
