"""``dduf serve``: the validation service (dduf_plus.serve) on uvicorn. starlette and uvicorn are imported
only when the command runs, so every other command starts as fast as before; without the ``serve`` extra
the command says how to install it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .compress import _size

DESCRIPTION = """\
Serve DDUF validation over HTTP: POST /v1/validate (an upload, or JSON {"url": ...} read by range requests;
?verify=true, ?strict=true), GET /v1/rules, POST /v1/webhook (Hugging Face Hub webhooks, secret in
X-Webhook-Secret), GET /v1/reports/{repo}/{sha}, and a page at /. URLs are fetched only under
--allow-url-prefix (default: the hub endpoint, $HF_ENDPOINT or https://huggingface.co/) and never from
loopback/private/link-local addresses unless --allow-private. Behind a reverse proxy: docs/serve.md."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve validation over HTTP (API, page, Hub webhook)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--allow-url-prefix", action="append", default=[], metavar="PREFIX",
                   help="URLs under PREFIX may be validated (repeatable; default: the hub endpoint only)")
    p.add_argument("--allow-private", action="store_true",
                   help="also fetch from loopback/private/link-local addresses (an internal hub, tests)")
    p.add_argument("--max-upload", type=_size, default=4 << 30, metavar="SIZE", help="largest upload (default 4G)")
    p.add_argument("--workers", type=int, default=4, help="validations at once (threads, default 4)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a worker (default 64); more: 503")
    p.add_argument("--time-limit", type=float, default=120.0, metavar="S", help="seconds per validation (default 120)")
    p.add_argument("--webhook-secret-env", metavar="VAR", default=None,
                   help="environment variable holding the webhook secret (unset: POST /v1/webhook is off)")
    p.add_argument("--reports-dir", type=Path, default=None, help="also keep webhook reports as JSON files here")
    p.add_argument("--endpoint", default=None, help="the hub (default $HF_ENDPOINT or https://huggingface.co/)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import DDUFUsageError

    try:
        import python_multipart  # noqa: F401 - all three of the extra, checked before anything starts
        import starlette  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        raise DDUFUsageError(f'dduf serve needs {e.name}: pip install "dduf_plus[serve]"') from None
    secret = None
    if args.webhook_secret_env:
        secret = os.environ.get(args.webhook_secret_env)
        if not secret:
            raise DDUFUsageError(f"--webhook-secret-env {args.webhook_secret_env}: that variable is not set")
    extra = {"endpoint": args.endpoint if args.endpoint.endswith("/") else args.endpoint + "/"} if args.endpoint else {}
    from huggingface_hub import get_token

    from ..serve import Settings, create_app

    settings = Settings(allow_url_prefixes=tuple(args.allow_url_prefix), allow_private=args.allow_private,
                        max_upload=args.max_upload, workers=max(1, args.workers), queue=max(0, args.queue),
                        time_limit=args.time_limit, webhook_secret=secret, reports_dir=args.reports_dir,
                        token=get_token(), **extra)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info",
                proxy_headers=True, server_header=False, timeout_keep_alive=5)
    return 0
