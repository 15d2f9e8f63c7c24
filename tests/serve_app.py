"""The real ``dduf serve`` app under uvicorn on 127.0.0.1 (port 0), in a thread, for tests and benches."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from dduf_plus.serve import Settings, create_app


@contextmanager
def running(settings: Settings) -> Iterator[tuple[str, Any]]:
    """(base URL, the app's Service) while uvicorn serves ``create_app(settings)``; stopped on exit."""
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app.state.service
    finally:
        server.should_exit = True
        thread.join(20)
