"""``dduf serve``: the validation service (dduf_plus.serve) on uvicorn. starlette and uvicorn are imported
only when the command runs, so every other command starts as fast as before; without the ``serve`` extra
the command says how to install it.

Exit status as every command: 2 for a bad option or an address that cannot be listened on (a port in use,
out of range, a host that does not resolve: one line, no traceback), 130 on Ctrl-C (after a clean shutdown),
0 when stopped otherwise (SIGTERM)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from ._common import int_arg, size_arg

logger = logging.getLogger(__name__)
DESCRIPTION = """\
Serve DDUF validation over HTTP: POST /v1/validate (an upload, or JSON {"url": ...} read by range requests;
?verify=true, ?strict=true), GET /v1/rules, POST /v1/webhook (Hugging Face Hub webhooks, secret in
X-Webhook-Secret), GET /v1/reports/{repo}/{sha}, and a page at /. URLs are fetched only under
--allow-url-prefix (default: the hub endpoint, $HF_ENDPOINT or https://huggingface.co/) and never from
loopback/private/link-local addresses unless --allow-private. Requests are answered only for Host names
localhost, IP literals and --allowed-host. Behind a reverse proxy: docs/serve.md.

  curl --data-binary @x.dduf http://127.0.0.1:8000/v1/validate          # the archive as the body
  curl -F file=@x.dduf 'http://127.0.0.1:8000/v1/validate?verify=true'  # or as a form field named file"""


_port = int_arg(0, 65535, what="a port number", out_of_range="{value} is not a port: 0 to 65535 (0: any free port)")
_positive = int_arg(1)
_non_negative = int_arg(0)  # --queue: 0 is no waiting (busy is 503 at once); a negative one was taken as 0


def _seconds(text: str) -> float:
    """``--time-limit``: a positive, finite number of seconds (with 0 or a negative one, asyncio.wait_for times
    out at once: every validation was a 504)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: a positive number of seconds")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve validation over HTTP (API, page, Hub webhook)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--allow-url-prefix", action="append", default=[], metavar="PREFIX",
                   help="URLs under PREFIX may be validated (repeatable; default: the hub endpoint only)")
    p.add_argument("--allow-private", action="store_true",
                   help="also fetch from loopback/private/link-local addresses (an internal hub, tests)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests for Host NAME (repeatable; the proxy's public name; '*': any). "
                        "Always answered: localhost, IP literals, --host")
    p.add_argument("--max-upload", type=size_arg, default=4 << 30, metavar="SIZE", help="largest upload (default 4G)")
    p.add_argument("--workers", type=_positive, default=4, help="validations at once (threads, default 4)")
    p.add_argument("--queue", type=_non_negative, default=64, help="requests that may wait for a worker (default 64); more: 503")
    p.add_argument("--uploads", type=_positive, default=64, metavar="N",
                   help="request bodies being received at once (default 64; more: 503)")
    p.add_argument("--uploads-per-client", type=_positive, default=16, metavar="N",
                   help="of those, from one client address (default 16; more: 429)")
    p.add_argument("--time-limit", type=_seconds, default=120.0, metavar="S", help="seconds per validation (default 120)")
    p.add_argument("--webhook-secret-env", metavar="VAR", default=None,
                   help="environment variable holding the webhook secret (unset: POST /v1/webhook is off)")
    p.add_argument("--reports-dir", type=Path, default=None, metavar="DIR",
                   help="also keep webhook reports as JSON files here")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="the hub (default $HF_ENDPOINT or https://huggingface.co/)")
    p.set_defaults(func=run)


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket for ``host:port``, or one-line :class:`DDUFIOError` (in use, no such address)."""
    from ..errors import DDUFIOError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise DDUFIOError(f"--host {host}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses the port at once
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise DDUFIOError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _settings(args: argparse.Namespace) -> Any:
    from ..errors import DDUFUsageError
    from ..serve import Settings
    from ..serve.safety import BadURL, url_origin

    secret = None
    if args.webhook_secret_env:
        secret = os.environ.get(args.webhook_secret_env)
        if not secret:
            raise DDUFUsageError(f"--webhook-secret-env {args.webhook_secret_env}: that variable is not set")
    extra = {"endpoint": args.endpoint if args.endpoint.endswith("/") else args.endpoint + "/"} if args.endpoint else {}
    for prefix in args.allow_url_prefix + ([args.endpoint] if args.endpoint else []):
        try:
            url_origin(prefix)
        except BadURL as e:
            raise DDUFUsageError(f"--allow-url-prefix/--endpoint {e}") from None
    from huggingface_hub import get_token

    hosts = tuple(args.allowed_host) + ((args.host,) if args.host not in ("", "0.0.0.0", "::") else ())
    return Settings(allow_url_prefixes=tuple(args.allow_url_prefix), allow_private=args.allow_private,
                    max_upload=args.max_upload, workers=args.workers, queue=max(0, args.queue),
                    uploads=args.uploads, uploads_per_client=args.uploads_per_client, time_limit=args.time_limit,
                    webhook_secret=secret, reports_dir=args.reports_dir, token=get_token(), allowed_hosts=hosts,
                    **extra)


def _ignore(_signum: int, _frame: Any) -> None:
    """SIGTERM after uvicorn's graceful shutdown: nothing left to do."""


def run(args: argparse.Namespace) -> int:
    from ..errors import DDUFIOError, DDUFUsageError

    try:
        import python_multipart  # noqa: F401 - all three of the extra, checked before anything starts
        import starlette  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        raise DDUFUsageError(f'dduf serve needs {e.name}: pip install "dduf_plus[serve]" '
                             '(from a checkout: pip install -e ".[serve]")') from None
    settings = _settings(args)
    sock = _listen(args.host, args.port)  # before uvicorn: a port in use is one line and exit 2, not its exit 3
    from ..serve import create_app

    config = uvicorn.Config(create_app(settings), log_level="info", proxy_headers=True, server_header=False,
                            timeout_keep_alive=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("dduf serve: http://%s:%d/ (Ctrl-C stops)", shown, port)
    # uvicorn shuts down on SIGINT/SIGTERM, then raises the signal again: SIGINT becomes KeyboardInterrupt
    # (exit 130); SIGTERM (a service manager stopping it) meets this handler and is a clean stop (exit 0)
    previous = signal.signal(signal.SIGTERM, _ignore) if threading.current_thread() is threading.main_thread() else None
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise DDUFIOError(f"the server on {shown}:{port} did not start (see the log above)")
    return 0
