"""The ASGI app of ``dduf serve`` (Starlette): routes, limits, and the mapping of failures to HTTP statuses.

    POST /v1/validate      a raw or multipart upload, or JSON {"url": ...}; ?verify=true, ?strict=true
    GET  /v1/rules         the rule catalogue (dduf_plus.format.findings)
    POST /v1/webhook       Hugging Face Hub webhook (X-Webhook-Secret); reports per commit
    GET  /v1/reports/{repo}/{sha}
    GET  /                 the page; POST /check renders a result server-side (no JavaScript needed)

Statuses: 200 a verdict (valid or not), 400 a bad request, 401 a wrong webhook secret, 403 a URL refused by
policy, 404 unknown report, 408 the body took too long or trickled, 413 too large, 421 a ``Host`` header not
served here, 429 too many uploads arriving from this client, 502 the URL could not be read, 503 busy
(Retry-After), 504 the validation ran past the time limit, 507 not enough free disk for the upload.

Order of admission: a request's body is received first (its place in :class:`~.uploads.Intake`, within
the body deadline and minimum rate), and only a whole body takes a validation slot: clients that trickle
their bodies never hold a worker or a queue place."""

from __future__ import annotations

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
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import DDUFError, DDUFIOError
from ..format.findings import RULES
from . import page
from .jobs import Busy, TimedOut, Validator, check_file, check_url_source
from .safety import URLRefused, host_allowed
from .settings import Settings
from .uploads import (
    EMPTY,
    ZST_REFUSED,
    ZSTD_MAGIC,
    BadForm,
    Crowded,
    Intake,
    NoSpace,
    SlowBody,
    Ticket,
    TooLarge,
    Upload,
    display_name,
    looks_like_form,
    peek,
    spool_form,
    spool_raw,
    timed,
)
from .webhook import ReportStore, check_commit, commits, report_path

logger = logging.getLogger(__name__)
MAX_JSON_BODY = 64 << 10
MAX_WEBHOOK_BODY = 1 << 20
TRUE = ("1", "true", "yes", "on")  # the project's boolean words (HF_HUB_OFFLINE, DDUF_PLUS_ALLOW_PRIVATE_URLS)
FALSE = ("0", "false", "no", "off")
FORM_TOO_LARGE = ("a form body is at most 64 KiB; send an archive as the body (curl --data-binary @x.dduf URL) or "
                  "as a multipart field named file (curl -F file=@x.dduf URL)")
# the page loads only its own script and style; archive content is rendered as text, and cannot be framed
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class NoInput(BadForm):
    """Neither a file nor a URL (HTTP 400)."""


_STATUSES: tuple[tuple[type[Exception], int], ...] = (
    (URLRefused, 403), (DDUFIOError, 502), (DDUFError, 400), (Busy, 503), (TimedOut, 504), (TooLarge, 413),
    (BadForm, 400), (SlowBody, 408), (NoSpace, 507))


def _status(error: BaseException) -> int:
    """The HTTP status for a failure; anything unexpected is re-raised (a 500, logged by the server)."""
    if isinstance(error, Crowded):
        return 429 if error.per_client else 503
    for kind, status in _STATUSES:
        if isinstance(error, kind):
            return status
    raise error


def _error(error: BaseException) -> JSONResponse:
    status = _status(error)
    return JSONResponse({"error": str(error), "status": status}, status_code=status, headers=_error_headers(status))


def _error_headers(status: int) -> dict[str, str]:
    """A refused request's body may be unread (too large, too slow, no place for it): the connection is
    closed after the answer, not kept alive for the rest of it."""
    headers = {"Connection": "close"}
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return headers


def _for_log(url: str) -> str:
    try:
        parts = urlsplit(url)  # no query string or fragment: signed URLs carry tokens there
    except ValueError:
        return "(not a URL)"
    return f"{parts.scheme}://{parts.hostname}{parts.path}"


