"""bench/gpu_load.py works before anyone spends GPU time on it: arguments, --dry-run, and the whole
flow on the tiny fixture with device cpu (--cpu-smoke)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_load():
    spec = importlib.util.spec_from_file_location("bench_gpu_load", ROOT / "bench" / "gpu_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(gpu_load, monkeypatch, tmp_path):
    monkeypatch.delenv("OUT", raising=False)
    args = gpu_load.parse_args([])
    assert args.device == "cuda" and args.runs == 3 and args.json == ROOT / "bench" / "results" / "gpu_load.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gpu_load.parse_args(["--cpu-smoke", "--runs", "2", "--work", str(tmp_path / "w")])
    assert args.device == "cpu" and args.runs == 2 and args.json == tmp_path / "gpu_load.json"
    with pytest.raises(SystemExit):
        gpu_load.parse_args(["--runs", "0"])


def test_dry_run_touches_nothing(gpu_load, tmp_path, capsys):
    assert gpu_load.main(["--dry-run", "--work", str(tmp_path / "w"), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads(capsys.readouterr().out)["dry_run"] is True
    assert not (tmp_path / "w").exists() and not (tmp_path / "r.json").exists()


def test_cpu_smoke_runs_the_whole_flow(gpu_load, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = gpu_load.main(["--cpu-smoke", "--runs", "1", "--work", str(tmp_path / "w"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["failures"] == [] and rc == 0
    assert set(result["components"]) == {"unet", "vae", "text_encoder"}
    for comp in result["components"].values():
        for key in ("materialize_s", "materialize_fp32_s", "load_dduf_materialize_s", "diffusers_component_s"):
            assert comp[key] > 0, key
    assert {"load_dduf_s", "diffusers_to_s", "diffusers_device_map_s"} <= set(result["pipeline_loads"])
    assert all(all(r.values()) for r in result["checks"]["tensors"].values())
    assert "| unet |" in capsys.readouterr().out


def test_fails_soft_without_cuda(gpu_load, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "r.json"
    assert gpu_load.main(["--work", str(tmp_path / "w"), "--json", str(out)]) == 1
    failures = json.loads(out.read_text())["failures"]
    assert failures and "CUDA" in failures[0]["error"]
