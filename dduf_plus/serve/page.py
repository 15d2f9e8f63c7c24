"""The page at ``GET /`` (package data: static/index.html, app.css, app.js) and its server-side rendering
of a result, for the form posted without JavaScript. static/app.js renders the same markup in the browser."""

from __future__ import annotations

from functools import cache
from html import escape
from importlib.resources import files
from typing import Any

from ..format.findings import RULES

RESULT_MARKER = "<!-- result -->"
STATIC = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}


@cache
def static_text(name: str) -> str:
    return files(__package__).joinpath("static").joinpath(name).read_text(encoding="utf-8")


def _reference(component: dict[str, Any]) -> str:
    ref = component.get("external")
    if not ref:
        return "in archive"
    where = ref.get("pretrained_model_name_or_path") or "(passed by the caller)"
    return where + (f"/{ref['subfolder']}" if ref.get("subfolder") else "")


def _findings(report: dict[str, Any]) -> str:
    rows = [("error", f) for f in report["errors"]] + [("warning", f) for f in report["warnings"]]
    if not rows:
        return "<p>No findings.</p>"
    body = "".join(
        f"<tr class='{sev}'><td><code>{escape(f['code'])}</code></td><td>{sev}</td>"
        f"<td>{escape(f['entry'] or '')}</td><td>{escape(f['message'])}</td>"
        f"<td>{escape(RULES[f['code']].fix if f['code'] in RULES else '')}</td></tr>" for sev, f in rows)
    return ("<table id='findings'><caption>Findings</caption><thead><tr><th scope='col'>Rule</th>"
            "<th scope='col'>Severity</th><th scope='col'>Entry</th><th scope='col'>Message</th>"
            f"<th scope='col'>Fix</th></tr></thead><tbody>{body}</tbody></table>")


def _components(info: dict[str, Any] | None) -> str:
    if not info:
        return ""
    body = "".join(
        f"<tr><th scope='row'>{escape(name)}</th><td>{escape(str(c.get('class')))}</td>"
        f"<td>{escape(str(c.get('dtype') or '-'))}</td><td>{c.get('parameters', 0):,}</td>"
        f"<td>{c.get('bytes', 0):,}</td><td>{escape(_reference(c))}</td></tr>"
        for name, c in info.get("components", {}).items())
    return ("<table id='components'><caption>Components</caption><thead><tr><th scope='col'>Component</th>"
            "<th scope='col'>Class</th><th scope='col'>Dtype</th><th scope='col'>Parameters</th>"
            f"<th scope='col'>Bytes</th><th scope='col'>References</th></tr></thead><tbody>{body}</tbody></table>")


def render_result(result: dict[str, Any] | None, error: str | None = None) -> str:
    """The result section's HTML for one response of ``POST /v1/validate`` (or an error message)."""
    if error is not None or result is None:
        return f"<p id='verdict' class='invalid' role='alert'>Not checked: {escape(error or 'no input')}</p>"
    report = result["files"][0]
    verdict = "valid" if report["valid"] else "invalid"
    counts = f"{len(report['errors'])} error(s), {len(report['warnings'])} warning(s)"
    return (f"<p id='verdict' class='{verdict}'><strong>{verdict.upper()}</strong> "
            f"<span class='path'>{escape(report['path'])}</span>: {counts}</p>"
            + _findings(report) + _components(result.get("info")))


def render_page(result_html: str = "") -> str:
    return static_text("index.html").replace(RESULT_MARKER, result_html)
