"""A small Hugging Face Hub-compatible HTTP server on 127.0.0.1, for tests with the real huggingface_hub client.

Implements only what ``hf_hub_download``, ``snapshot_download``, ``HfApi.model_info`` and
``HfApi.list_repo_files`` / ``list_repo_tree`` ask for:

- ``GET /api/models/{repo}[/revision/{rev}]``: id, sha (the commit), siblings (rfilename, size, blobId, lfs);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the recursive listing (files and folders, with lfs records);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: X-Repo-Commit, ETag (git blob sha1, or the sha256 of LFS
  files, also in X-Linked-Etag with X-Linked-Size), ``Range`` (206);
- errors as the Hub answers them: 404 with ``X-Error-Code`` RepoNotFound / RevisionNotFound / EntryNotFound,
  which huggingface_hub maps to its RepositoryNotFoundError / RevisionNotFoundError / EntryNotFoundError.

Every request is recorded (``requests``: (method, path)) with the body bytes sent, so tests can assert what
was fetched, and that an offline load made no request at all."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_EXTENSIONS = (".safetensors", ".bin", ".dduf", ".model", ".pt", ".ckpt", ".onnx", ".msgpack", ".zst")


class _File:
    def __init__(self, data: bytes):
        self.data = data
        self.size = len(data)
        self.git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        self.lfs: str | None = None  # the sha256 of an LFS file (Repo.commit decides, by name and size)


class Repo:
    """One model repo: branches/tags -> commit, commit -> {path: _File}."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.refs: dict[str, str] = {}
        self.commits: dict[str, dict[str, _File]] = {}

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        tree: dict[str, _File] = {}
        for path, data in sorted(files.items()):
            f = _File(data)
            if path.endswith(LFS_EXTENSIONS) or f.size >= 10_000_000:  # the Hub's .gitattributes rules
                f.lfs = hashlib.sha256(data).hexdigest()
            tree[path] = f
        digest = hashlib.sha1(json.dumps(sorted((p, f.git_sha1) for p, f in tree.items())).encode()
                              + branch.encode()).hexdigest()
        self.commits[digest] = tree
        self.refs[branch] = digest
        return digest

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def folder_files(folder: str | os.PathLike, prefix: str = "") -> dict[str, bytes]:
    """Every file under ``folder`` as {repo path: bytes}."""
    root = Path(folder)
    return {prefix + p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class HubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.body_bytes = 0
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def add(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit ``files`` to ``repo_id`` on ``branch``; returns the commit sha."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        return repo.commit(files, branch)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.body_bytes = 0

    def downloads(self) -> list[str]:
        """Repo paths fetched with GET .../resolve/... (in order)."""
        out = []
        for method, path in self.requests:
            m = re.match(r"^/[^/]+/[^/]+/resolve/[^/]+/(.+)$", path)
            if method == "GET" and m:
                out.append(unquote(m[1]))
        return out

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._route("HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    # --- routing ---------------------------------------------------------------------------------------
    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        with self.server.lock:
            self.server.requests.append((method, path))
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?/?$", path)
        if m:
            return self._info(unquote(m[1]), unquote(m[2]) if m[2] else "main", method)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            return self._tree(unquote(m[1]), unquote(m[2]), unquote(m[3] or ""), method)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(unquote(m[1]), unquote(m[2]), unquote(m[3]), method)
        self._error(404, "RepoNotFound", "unknown endpoint")

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, _File]] | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return commit, repo.commits[commit]

    def _info(self, repo_id: str, revision: str, method: str) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        commit, tree = found
        siblings = []
        for p, f in tree.items():
            s: dict[str, Any] = {"rfilename": p, "size": f.size, "blobId": f.git_sha1}
            if f.lfs:
                s["lfs"] = {"sha256": f.lfs, "size": f.size, "pointerSize": 134}
            siblings.append(s)
        self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "siblings": siblings,
                    "tags": [], "downloads": 0, "likes": 0}, method)

    def _tree(self, repo_id: str, revision: str, sub: str, method: str) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        _commit, tree = found
        prefix = sub.rstrip("/") + "/" if sub else ""
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        for p, f in tree.items():
            if not p.startswith(prefix):
                continue
            parts = p.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(parts[:i]))
            rec: dict[str, Any] = {"type": "file", "oid": f.git_sha1, "size": f.size, "path": p}
            if f.lfs:
                rec["lfs"] = {"oid": f.lfs, "size": f.size, "pointerSize": 134}
            out.append(rec)
        out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(folders)
                if d.startswith(prefix)]
        self._json(out, method)

    def _resolve(self, repo_id: str, revision: str, filename: str, method: str) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        commit, tree = found
        f = tree.get(filename)
        if f is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist on {revision}", commit)
            return
        start, end, status = 0, f.size - 1, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if method == "GET" and match and int(match[1]) < f.size:
            start, end, status = int(match[1]), min(int(match[2]) if match[2] else f.size - 1, f.size - 1), 206
        body = f.data[start:end + 1] if method == "GET" else b""
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Accept-Ranges", "bytes")
        if f.lfs:
            self.send_header("ETag", f'"{f.lfs}"')
            self.send_header("X-Linked-Etag", f'"{f.lfs}"')
            self.send_header("X-Linked-Size", str(f.size))
        else:
            self.send_header("ETag", f'"{f.git_sha1}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if body:
            with self.server.lock:
                self.server.body_bytes += len(body)
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

    # --- answers ---------------------------------------------------------------------------------------
    def _json(self, value: Any, method: str) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method == "GET":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)
