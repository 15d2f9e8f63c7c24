"""The ASGI app of ``dduf serve`` (Starlette): routes, limits, and the mapping of failures to HTTP statuses.

    POST /v1/validate      a raw or multipart upload, or JSON {"url": ...}; ?verify=true, ?strict=true
    GET  /v1/rules         the rule catalogue (dduf_plus.format.findings)
    POST /v1/webhook       Hugging Face Hub webhook (X-Webhook-Secret); reports per commit
    GET  /v1/reports/{repo}/{sha}
    GET  /                 the page; POST /check renders a result server-side (no JavaScript needed)

Statuses: 200 a verdict (valid or not), 400 a bad request, 401 a wrong webhook secret, 403 a URL refused by
policy, 404 unknown report, 408 the upload took too long, 413 too large, 502 the URL could not be read,
503 busy (Retry-After), 504 the validation ran past the time limit."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import DDUFError, DDUFIOError
from ..format.findings import RULES
from . import page
from .jobs import Busy, TimedOut, Validator, check_file, check_url_source
from .safety import URLRefused
from .settings import Settings
from .uploads import BadForm, TooLarge, Upload, display_name, spool_form, spool_raw
from .webhook import ReportStore, check_commit, commits, report_path

logger = logging.getLogger(__name__)
MAX_JSON_BODY = 64 << 10
MAX_WEBHOOK_BODY = 1 << 20
TRUE = ("1", "true", "yes", "on")
# the page loads only its own script and style; archive content is rendered as text, and cannot be framed
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class _Failure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_STATUSES: tuple[tuple[type[Exception], int], ...] = (
    (URLRefused, 403), (DDUFIOError, 502), (DDUFError, 400), (Busy, 503), (TimedOut, 504), (TooLarge, 413),
    (BadForm, 400))


def _status(error: BaseException) -> int:
    """The HTTP status for a failure; anything unexpected is re-raised (a 500, logged by the server)."""
    if isinstance(error, _Failure):
        return error.status
    for kind, status in _STATUSES:
        if isinstance(error, kind):
            return status
    raise error


def _error(error: BaseException) -> JSONResponse:
    status = _status(error)
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": str(error), "status": status}, status_code=status, headers=headers)


def _for_log(url: str) -> str:
    parts = urlsplit(url)  # no query string or fragment: signed URLs carry tokens there
    return f"{parts.scheme}://{parts.hostname}{parts.path}"


async def _read_limited(request: Request, limit: int) -> bytes:
    """A small body (JSON, a URL-encoded form, a webhook payload), refused past ``limit`` while reading."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"this request body is at most {limit} bytes")
    return bytes(body)


