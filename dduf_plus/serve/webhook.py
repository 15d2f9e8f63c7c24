"""Hugging Face Hub webhooks: which ``.dduf`` files a pushed commit touched, their reports, and where the
reports are kept.

A ``repo.content`` event names the repo (``repo.type``, ``repo.name``) and the refs it moved
(``updatedRefs``: ``ref``, ``oldSha``, ``newSha``; ``repo.headSha`` otherwise). The files of a commit come
from the Hub API (``/api/{models,datasets,spaces}/{repo}/revision/{sha}?blobs=true``); a file is touched when
it is new or its blob differs from the one at ``oldSha``. Each is validated by range reads of
``{endpoint}/{repo}/resolve/{sha}/{file}``, under the same URL policy as ``POST /v1/validate``.

A report records whether its repo is private (``repo.private`` of the payload; missing counts as private):
the server reads private repos with its own token, so their reports are shown only to requests carrying
the webhook secret (``GET /v1/reports/...`` answers 404 otherwise)."""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import DDUFError
from ..storage.confined import Confined
from .jobs import check_url_source
from .safety import fetch_json
from .settings import Settings

logger = logging.getLogger(__name__)
SHA = re.compile(r"[0-9a-f]{40}")
REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
REPO_TYPES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
MAX_FILES = 64  # .dduf files validated per commit; a push with more is reported as truncated


def is_repo(name: object) -> bool:
    return isinstance(name, str) and bool(REPO.fullmatch(name)) and ".." not in name


def commits(payload: Any) -> list[dict[str, Any]]:
    """The commits a webhook payload announces: [{type, repo, sha, old_sha, private}] (empty: nothing to check)."""
    if not isinstance(payload, dict):
        return []
    event, repo = payload.get("event"), payload.get("repo")
    if not isinstance(event, dict) or not isinstance(repo, dict) or event.get("scope") != "repo.content":
        return []
    repo_type, name = repo.get("type", "model"), repo.get("name")
    if repo_type not in REPO_TYPES or not is_repo(name):
        return []
    found: list[dict[str, Any]] = []
    private = repo.get("private") is not False  # fail closed: only an explicit false makes reports public
    refs = payload.get("updatedRefs")
    for ref in refs if isinstance(refs, list) else []:
        new, old = (ref.get("newSha"), ref.get("oldSha")) if isinstance(ref, dict) else (None, None)
        if isinstance(new, str) and SHA.fullmatch(new) and all(c["sha"] != new for c in found):
            found.append({"type": repo_type, "repo": name, "sha": new, "private": private,
                          "old_sha": old if isinstance(old, str) and SHA.fullmatch(old) else None})
    head = repo.get("headSha")
    if not found and isinstance(head, str) and SHA.fullmatch(head):
        found.append({"type": repo_type, "repo": name, "sha": head, "old_sha": None, "private": private})
    return found


def _blobs(settings: Settings, repo_type: str, repo: str, sha: str) -> dict[str, str]:
    """{file: blob id (LFS sha256 when there is one)} of the ``.dduf`` files at ``sha``."""
    url = f"{settings.endpoint}api/{repo_type}s/{repo}/revision/{sha}?blobs=true"
    info = fetch_json(url, settings)
    siblings = info.get("siblings") if isinstance(info, dict) else None
    found: dict[str, str] = {}
    for s in siblings if isinstance(siblings, list) else []:
        name = s.get("rfilename") if isinstance(s, dict) else None
        if isinstance(name, str) and name.endswith(".dduf"):
            lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
            found[name] = str(lfs.get("sha256") or s.get("blobId") or "")
    return found


def touched(settings: Settings, commit: dict[str, Any]) -> list[str]:
    """The ``.dduf`` files new or changed in ``commit`` (all of them when the parent cannot be listed)."""
    now = _blobs(settings, commit["type"], commit["repo"], commit["sha"])
    before: dict[str, str] = {}
    if commit.get("old_sha"):
        try:
            before = _blobs(settings, commit["type"], commit["repo"], commit["old_sha"])
        except DDUFError:
            before = {}
    return sorted(f for f, blob in now.items() if not blob or before.get(f) != blob)


def check_commit(settings: Settings, commit: dict[str, Any], verify: bool = False) -> dict[str, Any]:
    """The record kept for one commit: each touched file's ``validate --json`` report and ``info``."""
    files = touched(settings, commit)
    record: dict[str, Any] = {"repo": commit["repo"], "type": commit["type"], "sha": commit["sha"],
                              "report_url": report_path(commit["repo"], commit["sha"]),
                              "private": commit.get("private") is not False, "status": "done",
                              "valid": True, "truncated": len(files) > MAX_FILES,
                              "files": [], "info": {}, "unreadable": []}
    base = f"{settings.endpoint}{REPO_TYPES[commit['type']]}{commit['repo']}/resolve/{commit['sha']}/"
    for name in files[:MAX_FILES]:
        url = base + quote(name, safe="/")
        try:
            result = check_url_source(url, verify, False, settings, True)
        except DDUFError as e:
            record["unreadable"].append({"path": url, "error": str(e)})
            record["valid"] = False
            continue
        record["files"].extend(result["files"])
        record["info"][name] = result["info"]
        record["valid"] = record["valid"] and result["files"][0]["valid"]
    logger.info("webhook %s@%s: %d .dduf file(s), valid=%s", commit["repo"], commit["sha"][:12],
                len(files), record["valid"])
    return record


def report_path(repo: str, sha: str) -> str:
    return f"/v1/reports/{repo}/{sha}"


class ReportStore:
    """Reports by (repo, sha): in memory, and as ``{reports_dir}/{owner}/{name}/{sha}.json`` when a folder
    is configured (written atomically, confined to that folder)."""

    def __init__(self, folder: Path | None):
        self._memory: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._root = Confined(folder) if folder is not None else None

    def _file(self, repo: str, sha: str) -> Path | None:
        if self._root is None or not is_repo(repo) or not SHA.fullmatch(sha):
            return None
        return self._root.path(*repo.split("/"), f"{sha}.json")

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._memory[(record["repo"], record["sha"])] = record
        path = self._file(record["repo"], record["sha"])
        if path is not None and record.get("status") == "done":
            assert self._root is not None
            self._root.write_bytes(path, json.dumps(record, ensure_ascii=True, indent=1).encode())

    def get(self, repo: str, sha: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._memory.get((repo, sha))
        if record is not None:
            return record
        path = self._file(repo, sha)
        if path is None or not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
