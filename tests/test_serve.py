"""``dduf serve``: the real app under uvicorn on 127.0.0.1, talked to with httpx. Every response is compared
with what ``dduf validate --json`` / ``dduf info --json`` print for the same file or URL."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_app import running  # noqa: E402
from servers import FileServer  # noqa: E402

from dduf_plus.cli import main  # noqa: E402
from dduf_plus.serve import Settings  # noqa: E402
from dduf_plus.serve.safety import PeerCheckedSource, URLRefused, address_problem, check_url  # noqa: E402

HOSTILE = Path(__file__).resolve().parent.parent / "fixtures" / "hostile"
CASES: dict[str, dict] = json.loads((HOSTILE / "cases.json").read_text())
ALL = ["valid.dduf", *sorted(CASES)]


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    main(list(argv))
    return json.loads(capsys.readouterr().out)


def expected(capsys, monkeypatch, tmp_path: Path, source: Path | str, name: str, verify: bool) -> dict:
    """What the CLI says about ``source`` under ``name`` (a copy in tmp_path, run from there), or a URL."""
    if isinstance(source, Path):
        shutil.copy(source, tmp_path / name)
        monkeypatch.chdir(tmp_path)
        source = name
    files = cli_json(capsys, "validate", "--json", *(["--verify"] if verify else []), str(source))["files"]
    info = cli_json(capsys, "info", "--json", str(source)) if files[0]["valid"] else None
    return {"files": files, "info": info}


@pytest.fixture(scope="module")
def corpus():
    with FileServer(HOSTILE) as files:
        yield files


@pytest.fixture(scope="module")
def service(corpus):
    settings = Settings(allow_private=True, allow_url_prefixes=(corpus.url(),))
    with running(settings) as (base, svc):
        with httpx.Client(base_url=base, timeout=60) as client:
            yield client, svc, corpus


@pytest.mark.parametrize("name", ALL)
def test_upload_matches_the_cli(service, capsys, monkeypatch, tmp_path, name):
    client, svc, _ = service
    verify = CASES.get(name, {}).get("verify", False)
    query = "?verify=true" if verify else ""
    raw = client.post(f"/v1/validate{query}{'&' if query else '?'}name={name}", content=(HOSTILE / name).read_bytes())
    form = client.post(f"/v1/validate{query}", files={"file": (name, (HOSTILE / name).read_bytes())})
    want = expected(capsys, monkeypatch, tmp_path, HOSTILE / name, name, verify)
    assert raw.status_code == form.status_code == 200, raw.text
    assert raw.json() == form.json() == want
    assert list(svc.temp.iterdir()) == []  # the spooled uploads are gone


@pytest.mark.parametrize("name", ["valid.dduf", "absolute-name.dduf", "overlapping-entries.dduf", "crc-mismatch.dduf"])
def test_url_matches_the_cli(service, capsys, monkeypatch, tmp_path, name):
    client, _, corpus = service
    if not (HOSTILE / name).exists():
        pytest.skip(f"{name} not in the corpus")
    url = corpus.url(name)
    got = client.post("/v1/validate?verify=true", json={"url": url})
    assert got.status_code == 200, got.text
    assert got.json() == expected(capsys, monkeypatch, tmp_path, url, name, True)


def test_packed_pipeline_info(service, packed, capsys, monkeypatch, tmp_path):
    client, _, _ = service
    got = client.post("/v1/validate?name=tiny-sd.dduf&strict=true", content=packed["tiny-sd"].read_bytes())
    assert got.status_code == 200
    body = got.json()
    assert body == expected(capsys, monkeypatch, tmp_path, packed["tiny-sd"], "tiny-sd.dduf", False)
    assert body["info"]["components"]["unet"]["class"] == "UNet2DConditionModel"


def test_rules_are_the_rule_table(service):
    from dduf_plus.format.findings import RULES

    rules = service[0].get("/v1/rules").json()["rules"]
    assert [r["code"] for r in rules] == list(RULES)
    assert all(r["fix"] == RULES[r["code"]].fix and r["severity"] == RULES[r["code"]].severity for r in rules)


def test_bad_requests(service):
    client = service[0]
    assert client.post("/v1/validate", json=[1]).status_code == 400
    assert client.post("/v1/validate", content=b"{", headers={"Content-Type": "application/json"}).status_code == 400
    assert client.post("/v1/validate", json={}).status_code == 400
    zst = client.post("/v1/validate?name=x.dduf.zst", content=b"\x28\xb5\x2f\xfd" + b"\0" * 64)
    assert zst.status_code == 400 and "dduf decompress" in zst.json()["error"]
    assert list(service[1].temp.iterdir()) == []
    assert client.post("/v1/validate", json={"url": "file:///etc/passwd"}).status_code == 403
    missing = client.post("/v1/validate", json={"url": service[2].url("nope.dduf")})
    assert missing.status_code == 502 and "404" in missing.json()["error"]


# --- SSRF -------------------------------------------------------------------------------------------------
def test_url_policy_units():
    hub = Settings()
    for url in ("https://huggingface.co.evil.example/x.dduf", "https://evil.example/https://huggingface.co/",
                "https://user@huggingface.co/x.dduf", "ftp://huggingface.co/x.dduf", "http://huggingface.co/x.dduf",
                "https://huggingface.co:8443/x.dduf"):
        with pytest.raises(URLRefused):
            check_url(url, hub)
    stretched = Settings(allow_url_prefixes=("https://huggingface.co",))
    with pytest.raises(URLRefused):
        check_url("https://huggingface.co.evil.example/x.dduf", stretched)
    for address in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "::1", "fe80::1",
                    "::ffff:127.0.0.1", "0.0.0.0", "100.64.0.1", "fd00::1"):
        assert address_problem(address), address
    assert address_problem("8.8.8.8") is None and address_problem("2606:4700::1111") is None


def test_loopback_refused_without_allow_private(corpus):
    with running(Settings(allow_url_prefixes=(corpus.url(),))) as (base, _):
        corpus.reset()
        got = httpx.post(f"{base}/v1/validate", json={"url": corpus.url("valid.dduf")})
        assert got.status_code == 403 and "loopback" in got.json()["error"]
        default = httpx.post(f"{base}/v1/validate", json={"url": "http://169.254.169.254/latest/meta-data"})
        assert default.status_code == 403
    assert corpus.gets == 0  # refused before any request


def test_connected_peer_is_checked_again(corpus):
    """A name that resolved to a public address at the check but connects to a private one (rebinding)."""
    with pytest.raises(URLRefused, match="loopback"):
        PeerCheckedSource(corpus.url("valid.dduf"), Settings())


class _Redirect(http.server.BaseHTTPRequestHandler):
    target = ""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(302)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_redirect_to_another_host_refused(corpus):
    _Redirect.target = corpus.url("valid.dduf").replace("127.0.0.1", "localhost")
    redirector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
    threading.Thread(target=redirector.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        with running(Settings(allow_private=True, allow_url_prefixes=(f"http://127.0.0.1:{redirector.server_port}/",))) as (base, _):
            corpus.reset()
            got = httpx.post(f"{base}/v1/validate", json={"url": f"http://127.0.0.1:{redirector.server_port}/x.dduf"})
    finally:
        redirector.shutdown()
        redirector.server_close()
    assert got.status_code == 502 and "another origin" in got.json()["error"]
    assert corpus.gets == 0


# --- limits -------------------------------------------------------------------------------------------------
def test_upload_size_limit(tmp_path):
    data = (HOSTILE / "valid.dduf").read_bytes()
    with running(Settings(max_upload=len(data) - 1, temp_root=tmp_path)) as (base, svc):
        raw = httpx.post(f"{base}/v1/validate", content=data)
        form = httpx.post(f"{base}/v1/validate", files={"file": ("v.dduf", data)})
        chunked = httpx.post(f"{base}/v1/validate", content=iter([data[:4096], data[4096:]]))  # no Content-Length
        ok = httpx.post(f"{base}/v1/validate", content=data[: len(data) - 1])
        assert raw.status_code == form.status_code == chunked.status_code == 413, (raw.text, form.text, chunked.text)
        assert ok.status_code == 200 and not ok.json()["files"][0]["valid"]
        assert list(svc.temp.iterdir()) == []
        assert [p for p in tmp_path.iterdir()] == [svc.temp]  # nothing outside the app's own folder


def test_client_disconnect_removes_the_spool(tmp_path):
    with running(Settings(temp_root=tmp_path)) as (base, svc):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                         b"Content-Length: 10000000\r\n\r\n" + b"PK" * 300_000)
            deadline = time.monotonic() + 10
            while not list(svc.temp.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert list(svc.temp.iterdir()), "the upload was not being spooled"
        deadline = time.monotonic() + 10
        while list(svc.temp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(svc.temp.iterdir()) == []


def test_concurrency_limit_answers_503():
    arrived, gate = threading.Event(), threading.Event()  # the first validation waits until the second is answered

    def hold(*_: object) -> None:
        arrived.set()
        gate.wait(20)

    with FileServer(HOSTILE, on_request=hold) as slow, \
            running(Settings(allow_private=True, allow_url_prefixes=(slow.url(),), workers=1, queue=0)) as (base, _):
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{base}/v1/validate", json={"url": slow.url("valid.dduf")}, timeout=60)
            assert arrived.wait(10)
            second = httpx.post(f"{base}/v1/validate", json={"url": slow.url("valid.dduf")})
            gate.set()
            assert second.status_code == 503 and second.headers["retry-after"] == "1"
            assert first.result().status_code == 200
        assert httpx.post(f"{base}/v1/validate", json={"url": slow.url("valid.dduf")}, timeout=60).status_code == 200


def test_time_limit():
    with FileServer(HOSTILE, latency=60.0) as slow, \
            running(Settings(allow_private=True, allow_url_prefixes=(slow.url(),), time_limit=0.5)) as (base, _):
        got = httpx.post(f"{base}/v1/validate", json={"url": slow.url("valid.dduf")}, timeout=120)
        assert got.status_code in (502, 504), got.text  # the URL deadline or the request's, whichever fires first
        assert slow.waited_out == 0  # answered while the slow server still held its answer: it gave up at its limit


def test_load_uploads_and_urls_bounded(corpus):
    """32 concurrent uploads and 32 URL checks on 4 workers: every answer right, none refused (one address
    stands for 32 clients here: the per-client cap is lifted)."""
    names = ALL[:8]
    want = {n: None for n in names}
    with running(Settings(allow_private=True, allow_url_prefixes=(corpus.url(),), workers=4, queue=64,
                          uploads_per_client=64)) as (base, svc):
        with httpx.Client(base_url=base, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            for n in names:
                want[n] = client.post(f"/v1/validate?name={n}", content=(HOSTILE / n).read_bytes()).json()

            latencies: dict[str, list[float]] = {"upload": [], "url": []}

            def upload(i: int) -> tuple[str, int, dict]:
                n, started = names[i % len(names)], time.perf_counter()
                r = client.post(f"/v1/validate?name={n}", content=(HOSTILE / n).read_bytes())
                latencies["upload"].append(time.perf_counter() - started)
                return n, r.status_code, r.json()

            def by_url(i: int) -> tuple[str, int, dict]:
                n, started = names[i % len(names)], time.perf_counter()
                r = client.post("/v1/validate", json={"url": corpus.url(n)})
                latencies["url"].append(time.perf_counter() - started)
                return n, r.status_code, r.json()

            with ThreadPoolExecutor(64) as pool:
                uploads = list(pool.map(upload, range(32)))
                urls = list(pool.map(by_url, range(32)))
        for mode, values in latencies.items():
            values.sort()
            print(f"{mode}: p50 {1000 * values[len(values) // 2]:.1f} ms, p99 {1000 * values[-1]:.1f} ms (32 concurrent)")
        assert [s for _, s, _ in uploads + urls] == [200] * 64
        assert all(body == want[n] for n, _, body in uploads)
        assert all(body["files"][0]["errors"] == want[n]["files"][0]["errors"] for n, _, body in urls)
        assert list(svc.temp.iterdir()) == []


# --- webhook ----------------------------------------------------------------------------------------------
OLD, NEW = "a" * 40, "b" * 40


def fake_hub(root: Path) -> None:
    """A FileServer tree that answers like the Hub: the revision API and resolve/ paths."""
    repo = root / "org" / "pipe"
    for sha, files in ((OLD, {"same.dduf": "valid.dduf"}),
                       (NEW, {"same.dduf": "valid.dduf", "model.dduf": "valid.dduf", "bad.dduf": "absolute-name.dduf"})):
        (repo / "resolve" / sha).mkdir(parents=True)
        siblings = [{"rfilename": "README.md", "blobId": "0" * 40}]
        for name, fixture in files.items():
            shutil.copy(HOSTILE / fixture, repo / "resolve" / sha / name)
            blob = "1" * 40 if name == "same.dduf" else sha
            siblings.append({"rfilename": name, "blobId": blob, "lfs": {"sha256": blob * 2, "size": 1}})
        api = root / "api" / "models" / "org" / "pipe" / "revision"
        api.mkdir(parents=True, exist_ok=True)
        (api / sha).write_text(json.dumps({"id": "org/pipe", "sha": sha, "siblings": siblings}))


def payload(sha: str = NEW) -> dict:
    return {"event": {"action": "update", "scope": "repo.content"},
            "repo": {"type": "model", "name": "org/pipe", "id": "x", "private": False, "headSha": sha},
            "updatedRefs": [{"ref": "refs/heads/main", "oldSha": OLD, "newSha": sha}],
            "webhook": {"id": "w", "version": 3}}


def test_webhook(tmp_path, capsys):
    fake_hub(tmp_path / "hub")
    with FileServer(tmp_path / "hub") as hub, running(Settings(  # the hub is read whatever the URL prefixes
            endpoint=hub.url(), allow_private=True, webhook_secret="s3cret", reports_dir=tmp_path / "reports",
            allow_url_prefixes=("https://example.org/",))) as (base, _):
        assert httpx.post(f"{base}/v1/webhook", json=payload()).status_code == 401
        assert httpx.post(f"{base}/v1/webhook", json=payload(), headers={"X-Webhook-Secret": "wrong"}).status_code == 401
        assert httpx.get(f"{base}/v1/reports/org/pipe/{NEW}").status_code == 404
        got = httpx.post(f"{base}/v1/webhook", json=payload(), headers={"X-Webhook-Secret": "s3cret"}, timeout=60)
        assert got.status_code == 200, got.text
        (commit,) = got.json()["commits"]
        assert commit["sha"] == NEW and commit["status"] == "done" and commit["valid"] is False
        paths = [f["path"] for f in commit["files"]]
        assert paths == [hub.url(f"org/pipe/resolve/{NEW}/{n}") for n in ("bad.dduf", "model.dduf")]  # same.dduf untouched
        cli = cli_json(capsys, "validate", "--json", *paths)["files"]
        assert commit["files"] == cli
        assert commit["info"]["model.dduf"]["pipeline"] == "TinyPipeline" and commit["info"]["bad.dduf"] is None
        report = httpx.get(f"{base}{commit['report_url']}")
        assert report.status_code == 200 and report.json() == commit
        ignored = httpx.post(f"{base}/v1/webhook", headers={"X-Webhook-Secret": "s3cret"},
                             json={**payload(), "event": {"action": "create", "scope": "discussion"}})
        assert ignored.status_code == 200 and ignored.json() == {"commits": []}
    stored = json.loads((tmp_path / "reports" / "org" / "pipe" / f"{NEW}.json").read_text())
    assert stored == commit


def test_webhook_off_without_a_secret(service):
    assert service[0].post("/v1/webhook", json=payload()).status_code == 404


# --- the page and the CLI ---------------------------------------------------------------------------------
def test_page_without_javascript(service):
    client = service[0]
    page = client.get("/")
    assert page.status_code == 200 and 'action="/check"' in page.text and "/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/static/app.js").status_code == 200 and client.get("/static/../app.py").status_code == 404
    bad = client.post("/check", files={"file": ("absolute-name.dduf", (HOSTILE / "absolute-name.dduf").read_bytes())})
    assert bad.status_code == 200 and "INVALID" in bad.text and "Z008" in bad.text and "/etc/evil.json" in bad.text
    good = client.post("/check", data={"url": service[2].url("valid.dduf")})
    assert "VALID" in good.text and "UNet2DModel" in good.text
    # a browser posting the form with a URL and no file sends an empty part with filename=""
    no_file = client.post("/check", files={"file": ("", b"")}, data={"url": service[2].url("valid.dduf")})
    assert no_file.status_code == 200 and "<strong>VALID</strong>" in no_file.text


def test_cli_serve_end_to_end(tmp_path):
    """`dduf serve` as a user starts it: a real process, a real port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dduf_plus.cli", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                got = httpx.post(f"http://127.0.0.1:{port}/v1/validate?name=v.dduf", content=(HOSTILE / "valid.dduf").read_bytes())
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert got.status_code == 200 and got.json()["files"][0]["valid"]
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/validate", json={"url": "http://127.0.0.1:1/x.dduf"})
        assert refused.status_code == 403
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert "s3cret" not in out