class Service:
    """State shared by the routes: settings, the validator, the private temporary folder, the reports."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.validator = Validator(settings)
        self.reports = ReportStore(settings.reports_dir)
        self.temp = Path(tempfile.mkdtemp(prefix="dduf-serve-", dir=settings.temp_root))

    def close(self) -> None:
        self.validator.close()
        shutil.rmtree(self.temp, ignore_errors=True)

    async def _body(self, request: Request) -> tuple[Upload | None, dict[str, Any]]:
        """(an upload or None, the JSON/form fields) of a validation request, within the limits."""
        ctype = request.headers.get("content-type", "")
        declared = request.headers.get("content-length")
        limit = self.settings.max_upload
        if declared and declared.isdigit() and int(declared) > limit + (64 << 10):
            raise TooLarge(f"the upload ({declared} bytes) is over the limit of {limit} bytes")
        if ctype.startswith("application/json"):
            try:
                fields = json.loads(await _read_limited(request, MAX_JSON_BODY))
            except ValueError as e:
                raise BadForm(f"the body is not JSON: {e}") from None
            if not isinstance(fields, dict):
                raise BadForm('expected a JSON object {"url": ...}')
            return None, fields
        if ctype.startswith("application/x-www-form-urlencoded"):
            text = (await _read_limited(request, MAX_JSON_BODY)).decode("utf-8", "replace")
            return None, {k: v[0] for k, v in parse_qs(text, max_num_fields=8).items()}
        if ctype.startswith("multipart/form-data"):
            upload = await spool_form(request.stream(), ctype, self.temp, limit)
            return (upload if upload.path else None), dict(upload.fields)
        upload = await spool_raw(request.stream(), self.temp, display_name(request.query_params.get("name")), limit)
        return upload, {}

    async def check(self, request: Request) -> dict[str, Any]:
        """Validate what a request holds; raises what :func:`_status` maps."""
        with self.validator.slot() as slot:
            try:
                upload, fields = await asyncio.wait_for(self._body(request), self.settings.time_limit)
            except asyncio.TimeoutError:
                raise _Failure(408, f"the request body took longer than {self.settings.time_limit:g} s") from None
            flags = {k: str(fields.get(k, request.query_params.get(k, ""))).lower() in TRUE
                     for k in ("verify", "strict")}
            if upload is not None and upload.name.endswith(".zst"):
                upload.discard()  # decompressing would write outside the app's folder, and lets bombs in
                raise BadForm("a .zst upload is not validated here: upload the .dduf (dduf decompress X.dduf.zst)")
            if upload is not None:
                path, name = upload.path, upload.name
                assert path is not None
                logger.info("validate upload %s (%d bytes)", name, upload.size)
                return await self.validator.run(slot, check_file, path, name, flags["verify"], flags["strict"],
                                                cleanup=upload.discard)
            url = fields.get("url")
            if not isinstance(url, str) or not url.strip():
                raise BadForm('give a file (raw body or multipart "file") or {"url": ...}')
            logger.info("validate url %s", _for_log(url.strip()))
            # no Hub token here: a stranger's URL must not read what the server's token can (private repos)
            return await self.validator.run(slot, check_url_source, url.strip(), flags["verify"], flags["strict"],
                                            self.settings, False)


def _routes(service: Service) -> list[Route]:
    async def validate_endpoint(request: Request) -> Response:
        try:
            return JSONResponse(await service.check(request))
        except ClientDisconnect:
            logger.info("client went away during the upload")
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001 - mapped to a status; anything unknown re-raises in _status
            return _error(e)

    async def check_page(request: Request) -> Response:
        try:
            html, status = page.render_result(await service.check(request)), 200
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001
            status = _status(e)
            html = page.render_result(None, str(e))
        return HTMLResponse(page.render_page(html), status_code=status, headers=PAGE_HEADERS)

    async def rules(_request: Request) -> Response:
        return JSONResponse({"rules": [
            {"code": r.code, "severity": r.severity, "title": r.title, "checked_by": r.checked_by,
             "meaning": r.meaning, "why": r.why, "fix": r.fix} for r in RULES.values()]})

    async def index(_request: Request) -> Response:
        return HTMLResponse(page.render_page(), headers=PAGE_HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in page.STATIC:
            return Response(status_code=404)
        return Response(page.static_text(name), media_type=page.STATIC[name], headers=PAGE_HEADERS)

    async def webhook(request: Request) -> Response:
        return await _webhook(service, request)

    async def report(request: Request) -> Response:
        repo, _, sha = request.path_params["rest"].rpartition("/")
        record = service.reports.get(repo, sha)
        if record is None:
            return JSONResponse({"error": f"no report for {repo}@{sha}", "status": 404}, status_code=404)
        return JSONResponse(record)

    return [
        Route("/", index), Route("/static/{name}", static), Route("/check", check_page, methods=["POST"]),
        Route("/v1/validate", validate_endpoint, methods=["POST"]), Route("/v1/rules", rules),
        Route("/v1/webhook", webhook, methods=["POST"]), Route("/v1/reports/{rest:path}", report),
        Route("/healthz", lambda _r: JSONResponse({"ok": True})),
    ]


async def _webhook(service: Service, request: Request) -> Response:
    """Check the secret, validate every touched ``.dduf`` of each announced commit, keep and return reports."""
    secret = service.settings.webhook_secret
    if not secret:
        return JSONResponse({"error": "the webhook is not enabled (--webhook-secret-env)", "status": 404},
                            status_code=404)
    given = request.headers.get("x-webhook-secret", "")
    if not hmac.compare_digest(given.encode("utf-8", "replace"), secret.encode("utf-8")):
        logger.warning("webhook: wrong or missing X-Webhook-Secret")
        return JSONResponse({"error": "wrong or missing X-Webhook-Secret", "status": 401}, status_code=401)
    try:
        payload = json.loads(await _read_limited(request, MAX_WEBHOOK_BODY))
    except (ValueError, TooLarge, ClientDisconnect) as e:
        return JSONResponse({"error": f"the payload is not JSON: {e}", "status": 400}, status_code=400)
    results = []
    for commit in commits(payload):
        url = report_path(str(commit["repo"]), str(commit["sha"]))
        pending = {"repo": commit["repo"], "type": commit["type"], "sha": commit["sha"], "report_url": url,
                   "status": "pending"}
        try:
            with service.validator.slot() as slot:
                service.reports.put(pending)
                record = await service.validator.run(slot, _check_and_store, service, commit)
        except TimedOut:
            results.append(pending)  # the worker keeps going and stores the report when it is done
            continue
        except (Busy, DDUFError) as e:
            results.append({**pending, "status": "failed", "error": str(e)})
            service.reports.put(results[-1])
            continue
        results.append(record)
    return JSONResponse({"commits": results}, status_code=202 if any(r["status"] == "pending" for r in results) else 200)


def _check_and_store(service: Service, commit: dict[str, Any]) -> dict[str, Any]:
    record = check_commit(service.settings, commit)
    service.reports.put(record)
    return record


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app for ``settings`` (defaults: only https://huggingface.co/ URLs, no webhook)."""
    service = Service(settings or Settings())

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            service.close()

    app = Starlette(routes=_routes(service), lifespan=lifespan)
    app.state.service = service
    return app


__all__ = ["Settings", "create_app"]
