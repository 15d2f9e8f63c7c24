"""The page at ``GET /`` (package data: static/index.html, app.css, app.js) and its server-side rendering
of a result, for the form posted without JavaScript. static/app.js renders the same markup in the browser."""

from __future__ import annotations

from functools import cache
from html import escape
from importlib.resources import files
from typing import Any

from ..format.findings import RULES, SEVERITIES, VERDICT_LABELS, count_text, group_findings

RESULT_MARKER = "<!-- result -->"
STATIC = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}
MAX_LISTED = 50  # entries named in one findings row; past that "and N more" (an archive may have 10,000)


@cache
def static_text(name: str) -> str:
    return files(__package__).joinpath("static").joinpath(name).read_text(encoding="utf-8")


def rich(text: str) -> str:
    """A rule's text as HTML: escaped, its `backquoted` spans as <code> (the rule data is Markdown-ish)."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backquote stays a character
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f"<code>{escape(p)}</code>" if i % 2 else escape(p) for i, p in enumerate(parts))


def _reference(name: str, component: dict[str, Any]) -> str:
    ref = component.get("external")
    if not ref:
        return "in archive"
    from ..refs.spec import describe_reference

    return describe_reference(name, ref)


def _sizes(component: dict[str, Any]) -> tuple[str, str]:
    """(parameters, bytes) cells: a referenced component has no tensors in the archive, so it shows the
    size its reference records, not 0."""
    ref = component.get("external")
    if not ref:
        return f"{component.get('parameters') or 0:,}", f"{component.get('bytes') or 0:,}"
    files = ref.get("files") if isinstance(ref.get("files"), dict) else {}
    size = sum(r["size"] for r in files.values() if isinstance(r, dict) and type(r.get("size")) is int)
    return "referenced", (f"{size:,} (referenced)" if files else "referenced")


def _entries(entries: list[str]) -> str:
    shown = ", ".join(entries[:MAX_LISTED])
    return shown + (f" and {len(entries) - MAX_LISTED} more" if len(entries) > MAX_LISTED else "")


def _by_severity(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(severity, finding) for every finding of a ``--json`` report: its ``errors``, ``warnings``, ``infos``."""
    return [(s, f) for s in SEVERITIES for f in report.get(SEVERITIES[s].plural, [])]


def counts(report: dict[str, Any]) -> str:
    """``0 errors, 1 warning, 2 infos``: the words of the shared table (findings.SEVERITIES), as the CLI."""
    return count_text({s: len(report.get(SEVERITIES[s].plural, [])) for s in SEVERITIES}, all_severities=True)


def labels() -> dict[str, Any]:
    """What ``/v1/rules`` sends app.js so that it shows the same words: severities and verdicts."""
    return {"severities": {s.name: {"label": s.label, "plural": s.plural, "meaning": s.meaning}
                           for s in SEVERITIES.values()},
            "verdicts": {"valid": VERDICT_LABELS[True], "invalid": VERDICT_LABELS[False]}}


def _findings(report: dict[str, Any]) -> str:
    """One row per rule (findings grouped, entries listed once); JSON keeps every finding."""
    groups = group_findings([{**f, "severity": severity} for severity, f in _by_severity(report)])
    if not groups:
        return "<p>No findings.</p>"
    rows = []
    for g in groups:
        message = escape(g.message)
        if not g.same_message:
            message += "<ul>" + "".join(f"<li>{escape(f.entry or '')}: {escape(f.message)}</li>"
                                        for f in g.findings[:MAX_LISTED]) + "</ul>"
        count = f" ({len(g.findings)})" if len(g.findings) > 1 else ""
        fix = rich(RULES[g.code].fix) if g.code in RULES else ""
        label = SEVERITIES[g.severity].label if g.severity in SEVERITIES else g.severity
        rows.append(f"<tr class='{escape(g.severity)}'><td><code>{escape(g.code)}</code>{count}</td><td>{escape(label)}</td>"
                    f"<td>{escape(_entries(g.entries))}</td><td>{message}</td><td>{fix}</td></tr>")
    return ("<table id='findings'><caption>Findings</caption><thead><tr><th scope='col'>Rule</th>"
            "<th scope='col'>Severity</th><th scope='col'>Entries</th><th scope='col'>Message</th>"
            f"<th scope='col'>Fix</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _components(info: dict[str, Any] | None) -> str:
    if not info:
        return ""
    rows = []
    for name, c in info.get("components", {}).items():
        parameters, size = _sizes(c)
        rows.append(f"<tr><th scope='row'>{escape(name)}</th><td>{escape(str(c.get('class')))}</td>"
                    f"<td>{escape(str(c.get('dtype') or '-'))}</td><td>{parameters}</td>"
                    f"<td>{size}</td><td>{escape(_reference(name, c))}</td></tr>")
    return ("<table id='components'><caption>Components</caption><thead><tr><th scope='col'>Component</th>"
            "<th scope='col'>Class</th><th scope='col'>Dtype</th><th scope='col'>Parameters</th>"
            f"<th scope='col'>Bytes</th><th scope='col'>References</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def adapter_targets(a: dict[str, Any]) -> str:
    """``unet: 48 modules, rank 4; text_encoder: ...`` (app.js's adapterTargets says the same)."""
    return "; ".join(f"{c}: {t.get('modules')} modules, rank {'/'.join(map(str, t.get('ranks') or []))}"
                     for c, t in (a.get("targets") or {}).items())


def adapter_metadata(a: dict[str, Any]) -> str:
    """The trainer's title, architecture, base version and trigger words (app.js's adapterMetadata)."""
    meta = a.get("metadata") or {}
    parts = [f"{k}: {meta[k]}" for k in ("modelspec.title", "modelspec.architecture", "ss_base_model_version")
             if k in meta]
    if a.get("trigger_words"):
        parts.append("trigger words: " + ", ".join(a["trigger_words"]))
    return "; ".join(parts) or "-"


def _adapters(info: dict[str, Any] | None) -> str:
    adapters = (info or {}).get("adapters") or []
    if not adapters:
        return ""
    rows = [f"<tr><th scope='row'>{escape(str(a.get('name')))}</th><td>{escape(str(a.get('layout')))}</td>"
            f"<td>{escape(str(a.get('weight')))}</td><td>{escape(adapter_targets(a))}</td>"
            f"<td>{escape(adapter_metadata(a))}</td></tr>" for a in adapters]
    return ("<table id='adapters'><caption>LoRA adapters</caption><thead><tr><th scope='col'>Adapter</th>"
            "<th scope='col'>Layout</th><th scope='col'>Weight</th><th scope='col'>Targets</th>"
            f"<th scope='col'>Trainer metadata</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def render_result(result: dict[str, Any] | None, error: str | None = None) -> str:
    """The result section's HTML for one response of ``POST /v1/validate`` (or an error message)."""
    if error is not None or result is None:
        return f"<p id='verdict' class='invalid' role='alert'>Not checked: {escape(error or 'no input')}</p>"
    report = result["files"][0]
    verdict = "valid" if report["valid"] else "invalid"
    return (f"<p id='verdict' class='{verdict}'><strong>{VERDICT_LABELS[bool(report['valid'])]}</strong> "
            f"<span class='path'>{escape(report['path'])}</span>: {counts(report)}</p>"
            + _findings(report) + _components(result.get("info")) + _adapters(result.get("info")))


def render_page(result_html: str = "") -> str:
    return static_text("index.html").replace(RESULT_MARKER, result_html)
