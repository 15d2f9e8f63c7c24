"""``dduf serve`` against a hostile client (issue 18, item 8) and the CLI's promises kept by the service
(issue 19): many or huge form fields, bodies trickled over many connections while a real upload still gets
through, URLs with bad ports or IPv6 literals, ``Host`` headers (DNS rebinding), private repos' reports, the
body of ``curl --data-binary``, boolean options, and ``dduf serve``'s exit codes. Every wait is bounded
(grace periods of about a second), so the file runs in a few seconds on 2 cores."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_app import running  # noqa: E402
from servers import FileServer  # noqa: E402
from test_serve import NEW, fake_hub, payload  # noqa: E402

from dduf_plus.errors import DDUFUsageError  # noqa: E402
from dduf_plus.serve import Settings  # noqa: E402
from dduf_plus.serve import page as page_module  # noqa: E402
from dduf_plus.serve.safety import host_allowed  # noqa: E402
from dduf_plus.serve.uploads import BadForm, SlowBody, spool_form, timed  # noqa: E402
from dduf_plus.storage.urls import check_url as storage_check_url  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ROOT / "fixtures" / "hostile"
VALID = (HOSTILE / "valid.dduf").read_bytes()
BOUNDARY = "b0uNdary"


def _loopback_alias(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


needs_aliases = pytest.mark.skipif(not _loopback_alias("127.0.0.2"), reason="no 127.0.0.0/8 aliases (Linux has them)")


def _client(address: str = "127.0.0.2", timeout: float = 30) -> httpx.Client:
    """Another client: requests from a loopback address other than the tricklers' 127.0.0.1."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)


