"""Hostile single-file checkpoints: a header's numbers never size an allocation BASE does not, and dtypes no
diffusers model takes are one clear error.

- Shapes: the conversion first runs on the header's shapes alone (meta tensors), every converted shape is
  checked against BASE's, and what the real conversion would allocate is bounded by BASE's component (its
  element count times the checkpoint's widest element) before any byte of the file is viewed. The issue's
  case: an SD3 CLIP-L position embedding declared ``[0, 20000]`` (0 bytes of data) made diffusers' identity
  projection ``eye(20000)``: 1.5 GB from a 284-byte file (22 GB at 75,000).
- Dtypes: F4, F6_E2M3, F6_E3M2 (packed sub-byte values torch cannot view one per element) and F8_E8M0 (MX block
  scales) were AttributeError / RuntimeError tracebacks, or for F8_E8M0 a silently wrong archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from single_file_ckpt import (
    BITS,
    build_tiny_sd2,
    build_tiny_sd3,
    checkpoint_from_pipeline,
    raw_tensors,
    retyped,
    sd3_checkpoint_from_pipeline,
    write_raw,
)

from conftest import PIPELINES
from dduf_plus.cli import main
from dduf_plus.errors import DDUFPackError
from dduf_plus.packing import single_file_convert
from dduf_plus.packing.single_file import describe_checkpoint, pack_single_file, plan_single_file

TINY_SD = PIPELINES / "tiny-sd"
POSITION = "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight"
MARKER = "model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight"  # diffusers' SD3.5 large marker


@pytest.fixture(scope="module")
def sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile-sd3")
    return build_tiny_sd3(out / "tiny-sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")


def _position_file(path: Path, base: Path, n: int) -> Path:
    """The issue's file, completed: SD3's CLIP-L as BASE has it, its position embedding declared ``[0, n]`` (no
    data), and the SD3.5-large marker key (declared empty too)."""
    state = raw_tensors(sd3_checkpoint_from_pipeline(base, components=("text_encoder",)))
    state[POSITION] = ("F32", [0, n], b"")
    state[MARKER] = ("F16", [0], b"")
    return write_raw(path, state)


def _no_tensor_viewed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every tensor of the file the pack views (the real conversion's first step)."""
    seen: list[str] = []
    real = single_file_convert.view

    def view(mm: Any, start: int, info: Any) -> Any:
        seen.append(info.name)
        return real(mm, start, info)

    monkeypatch.setattr(single_file_convert, "view", view)
    return seen