async def _read_limited(chunks: AsyncIterator[bytes], limit: int, message: str = "") -> bytes:
    """A small body (JSON, a URL-encoded form, a webhook payload), refused past ``limit`` while reading."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise TooLarge(message or f"this request body is at most {limit} bytes")
    return bytes(body)


def _flag(name: str, *values: Any) -> bool:
    """A boolean option from the first of ``values`` given (a form/JSON field, then the query string):
    true/false, 1/0, yes/no, on/off (any case); anything else is refused, never read as false."""
    for value in values:
        if value is None:
            continue
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in TRUE or text in FALSE:
            return text in TRUE
        raise BadForm(f"{name}={str(value)[:32]!r}: give true or false (or 1/0, yes/no, on/off)")
    return False


def _zst(upload: Upload) -> bool:
    """Whether an upload is zstd-compressed, by name or by its first bytes."""
    if upload.name.endswith(".zst"):
        return True
    assert upload.path is not None
    with open(upload.path, "rb") as f:
        return f.read(4) == ZSTD_MAGIC


class HostCheck:
    """Answers 421 to a request whose ``Host`` is not served here (:func:`.safety.host_allowed`): a page on
    another site cannot reach a local instance by rebinding its own name to 127.0.0.1."""

    def __init__(self, app: ASGIApp, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and not host_allowed(host, self.settings):
                logger.warning("refused Host %r (not an allowed host)", host[:100])
                response = JSONResponse({"error": f"Host {host[:100]!r} is not served here (dduf serve "
                                         "--allowed-host NAME serves it)", "status": 421}, status_code=421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Service:
    """State shared by the routes: settings, the validator, the private temporary folder, the reports."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.validator = Validator(settings)
        self.intake = Intake(settings.uploads, settings.uploads_per_client, settings.min_upload_rate)
        self.reports = ReportStore(settings.reports_dir)
        self.temp = Path(tempfile.mkdtemp(prefix="dduf-serve-", dir=settings.temp_root))

    def close(self) -> None:
        self.validator.close()
        shutil.rmtree(self.temp, ignore_errors=True)

    def body(self, request: Request, ticket: Ticket | None = None) -> AsyncIterator[bytes]:
        """The request's body, cut off past the body deadline or below the minimum rate."""
        s = self.settings
        return timed(request.stream(), s.body_timeout, s.min_upload_rate, s.upload_grace, ticket)

    async def receive(self, request: Request) -> tuple[Upload | None, dict[str, Any]]:
        """(an upload or None, the JSON/form fields): the body, received within its limits, before any slot."""
        declared = request.headers.get("content-length", "")
        limit = self.settings.max_upload
        if declared.isdigit() and int(declared) > limit + (64 << 10):
            raise TooLarge(f"the upload ({declared} bytes) is over the limit of {limit} bytes")
        if declared.isdigit() and shutil.disk_usage(self.temp).free - int(declared) < self.settings.min_free_disk:
            raise NoSpace(f"not enough free disk space for an upload of {declared} bytes now")
        with self.intake.admit(request.client.host if request.client else "-") as ticket:
            return await self._body(request, self.body(request, ticket))

    async def _body(self, request: Request, body: AsyncIterator[bytes]) -> tuple[Upload | None, dict[str, Any]]:
        ctype = request.headers.get("content-type", "")  # the multipart boundary is case-sensitive
        kind, s = ctype.split(";", 1)[0].strip().lower(), self.settings
        if kind == "application/json":
            try:
                fields = json.loads(await _read_limited(body, MAX_JSON_BODY))
            except ValueError as e:
                raise BadForm(f"the body is not JSON: {e}") from None
            if not isinstance(fields, dict):
                raise BadForm('expected a JSON object {"url": ...}')
            return None, fields
        if kind == "application/x-www-form-urlencoded":
            head, body = await peek(body, 64)
            if looks_like_form(head):  # else an archive sent by curl --data-binary (its default type): raw
                text = (await _read_limited(body, MAX_JSON_BODY, FORM_TOO_LARGE)).decode("utf-8", "replace")
                return None, {k: v[0] for k, v in parse_qs(text, max_num_fields=8).items()}
        if kind == "multipart/form-data":
            upload = await spool_form(body, ctype, self.temp, s.max_upload, s.max_form_fields, s.min_free_disk)
            return (upload if upload.path else None), dict(upload.fields)
        name = display_name(request.query_params.get("name"))
        return await spool_raw(body, self.temp, name, s.max_upload, s.min_free_disk), {}

    async def check(self, request: Request) -> dict[str, Any]:
        """Validate what a request holds; raises what :func:`_status` maps."""
        upload, fields = await self.receive(request)
        try:
            verify, strict = (_flag(k, fields.get(k), request.query_params.get(k)) for k in ("verify", "strict"))
            url = fields.get("url")
            if upload is not None and _zst(upload):
                raise BadForm(ZST_REFUSED)  # decompressing would write outside the app's folder, and lets bombs in
            if upload is None and (not isinstance(url, str) or not url.strip()):
                raise NoInput(f"no `file` field and no url: {EMPTY.split(': ', 1)[1]}" if fields else EMPTY)
            slot = self.validator.slot()  # only now: a body that is still arriving holds no slot
        except BaseException:
            if upload is not None:
                upload.discard()
            raise
        with slot:
            if upload is not None:
                assert upload.path is not None
                logger.info("validate upload %s (%d bytes)", upload.name, upload.size)
                return await self.validator.run(slot, check_file, upload.path, upload.name, verify, strict,
                                                cleanup=upload.discard)
            assert isinstance(url, str)
            logger.info("validate url %s", _for_log(url.strip()))
            # no Hub token here: a stranger's URL must not read what the server's token can (private repos)
            return await self.validator.run(slot, check_url_source, url.strip(), verify, strict, self.settings, False)

    def may_read_report(self, request: Request, record: dict[str, Any]) -> bool:
        """A report of a private repo (or one whose visibility the Hub did not say) is shown only to a request
        carrying the webhook secret; a public repo's to anyone."""
        return record.get("private") is False or _secret_ok(self.settings, request)