@contextmanager
def tricklers(base: str, count: int, source: str | None = None) -> Iterator[list[socket.socket]]:
    """``count`` connections that announce a 1 MB upload and send two bytes (``source``: their address;
    None: 127.0.1.N, one address each)."""
    port = int(base.rsplit(":", 1)[1])
    socks = []
    try:
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), source_address=(source or f"127.0.1.{i + 1}", 0))
            sock.settimeout(10)
            sock.sendall(b"POST /v1/validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                         b"Content-Length: 1000000\r\n\r\nPK")
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _answered(sock: socket.socket) -> bool:
    """Whether the server has answered (or closed) this connection yet, without waiting."""
    return bool(select.select([sock], [], [], 0)[0])


def _status_line(sock: socket.socket) -> str:
    try:
        return sock.recv(200).split(b"\r\n", 1)[0].decode()
    except OSError as e:
        return f"closed ({type(e).__name__})"


# --- form fields --------------------------------------------------------------------------------------------
def _fields(count: int, value: bytes = b"v" * 60) -> bytes:
    parts = [b"--%s\r\nContent-Disposition: form-data; name=\"f%d\"\r\n\r\n%s\r\n" % (BOUNDARY.encode(), i, value)
             for i in range(count)]
    return b"".join(parts) + b"--%s--\r\n" % BOUNDARY.encode()


async def _feed(body: bytes, consumed: list[int], chunk: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(body), chunk):
        consumed[0] += len(body[i:i + chunk])
        yield body[i:i + chunk]


@pytest.mark.parametrize("body, what", [
    (_fields(60_000), "more than 16 form fields"),  # ~5 MB of small fields: the old code kept them all (~2x)
    (_fields(1, b"x" * (4 << 20)), "over 8192 bytes"),  # one huge text field
    (b"--%s\r\nContent-Disposition: form-data; name=\"a\"\r\n%s\r\nv\r\n--%s--\r\n"  # 100k headers in one part
     % (BOUNDARY.encode(), b"X-H: 1234567\r\n" * 100_000, BOUNDARY.encode()), "header"),
    (b"--%s\r\nContent-Disposition: form-data; name=\"a\"; x=\"%s\"\r\n\r\nv\r\n--%s--\r\n"  # one huge header
     % (BOUNDARY.encode(), b"h" * (4 << 20), BOUNDARY.encode()), "header"),
])
def test_form_fields_are_bounded_while_reading(tmp_path, body, what):
    consumed = [0]
    with pytest.raises(BadForm, match=what):
        asyncio.run(spool_form(_feed(body, consumed), f"multipart/form-data; boundary={BOUNDARY}", tmp_path, 1 << 30))
    assert consumed[0] <= 64 << 10, f"read {consumed[0]} of {len(body)} bytes before refusing"
    assert list(tmp_path.iterdir()) == []


def test_many_fields_refused_over_http(tmp_path):
    with running(Settings(temp_root=tmp_path)) as (base, svc):
        got = httpx.post(f"{base}/v1/validate", content=_fields(100),
                         headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
        assert got.status_code == 400 and "more than 16 form fields" in got.json()["error"]
        # a real form with a file and the three text fields still passes
        ok = httpx.post(f"{base}/v1/validate", files={"file": ("v.dduf", VALID)},
                        data={"verify": "true", "strict": "false", "url": ""})
        assert ok.status_code == 200 and ok.json()["files"][0]["valid"]
        assert list(svc.temp.iterdir()) == []


# --- trickling bodies ---------------------------------------------------------------------------------------
@needs_aliases
def test_trickling_bodies_hold_no_validation_slot():
    """One worker, no queue: the old code gave the only slot to the first trickler and every real upload 503."""
    settings = Settings(workers=1, queue=0, uploads=64, uploads_per_client=64, upload_grace=30)
    with running(settings) as (base, _), tricklers(base, 12, source="127.0.0.1") as socks, _client() as client:
        time.sleep(0.2)
        got = client.post(f"{base}/v1/validate?name=v.dduf", content=VALID)
        assert got.status_code == 200 and got.json()["files"][0]["valid"], got.text
        assert not any(_answered(s) for s in socks)  # served while every trickler still held its place


@needs_aliases
def test_per_client_cap_and_grace(tmp_path):
    """12 connections from one address: 4 arrive, 8 get 429; the 4 are cut off (408) once the grace is over;
    another client's upload goes through all along."""
    settings = Settings(uploads=8, uploads_per_client=4, upload_grace=1.0, min_upload_rate=4096, temp_root=tmp_path)
    with running(settings) as (base, svc), tricklers(base, 12, source="127.0.0.1") as socks, _client() as client:
        assert client.post(f"{base}/v1/validate?name=v.dduf", content=VALID).status_code == 200
        lines = [_status_line(s) for s in socks]
        assert sorted(lines).count("HTTP/1.1 429 Too Many Requests") == 8, lines
        assert lines.count("HTTP/1.1 408 Request Timeout") == 4, lines
        assert list(svc.temp.iterdir()) == []


@needs_aliases
def test_full_intake_evicts_the_slowest_for_a_real_upload():
    """Every place taken by tricklers from different addresses: a real upload takes the slowest one's place
    (the old code had no such places: the tricklers held the validation slots, and every upload got 503)."""
    settings = Settings(uploads=6, uploads_per_client=6, upload_grace=30, min_upload_rate=4096)
    with running(settings) as (base, svc), tricklers(base, 6) as socks, _client() as client:
        deadline = time.monotonic() + 10
        while len(svc.intake._tickets) < 6 and time.monotonic() < deadline:  # every trickler holds a place
            time.sleep(0.01)
        svc.intake.MIN_AGE = 1e9  # none has been slow for long enough yet (the clock is the test's, not the load's)
        early = client.post(f"{base}/v1/validate?name=v.dduf", content=VALID)
        assert early.status_code == 503 and early.headers["retry-after"] == "1", early.text
        svc.intake.MIN_AGE = 0.0  # now each is judged on the rate it has shown
        for _ in range(3):  # the first takes socks[0]'s place (the oldest: the slowest); the place is then free
            got = client.post(f"{base}/v1/validate?name=v.dduf", content=VALID)
            assert got.status_code == 200, got.text
        assert _status_line(socks[0]) == "HTTP/1.1 408 Request Timeout"
        socks[1].settimeout(0.3)
        assert _status_line(socks[1]) == "closed (TimeoutError)"  # still waiting: not evicted without need


def test_silent_body_cut_off_at_the_deadline():
    """No rate floor, a 1 s body deadline: a client that sends nothing more is answered 408 at 1 s and its
    connection closed (not kept alive for the rest of a body that will not come)."""
    settings = Settings(body_timeout=1.0, min_upload_rate=0)
    with running(settings) as (base, _), tricklers(base, 1, source="127.0.0.1") as (sock,):
        sock.settimeout(30)  # a hang guard: the answer below says it came from the 1 s deadline
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and b"took longer than 1 s" in answer
        assert b"connection: close" in answer.lower()


def test_timed_reads_leave_the_task_usable():
    """The deadline interrupts the read itself (a timer, no task per chunk); the request's task goes on. An
    event, not a time: the stalled read never resumes (a check made only between chunks would wait it out)."""
    resumed: list[bool] = []

    async def stalls() -> AsyncIterator[bytes]:
        yield b"ab"
        await asyncio.sleep(30)
        resumed.append(True)
        yield b"never"

    async def main() -> tuple[list[bytes], int]:
        got = []
        with pytest.raises(SlowBody, match="too slowly"):
            async for chunk in timed(stalls(), 10, 1024, 0.2):
                got.append(chunk)
        await asyncio.sleep(0)  # not cancelled any more
        task = asyncio.current_task()
        return got, task.cancelling() if hasattr(task, "cancelling") else 0

    got, cancelling = asyncio.run(main())
    assert got == [b"ab"] and resumed == [] and cancelling == 0


# --- URLs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, words", [
    ("http://127.0.0.1:abc/x.dduf", "port"), ("http://127.0.0.1:99999/x.dduf", "port"),
    ("http://127.0.0.1:0/x.dduf", "port 0"), ("http://127.0.0.1:-1/x.dduf", "port"),
    ("http://[::1/x.dduf", "not a valid URL"), ("http://127.0.0.1/x y.dduf", "control characters"),
])
def test_bad_port_or_url_is_400(url, words, caplog):
    with running(Settings(allow_private=True, allow_url_prefixes=("http://127.0.0.1", "http://[::1"))) as (base, _):
        got = httpx.post(f"{base}/v1/validate", json={"url": url})
        page = httpx.post(f"{base}/check", data={"url": url})
    assert got.status_code == 400 and words in got.json()["error"], got.text
    assert page.status_code == 400 and "Not checked" in page.text
    assert "Traceback" not in caplog.text


