"""A load makes no request the user did not ask for: importing libraries during a load (diffusers imports
bitsandbytes and torchao; bitsandbytes, on a CPU with AVX512-BF16, downloads a kernel from the Hub as it is
imported) reaches no server, unless ``DDUF_PLUS_BACKEND_DOWNLOADS=1`` allows it.

Each load runs in a fresh interpreter (imports happen once per process) whose ``HF_ENDPOINT`` is a local
server recording every request, with the Hub otherwise allowed (``HF_HUB_OFFLINE=0``). This machine's CPU
may lack AVX512-BF16, so bitsandbytes is made to believe it has it (``has_avx512bf16`` answers True from
the moment ``bitsandbytes.functional`` is loaded): its download then runs as on such a CPU."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

if importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("kernels") is None:
    pytest.skip("bitsandbytes and kernels are not installed here (pip install -e '.[quant]')", allow_module_level=True)

TINY_SD = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"

# Run in the child: bitsandbytes' AVX512-BF16 branch forced, then load_dduf(sys.argv[1]).
CHILD = r'''
import importlib.machinery, sys

class ForceAvx512Bf16:
    """bitsandbytes.functional.has_avx512bf16 answers True (before bitsandbytes' CPU ops are imported)."""
    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, ForceAvx512Bf16())
from dduf_plus import load_dduf
pipe = load_dduf(sys.argv[1], local_files_only=sys.argv[2] == "local")
assert pipe.unet is not None
import bitsandbytes.functional
assert bitsandbytes.functional.has_avx512bf16()  # the forced branch ran
print("LOADED")
'''


class Recorder(BaseHTTPRequestHandler):
    requests: list[str] = []

    def _record(self) -> None:
        Recorder.requests.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = _record

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def nf4_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd whose unet diffusers quantized to bitsandbytes nf4 on CPU (its GPU gate bypassed), packed."""
    from diffusers import BitsAndBytesConfig, UNet2DConditionModel
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    from dduf_plus.packing.pack import pack

    root = tmp_path_factory.mktemp("nf4") / "tiny-sd"
    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    patch = pytest.MonkeyPatch()
    patch.setattr(bnb_quantizer.BnB4BitDiffusersQuantizer, "validate_environment", lambda self, *a, **k: None)
    try:
        unet = UNet2DConditionModel.from_pretrained(
            TINY_SD / "unet", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
            device_map="cpu")
        unet.save_pretrained(root / "unet")
    finally:
        patch.undo()
    archive = root.parent / "nf4.dduf"
    pack(root, archive, quiet=True)
    return archive


def _load_in_child(archive: Path, endpoint: str, tmp_path: Path, *, allow: bool = False,
                   mode: str = "local") -> list[str]:
    """The requests the endpoint saw while a fresh interpreter loaded ``archive``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DDUF_PLUS_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               DDUF_PLUS_CACHE=str(tmp_path / "cache"), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    if allow:
        env["DDUF_PLUS_BACKEND_DOWNLOADS"] = "1"
    Recorder.requests = []
    done = subprocess.run([sys.executable, "-c", CHILD, str(archive), mode], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "LOADED" in done.stdout, done.stderr[-3000:]
    return list(Recorder.requests)


@pytest.mark.parametrize("mode", ["local", "default"])
def test_a_quantized_load_asks_no_server(nf4_archive: Path, endpoint: str, tmp_path: Path, mode: str) -> None:
    """A local nf4 archive without references, ``local_files_only=True`` or not: not one request (0.6.1:
    bitsandbytes' import asked the endpoint for kernels-community/quantization-bitsandbytes)."""
    assert _load_in_child(nf4_archive, endpoint, tmp_path, mode=mode) == []


def test_a_plain_load_asks_no_server(packed: dict[str, Path], endpoint: str, tmp_path: Path) -> None:
    """diffusers imports bitsandbytes with every model: a plain archive's load asks nothing either."""
    assert _load_in_child(packed["tiny-sd"], endpoint, tmp_path, mode="default") == []


def test_the_user_can_allow_the_download(nf4_archive: Path, endpoint: str, tmp_path: Path) -> None:
    """``DDUF_PLUS_BACKEND_DOWNLOADS=1``: bitsandbytes asks for its kernel as it would on its own (which also
    shows that the forced branch reaches the endpoint, so the tests above can fail)."""
    requests = _load_in_child(nf4_archive, endpoint, tmp_path, allow=True)
    assert any("kernels-community" in r for r in requests), requests