def _secret_ok(settings: Settings, request: Request) -> bool:
    secret = settings.webhook_secret
    given = request.headers.get("x-webhook-secret", "")
    return bool(secret) and hmac.compare_digest(given.encode("utf-8", "replace"), (secret or "").encode("utf-8"))


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
            html = page.render_result(None, "choose a .dduf file or paste a URL" if isinstance(e, NoInput) else str(e))
        headers = PAGE_HEADERS if status == 200 else {**PAGE_HEADERS, **_error_headers(status)}
        return HTMLResponse(page.render_page(html), status_code=status, headers=headers)

    async def rules(_request: Request) -> Response:
        return JSONResponse({"rules": [
            {"code": r.code, "severity": r.severity, "title": r.title, "checked_by": r.checked_by,
             "meaning": r.meaning, "why": r.why, "fix": r.fix} for r in RULES.values()], **page.labels()})

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
        if record is None or not service.may_read_report(request, record):  # 404 either way: existence is private too
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
    if not _secret_ok(service.settings, request):
        logger.warning("webhook: wrong or missing X-Webhook-Secret")
        return JSONResponse({"error": "wrong or missing X-Webhook-Secret", "status": 401}, status_code=401)
    try:
        payload = json.loads(await _read_limited(service.body(request), MAX_WEBHOOK_BODY))
    except (ValueError, TooLarge, SlowBody, ClientDisconnect) as e:
        return JSONResponse({"error": f"the payload is not JSON: {e}", "status": 400}, status_code=400)
    results = []
    for commit in commits(payload):
        url = report_path(str(commit["repo"]), str(commit["sha"]))
        pending = {"repo": commit["repo"], "type": commit["type"], "sha": commit["sha"], "report_url": url,
                   "private": commit["private"], "status": "pending"}
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
    try:
        record = check_commit(service.settings, commit)
    except DDUFError as e:  # the hub could not be read: the report says so (after a 202 it was left "pending")
        pending = service.reports.get(str(commit["repo"]), str(commit["sha"])) or {}
        service.reports.put({**pending, "status": "failed", "error": str(e)})
        raise
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

    app = Starlette(routes=_routes(service), lifespan=lifespan,
                    middleware=[Middleware(HostCheck, settings=service.settings)])
    app.state.service = service
    return app


__all__ = ["Settings", "create_app"]