def test_a_declared_position_grid_is_refused_before_anything_is_allocated(sd3: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _position_file(tmp_path / "pos.safetensors", sd3, 20_000)
    seen = _no_tensor_viewed(monkeypatch)
    for call in (lambda: pack_single_file(ckpt, tmp_path / "x.dduf", base=str(sd3), quiet=True),
                 lambda: plan_single_file(ckpt, str(sd3))):
        with pytest.raises(DDUFPackError) as e:
            call()
        text = str(e.value)
        assert "position_embedding.weight" in text and "[0, 20000]" in text and "[77, 32]" in text, text
    assert seen == [] and not list(tmp_path.glob("x.dduf*"))


def test_the_refusal_costs_no_memory_at_75000(sd3: Path, tmp_path: Path) -> None:
    """At N = 75,000 the old path asked for a 22 GB identity; the peak RSS now grows by what the imports and
    BASE's headers take (measured: under 10 MB after imports), checked in a fresh process."""
    ckpt = _position_file(tmp_path / "pos.safetensors", sd3, 75_000)
    script = f"""
import json, resource, sys
import diffusers.loaders.single_file_utils, transformers  # imports first: what they cost is not the conversion
from dduf_plus.errors import DDUFPackError
from dduf_plus.packing.single_file import plan_single_file
limit = 8 << 30  # address space: the old path's 22 GB identity fails here instead of taking the machine
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    plan_single_file({str(ckpt)!r}, {str(sd3)!r})
    error = None
except (DDUFPackError, MemoryError) as e:
    error = f"{{type(e).__name__}}: {{e}}"
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({{"error": error, "grown_kb": grown}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"].startswith("DDUFPackError") and "[0, 75000]" in result["error"], (result, done.stderr[-2000:])
    print(result)
    assert result["grown_kb"] < 200 * 1024, result  # 22 GB before


def test_dduf_info_and_pack_with_base_say_it_in_one_line(sd3: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _position_file(tmp_path / "pos.safetensors", sd3, 20_000)
    for argv in (["info", str(ckpt), "--base", str(sd3)], ["pack", str(ckpt), "--base", str(sd3), "-o",
                                                            str(tmp_path / "x.dduf")]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "[0, 20000]" in err and "Traceback" not in err, err


def test_every_converted_shape_is_checked_on_the_header_first(sd3: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused qkv of the MMDiT declared wider than BASE's (real data: the split copies would be made) is refused
    by the meta pass: nothing of the file is viewed, the message names the split tensor and BASE's shape."""
    state = raw_tensors(sd3_checkpoint_from_pipeline(sd3, components=("transformer",)))
    key = "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"
    code, shape, _ = state[key]
    wide = [shape[0], shape[1] * 4]
    state[key] = (code, wide, bytes(4 * wide[0] * wide[1]))
    ckpt = write_raw(tmp_path / "qkv.safetensors", state)
    seen = _no_tensor_viewed(monkeypatch)
    with pytest.raises(DDUFPackError) as e:
        pack_single_file(ckpt, tmp_path / "x.dduf", base=str(sd3), quiet=True)
    assert "transformer_blocks.0.attn.to_q.weight" in str(e.value) and f"[{shape[0] // 3}, {shape[1]}]" in str(e.value)
    assert seen == []


def test_a_missing_tensor_is_refused_before_anything_is_viewed(sd3: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    state = raw_tensors(sd3_checkpoint_from_pipeline(sd3, components=("text_encoder",)))
    state[MARKER] = ("F16", [0], b"")
    del state["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"]
    seen = _no_tensor_viewed(monkeypatch)
    with pytest.raises(DDUFPackError, match=r"final_layer_norm.weight, \[32\] in BASE"):
        pack_single_file(write_raw(tmp_path / "m.safetensors", state), tmp_path / "x.dduf", base=str(sd3), quiet=True)
    assert seen == []


def test_conversion_memory_is_bounded_by_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors BASE has no place for are dropped after conversion, but diffusers' OpenCLIP converter copies the
    q/k/v of every ``in_proj_weight`` it meets: an extra layer 40x BASE's text encoder is refused by the bound
    before the copies are made; the same file without it packs."""
    base = build_tiny_sd2(tmp_path / "tiny-sd2", TINY_SD / "tokenizer")
    clean = checkpoint_from_pipeline(base, "v2", unet_delta=0.01, components=("unet", "text_encoder"))
    width = next(t.shape[1] for k, t in clean.items() if k.endswith("in_proj_weight"))
    extra = "cond_stage_model.model.transformer.resblocks.40.attn.in_proj_weight"
    state = raw_tensors(clean)
    state[extra] = ("F32", [3 * width, 20_000], bytes(4 * 3 * width * 20_000))
    seen = _no_tensor_viewed(monkeypatch)
    with pytest.raises(DDUFPackError) as e:
        pack_single_file(write_raw(tmp_path / "big.safetensors", state), tmp_path / "x.dduf", base=str(base),
                         quiet=True)
    assert "would allocate" in str(e.value) and "layers.40." in str(e.value), str(e.value)
    assert seen == []
    clean_file = write_raw(tmp_path / "ok.safetensors", raw_tensors(clean))
    pack_single_file(clean_file, tmp_path / "ok.dduf", base=str(base), quiet=True)


@pytest.mark.parametrize("code", sorted(BITS))
def test_dtypes_no_model_takes_are_one_clear_error(code: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    state = checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01)
    key = next(k for k, t in sorted(state.items()) if k.startswith("model.diffusion_model.") and t.dim() == 2
               and t.numel() % 8 == 0)
    ckpt = write_raw(tmp_path / f"{code}.safetensors", retyped(state, key, code))
    with pytest.raises(DDUFPackError) as e:
        pack_single_file(ckpt, tmp_path / "x.dduf", base=str(TINY_SD), quiet=True)
    assert key in str(e.value) and f" is {code} " in str(e.value) and "rule:" in str(e.value)
    for argv in (["pack", str(ckpt), "--base", str(TINY_SD), "-o", str(tmp_path / "x.dduf")],
                 ["info", str(ckpt), "--base", str(TINY_SD)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and code in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("x.dduf*"))
    info = describe_checkpoint(ckpt)  # the header only: described, with what a pack would say
    assert info["architecture"] == "v1" and code in info["problem"] and key in info["problem"]
    assert main(["info", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "dduf pack would refuse it" in out and "pack it:" not in out


def test_whole_byte_fp8_still_packs(tmp_path: Path) -> None:
    """The control: F8_E4M3 (a value dtype, one per byte) is converted as before."""
    state = checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",))
    state = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in state.items()}
    ckpt = write_raw(tmp_path / "fp8.safetensors", raw_tensors(state))
    assert describe_checkpoint(ckpt).get("problem") is None
    result, _ = pack_single_file(ckpt, tmp_path / "x.dduf", base=str(TINY_SD), quiet=True)
    assert result.path.is_file()


def test_a_component_of_far_more_keys_than_base_is_refused_quickly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' LDM UNet converter scans every key once per block: with 4,000 empty ``input_blocks.N`` keys
    ``dduf info --base`` took 57 s (8,000: 145 s; imports ~40 s of each); a component of more than twice BASE's
    tensors (+ 64) is refused first."""
    from diffusers.loaders import single_file_utils as sfu

    state = raw_tensors(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",)))
    for i in range(4000):
        state[f"model.diffusion_model.input_blocks.{100 + i}.0.weight"] = ("F16", [0], b"")
    ckpt = write_raw(tmp_path / "keys.safetensors", state)
    seen = _no_tensor_viewed(monkeypatch)
    converted: list[str] = []
    monkeypatch.setattr(sfu, "convert_ldm_unet_checkpoint", lambda *a, **k: converted.append("unet"))
    with pytest.raises(DDUFPackError, match=r"holds 4\d\d\d tensors for it, more than 672 \(twice BASE's 304"):
        plan_single_file(ckpt, str(TINY_SD))
    assert seen == [] and converted == []  # refused from the key count: the quadratic converter never ran


def test_a_shape_torch_cannot_represent_is_refused(sd3: Path, tmp_path: Path) -> None:
    """Found by the fuzzer: ``[0, 2**40, 2**40]`` (no data) overflows torch's strides (a RuntimeError from
    ``torch.empty``, on the meta device as on the CPU)."""
    state = raw_tensors(sd3_checkpoint_from_pipeline(sd3, components=("transformer",)))
    key = "model.diffusion_model.joint_blocks.11.x_block.attn.qkv.weight"
    state[key] = ("F16", [0, 1 << 40, 1 << 40], b"")
    with pytest.raises(DDUFPackError, match=r"joint_blocks.11.x_block.attn.qkv.weight is declared \[0, 1099511627776"):
        plan_single_file(write_raw(tmp_path / "s.safetensors", state), str(sd3))