def test_cli_without_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve"]) == 2
    assert 'pip install "dduf_plus[serve]"' in capsys.readouterr().err


def test_other_commands_do_not_import_starlette():
    code = ("import sys; from dduf_plus.cli import main; main(['validate', '-q', sys.argv[1]]); "
            "assert 'starlette' not in sys.modules and 'uvicorn' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, str(HOSTILE / "valid.dduf")], check=True)


def test_hub_token_only_for_the_webhooks_own_reads(tmp_path, caplog):
    """A stranger's URL never carries the server's token (it could read private repos); the webhook's do."""
    fake_hub(tmp_path / "hub")
    seen: list[tuple[str, str | None]] = []
    with FileServer(tmp_path / "hub", on_request=lambda m, p, h: seen.append((p, h.get("Authorization")))) as hub, \
            running(Settings(endpoint=hub.url(), allow_private=True, webhook_secret="s", token="hf_TOKEN")) as (base, _):
        caplog.set_level("INFO", logger="dduf_plus.serve")
        url = hub.url(f"org/pipe/resolve/{NEW}/model.dduf")
        assert httpx.post(f"{base}/v1/validate", json={"url": url}).status_code == 200
        assert seen and all(auth is None for _, auth in seen)
        seen.clear()
        assert httpx.post(f"{base}/v1/webhook", json=payload(), headers={"X-Webhook-Secret": "s"}, timeout=60).status_code == 200
        assert seen and all(auth == "Bearer hf_TOKEN" for _, auth in seen)
        too_big = httpx.post(f"{base}/v1/webhook", content=b"[" * (2 << 20), headers={"X-Webhook-Secret": "s"})
        assert too_big.status_code == 400
    assert "hf_TOKEN" not in caplog.text and "Bearer" not in caplog.text


def test_urlencoded_form(service):
    got = service[0].post("/v1/validate", data={"url": service[2].url("valid.dduf"), "strict": "true"})
    assert got.status_code == 200 and got.json()["files"][0]["valid"]


def test_webhook_over_the_time_limit_answers_202_and_reports_later(tmp_path):
    fake_hub(tmp_path / "hub")

    def slower_archives(method: str, path: str, headers: object) -> None:  # the API answers in time, no archive
        if path.endswith(".dduf"):  # does (one request opens and, for a small file, reads it whole: 0.25 s)
            time.sleep(0.1)

    with FileServer(tmp_path / "hub", latency=0.25, on_request=slower_archives) as hub, running(Settings(
            endpoint=hub.url(), allow_private=True, webhook_secret="s", time_limit=0.3)) as (base, _):
        got = httpx.post(f"{base}/v1/webhook", json=payload(), headers={"X-Webhook-Secret": "s"}, timeout=30)
        assert got.status_code == 202, got.text
        (commit,) = got.json()["commits"]
        assert commit["status"] == "pending"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            record = httpx.get(f"{base}{commit['report_url']}").json()
            if record["status"] == "done":
                break
            time.sleep(0.1)
        assert record["status"] == "done" and record["sha"] == NEW
        assert record["unreadable"] and record["valid"] is False  # each read ran into the 0.3 s deadline