def test_host_name_that_is_not_idna_is_400():
    with running(Settings(allow_url_prefixes=(f"https://{'a' * 64}.example/",))) as (base, _):
        got = httpx.post(f"{base}/v1/validate", json={"url": f"https://{'a' * 64}.example/x.dduf"})
    assert got.status_code == 400 and "not a valid host name" in got.json()["error"], got.text


def test_storage_check_url_accepts_ipv6_literals_only():
    for url in ("http://[::1]:8000/x.dduf", "https://[2606:4700::1111]/a.dduf", "http://u@[fe80::1%25eth0]/x.dduf"):
        assert storage_check_url(url) in ("http", "https")
    for url in ("simplecache::https://h/x.dduf", "https://[::1]/a::b", "simplecache::http://[::1]/x",
                "http://[::1]::http://x", "zip://a::https://[::1]/x"):
        with pytest.raises(DDUFUsageError, match="chained|not a valid URL"):
            storage_check_url(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc/x.dduf", "http://127.0.0.1:99999/x.dduf",
                                 "http://127.0.0.1:0/x.dduf", "http://[::1/x.dduf"])
def test_cli_bad_port_is_a_usage_error(url, capsys):
    """The sibling in the CLI: `dduf validate URL` said "internal error: ValueError: Port out of range"."""
    from dduf_plus.cli import main

    with pytest.raises(DDUFUsageError, match="not a valid URL|port 0"):
        storage_check_url(url)
    assert main(["validate", url]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and err.startswith("dduf validate: error:")


class _V6Files(FileServer):
    address_family = socket.AF_INET6


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_literal_url(capsys):
    try:
        files = _V6Files(HOSTILE, host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    with files:
        url = f"http://[::1]:{files.server_port}/valid.dduf"
        with running(Settings(allow_private=True, allow_url_prefixes=(f"http://[::1]:{files.server_port}/",))) as (base, _):
            got = httpx.post(f"{base}/v1/validate?verify=true", json={"url": url})
        assert got.status_code == 200 and got.json()["files"][0]["valid"], got.text
        with running(Settings(allow_url_prefixes=(f"http://[::1]:{files.server_port}/",))) as (base, _):
            refused = httpx.post(f"{base}/v1/validate", json={"url": url})
        assert refused.status_code == 403 and "loopback" in refused.json()["error"]  # the address rule, not "chained"
        from dduf_plus.cli import main
        assert main(["validate", url]) == 0


# --- Host header --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host, allowed", [
    ("localhost", True), ("localhost:8000", True), ("127.0.0.1:8000", True), ("[::1]:8000", True), ("[::1]", True),
    ("10.0.0.5", True), ("LOCALHOST.", True), ("evil.example", False), ("evil.example:8000", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io", False), ("localhost:80@evil.example", False),
    ("[::1", False), ("localhost:http", False), ("", False),
])
def test_host_allowed_units(host, allowed):
    assert host_allowed(host, Settings()) is allowed
    assert host_allowed(host, Settings(allowed_hosts=("*",)))


def test_host_header_checked_on_every_route():
    with running(Settings(allowed_hosts=("dduf.example.org",))) as (base, _):
        for path in ("/", "/healthz", "/v1/rules"):
            evil = httpx.get(f"{base}{path}", headers={"Host": "rebound.evil.example:8000"})
            assert evil.status_code == 421 and "--allowed-host" in evil.json()["error"]
        assert httpx.post(f"{base}/v1/validate?name=v.dduf", content=VALID,
                          headers={"Host": "rebound.evil.example"}).status_code == 421
        assert httpx.get(f"{base}/healthz", headers={"Host": "dduf.example.org"}).status_code == 200
        assert httpx.get(f"{base}/healthz").status_code == 200  # 127.0.0.1:PORT


# --- reports of private repos -------------------------------------------------------------------------------
@pytest.mark.parametrize("private, public", [(True, False), (None, False), (False, True)])
def test_private_repo_reports_need_the_secret(tmp_path, private, public):
    fake_hub(tmp_path / "hub")
    body = payload()
    if private is None:
        del body["repo"]["private"]
    else:
        body["repo"]["private"] = private
    with FileServer(tmp_path / "hub") as hub, running(Settings(
            endpoint=hub.url(), allow_private=True, webhook_secret="s", reports_dir=tmp_path / "reports")) as (base, _):
        got = httpx.post(f"{base}/v1/webhook", json=body, headers={"X-Webhook-Secret": "s"}, timeout=60)
        assert got.status_code == 200
        url = f"{base}/v1/reports/org/pipe/{NEW}"
        anonymous, wrong = httpx.get(url), httpx.get(url, headers={"X-Webhook-Secret": "nope"})
        owner = httpx.get(url, headers={"X-Webhook-Secret": "s"})
    assert owner.status_code == 200 and owner.json()["private"] is not public
    assert (anonymous.status_code, wrong.status_code) == ((200, 200) if public else (404, 404))
    stored = json.loads((tmp_path / "reports" / "org" / "pipe" / f"{NEW}.json").read_text())
    assert stored["private"] is not public


# --- bodies as curl sends them, options -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def service():
    with running(Settings()) as (base, svc), httpx.Client(base_url=base, timeout=60) as client:
        yield client, svc


def test_curl_data_binary_default_type_is_the_archive(service):
    client, _ = service
    for fixture in ("valid.dduf", "absolute-name.dduf"):
        data = (HOSTILE / fixture).read_bytes()
        curl = client.post(f"/v1/validate?name={fixture}", content=data,
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
        raw = client.post(f"/v1/validate?name={fixture}", content=data)
        assert curl.status_code == raw.status_code == 200 and curl.json() == raw.json()
    junk = client.post("/v1/validate", content=b"\x00\x01not a zip" * 10_000,
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert junk.status_code == 200 and not junk.json()["files"][0]["valid"]  # judged as an archive, not a 413
    big_form = client.post("/v1/validate", content=b"url=" + b"a" * (80 << 10),
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert big_form.status_code == 413 and "curl --data-binary" in big_form.json()["error"]


def test_empty_bodies_and_wrong_fields(service):
    client, svc = service
    empty = client.post("/v1/validate", content=b"")
    assert empty.status_code == 400 and "empty" in empty.json()["error"] and "curl" in empty.json()["error"]
    empty_file = client.post("/v1/validate", files={"file": ("e.dduf", b"")})
    assert empty_file.status_code == 400 and "is empty" in empty_file.json()["error"]
    wrong = client.post("/v1/validate", files={"archive": ("v.dduf", VALID)})
    assert wrong.status_code == 400 and "no `file` field" in wrong.json()["error"] and "'archive'" in wrong.json()["error"]
    nothing = client.post("/v1/validate", data={"strict": "true"}, files={"file": ("", b"")})
    assert nothing.status_code == 400 and "no `file` field" in nothing.json()["error"]
    two = client.post("/v1/validate", files=[("file", ("a.dduf", VALID)), ("file", ("b.dduf", VALID))])
    assert two.status_code == 400 and "more than one file" in two.json()["error"]
    zst = client.post("/v1/validate?name=x.dduf", content=b"\x28\xb5\x2f\xfd" + b"\0" * 64)  # zstd, named .dduf
    assert zst.status_code == 400 and "dduf decompress" in zst.json()["error"]
    page = client.post("/check", files={"file": ("", b"")}, data={"url": ""})
    assert page.status_code == 400 and "choose a .dduf file or paste a URL" in page.text
    assert list(svc.temp.iterdir()) == []


@pytest.mark.parametrize("value, verified", [("yes", True), ("TRUE", True), ("1", True), ("on", True),
                                             ("no", False), ("false", False), ("0", False), ("off", False)])
def test_boolean_options(service, value, verified):
    client, _ = service
    data = (HOSTILE / "crc-mismatch.dduf").read_bytes()  # only --verify sees its H001
    got = client.post(f"/v1/validate?verify={value}&name=c.dduf", content=data).json()
    assert any(f["code"] == "H001" for f in got["files"][0]["errors"]) is verified
    form = client.post("/v1/validate", files={"file": ("c.dduf", data)}, data={"verify": value}).json()
    assert form == got


@pytest.mark.parametrize("query", ["verify=maybe", "verify=", "strict=2", "strict=yess"])
def test_unknown_boolean_words_are_refused(service, query):
    got = service[0].post(f"/v1/validate?{query}&name=v.dduf", content=VALID)
    assert got.status_code == 400 and "give true or false" in got.json()["error"]


def test_json_booleans(service):
    client, _ = service
    assert client.post("/v1/validate", json={"url": "http://127.0.0.1:1/x", "verify": "maybe"}).status_code == 400
    assert client.post("/v1/validate", json={"url": "ftp://x/x", "verify": True}).status_code == 403


# --- the page -----------------------------------------------------------------------------------------------
def test_page_offers_dduf_only_and_shows_the_verdict_first(service):
    client, _ = service
    html = client.get("/").text
    assert 'accept=".dduf"' in html and ".zst" not in html.split('accept="', 1)[1].split('"', 1)[0]
    assert "dduf decompress" in html
    assert html.index('id="result"') < html.index('<form id="check"')
    result = client.post("/check", files={"file": ("no-zip64.dduf", (HOSTILE / "no-zip64.dduf").read_bytes())}).text
    assert result.count("<code>Z018</code>") == 1 and "<code>Z018</code> (7)" in result  # one row for 7 findings
    assert "`" not in result.split("<table id='findings'>", 1)[1]  # fixes render `x` as <code>
    assert result.index("id='verdict'") < result.index('<form id="check"')


def test_page_referenced_component_shows_the_reference():
    info = {"components": {
        "vae": {"class": "AutoencoderKL", "dtype": None, "parameters": 0, "bytes": 0,
                "external": {"pretrained_model_name_or_path": "org/base", "subfolder": "vae", "revision": "a" * 40,
                             "files": {"config.json": {"size": 700, "sha256": "0" * 64},
                                       "diffusion_pytorch_model.safetensors": {"size": 167_000_000, "sha256": "1" * 64}}}},
        "unet": {"class": "UNet2DConditionModel", "dtype": "float16", "parameters": 20, "bytes": 48, "external": False},
    }}
    html = page_module.render_result({"files": [{"path": "p.dduf", "valid": True, "errors": [], "warnings": []}],
                                      "info": info})
    vae = html.split("<th scope='row'>vae</th>", 1)[1].split("</tr>", 1)[0]
    assert "167,000,700 (referenced)" in vae and f"org/base@{'a' * 40}:vae (Hub repo)" in vae and "<td>0</td>" not in vae
    unet = html.split("<th scope='row'>unet</th>", 1)[1].split("</tr>", 1)[0]
    assert "<td>20</td><td>48</td><td>in archive</td>" in unet


def test_rich_fix_text():
    assert page_module.rich("re-pack (`dduf pack`) <now>") == "re-pack (<code>dduf pack</code>) &lt;now&gt;"
    assert page_module.rich("an `unpaired one") == "an `unpaired one"


# --- dduf serve, the command ----------------------------------------------------------------------------------
def _serve(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dduf_plus.cli", "serve", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], "99999 is not a port"), (["--port", "http"], "not a port number"),
    (["--workers", "0"], "at least 1"), (["--allow-url-prefix", "https://h:99999/"], "port"),
    (["--host", "no-such-host.invalid"], "cannot resolve"),
])
def test_cli_usage_errors_one_line(argv, words):
    out, err = _serve(*argv).communicate(timeout=60)
    assert words in err and "Traceback" not in err and err.strip().splitlines()[-1].startswith("dduf serve: error:")


def test_cli_port_in_use_and_ctrl_c():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--port", str(port))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "Traceback" not in err
        assert err.strip().splitlines() == [f"dduf serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    proc = _serve("--port", str(port))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "dduf serve: interrupted"
    assert "Traceback" not in err


def test_cli_settings_allow_the_bound_host():
    from dduf_plus.cli import build_parser
    from dduf_plus.cli.serve import _settings

    args = build_parser("serve").parse_args(["serve", "--host", "box.lan", "--allowed-host", "dduf.example.org",
                                             "--uploads", "3", "--uploads-per-client", "2"])
    settings = _settings(args)
    assert settings.allowed_hosts == ("dduf.example.org", "box.lan") and (settings.uploads, settings.uploads_per_client) == (3, 2)
    assert host_allowed("box.lan:8000", settings) and not host_allowed("other.lan", settings)
    anywhere = _settings(build_parser("serve").parse_args(["serve", "--host", "0.0.0.0"]))
    assert anywhere.allowed_hosts == () and host_allowed("192.168.1.9:8000", anywhere)
