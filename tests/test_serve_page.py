"""The page at ``/`` in headless Chromium (selenium): upload a valid and a hostile fixture and read what a
person sees (verdict, rule code and fix, a component row), with JavaScript and without. Skipped, with the
reason, where Debian's chromium/chromium-driver or selenium are missing (.ci/run installs them where apt works).
Saves bench/results/serve_page.png."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_app import running  # noqa: E402
from servers import FileServer  # noqa: E402

from dduf_plus.format.findings import RULES  # noqa: E402
from dduf_plus.serve import Settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ROOT / "fixtures" / "hostile"
SCREENSHOT = ROOT / "bench" / "results" / "serve_page.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def _browser(javascript: bool):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    if not CHROMIUM or not DRIVER:
        pytest.skip("chromium and chromedriver are not installed (apt-get install -y chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="dduf-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1100", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    try:
        driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    except Exception as e:  # noqa: BLE001 - a broken browser install is a skip with its reason, not a failure
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"chromium did not start: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    driver.set_page_load_timeout(30)
    return driver, profile


@pytest.fixture(scope="module")
def base():
    with FileServer(HOSTILE) as files, \
            running(Settings(allow_private=True, allow_url_prefixes=(files.url(),))) as (url, _):
        yield url, files


@pytest.fixture(params=[True, False], ids=["javascript", "no-javascript"])
def browser(request):
    driver, profile = _browser(request.param)
    yield driver, request.param
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _check(driver, base: str, path: Path) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base + "/")
    driver.find_element(By.ID, "file").send_keys(str(path))
    driver.find_element(By.ID, "submit").click()
    verdict = WebDriverWait(driver, 30).until(ec.presence_of_element_located((By.ID, "verdict")))
    return verdict.text


def test_page_shows_verdict_findings_and_components(base, browser):
    from selenium.webdriver.common.by import By

    url, _ = base
    driver, javascript = browser
    bad = _check(driver, url, HOSTILE / "absolute-name.dduf")
    assert bad.startswith("INVALID") and "absolute-name.dduf" in bad
    findings = driver.find_element(By.ID, "findings").text
    assert "Z008" in findings and "/etc/evil.json" in findings and RULES["Z008"].fix.replace("`", "") in findings
    assert not driver.find_elements(By.XPATH, "//table[@id='findings']//td[contains(., '`')]")  # `x` shown as code
    verdict = driver.find_element(By.ID, "verdict")
    assert verdict.location["y"] < driver.find_element(By.ID, "check").location["y"]  # the verdict above the form

    _check(driver, url, HOSTILE / "no-zip64.dduf")
    rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#findings tbody tr")]
    assert len([r for r in rows if r.startswith("Z018")]) == 1, rows  # 7 findings of one rule: one row

    good = _check(driver, url, HOSTILE / "valid.dduf")
    assert good.startswith("VALID") and "0 errors" in good
    rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#components tbody tr")]
    assert any(r.startswith("unet UNet2DModel float16 20 48 in archive") for r in rows), rows
    if javascript:
        assert driver.current_url.rstrip("/") == url  # rendered in place, no navigation to /check
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOT))
    else:
        assert driver.current_url.endswith("/check")  # the plain form post, rendered by the server


def test_page_checks_a_pasted_url(base, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    url, files = base
    driver, _ = browser
    driver.get(url + "/")
    driver.find_element(By.ID, "url").send_keys(files.url("crc-mismatch.dduf"))
    driver.find_element(By.NAME, "verify").click()
    driver.find_element(By.ID, "submit").click()
    verdict = WebDriverWait(driver, 30).until(ec.presence_of_element_located((By.ID, "verdict")))
    assert verdict.text.startswith("INVALID")
    assert "H001" in driver.find_element(By.ID, "findings").text


# app.js without a browser: node with a small fake DOM (enough for render()), so the script's grouping, fix
# texts and component cells are checked wherever node is (CI installs it for the npm checker)
_FAKE_DOM = r"""
// a tiny fake DOM: enough for app.js's render path
class Node_ { constructor(tag){this.tag=tag;this.attrs={};this.children=[];this.classList={add(){},remove(){}};this.listeners={};}
  setAttribute(k,v){this.attrs[k]=v;} append(...c){this.children.push(...c.map(x=>typeof x==="string"?new Text_(x):x));} replaceChildren(...c){this.children=c;}
  addEventListener(n,f){this.listeners[n]=f;}
  get text(){return this.children.map(c=>c instanceof Text_?c.t:c.text).join("");}
  html(){const kids=this.children.map(c=>c instanceof Text_?c.t:c.html()).join("");return `<${this.tag}>${kids}</${this.tag}>`;}}
class Text_ extends Node_ { constructor(t){super("#text");this.t=t;} }
global.Node = Node_;
const els = {check:new Node_("form"), result:new Node_("section"), drop:new Node_("div"), file:new Node_("input")};
els.check.elements = {verify:{checked:true}, strict:{checked:false}, url:{value:""}};
els.file.files=[{name:"x.dduf"}];
global.document = {getElementById:(id)=>els[id], createElement:(t)=>new Node_(t), createTextNode:(t)=>new Text_(t)};
global.FormData = class { append(){} };
global.URLSearchParams = class { set(){} toString(){return "";} };
const report = JSON.parse(require("fs").readFileSync(process.argv[3]));
global.fetch = async (u) => ({ok:true, json: async () => u === "/v1/rules" ? JSON.parse(require("fs").readFileSync(process.argv[4])) : report});
require(process.argv[2]);
els.check.listeners.submit({preventDefault(){}}).then(()=>{ console.log(els.result.html()); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_app_js_renders_grouped_findings_and_references(base, tmp_path):
    import httpx

    url, _ = base
    report = httpx.post(f"{url}/v1/validate?name=n.dduf", content=(HOSTILE / "no-zip64.dduf").read_bytes()).json()
    report["info"] = {"components": {
        "vae": {"class": "AutoencoderKL", "external": {"pretrained_model_name_or_path": "org/base", "subfolder": "vae",
                                                        "files": {"a": {"size": 5000, "sha256": "0" * 64}}}},
        "unet": {"class": "UNet2DModel", "dtype": "float16", "parameters": 20, "bytes": 48, "external": False}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "rules.json").write_text(httpx.get(f"{url}/v1/rules").text)
    (tmp_path / "dom.js").write_text(_FAKE_DOM)
    html = subprocess.run(["node", str(tmp_path / "dom.js"), str(ROOT / "dduf_plus" / "serve" / "static" / "app.js"),
                           str(tmp_path / "report.json"), str(tmp_path / "rules.json")],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert html.count("<code>Z018</code>") == 1 and "<code>Z018</code> (7)" in html
    assert "`" not in html and "<code>dduf pack</code>" in html
    assert "<th>vae</th><td>AutoencoderKL</td><td>-</td><td>referenced</td><td>5,000 (referenced)</td><td>org/base/vae</td>" in html
    assert "<td>20</td><td>48</td><td>in archive</td>" in html
