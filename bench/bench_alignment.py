"""Does where a weight sits in memory change a pipeline's CPU output? (docs/loading.md, "Bit-exactness")

Builds the tiny SDXL Multi-ControlNet img2img pipeline of tests/test_pipeline_kinds.py (seeded weights), saves it
with diffusers, packs it, loads it with ``from_pretrained(folder)`` (the reference) and ``load_dduf``, checks every
tensor is bit-identical, then runs 2 steps with the weights at other addresses: every parameter and buffer copied to
a buffer whose address has a chosen remainder modulo 64 (the cache line / AVX-512 vector), and the loaded
pipeline's tensors moved as a larger archive alignment would move them (same remainder modulo 4096: alignment
64 -> 4096 -> 65536 of the data section). Writes bench/results/alignment.json with its provenance.

    .venv/bin/python bench/bench_alignment.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from provenance import write_result  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tensors(pipe: Any) -> list[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    out = []
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            for name, p in module.named_parameters(recurse=False):
                out.append((module, name, p, True))
            for name, b in module.named_buffers(recurse=False):
                if b is not None:
                    out.append((module, name, b, False))
    return out


def _rehome(pipe: Any, where: Any) -> None:
    """Copy every tensor to a fresh buffer at an address ``where(tensor)`` chooses: (alignment, remainder)."""
    for module, name, t, is_param in _tensors(pipe):
        align, remainder = where(t)
        remainder -= remainder % t.element_size()  # an int64 buffer cannot start 4 bytes into a word
        n = t.numel() * t.element_size()
        buf = torch.empty(n + 2 * align, dtype=torch.uint8)
        offset = (remainder - buf.data_ptr()) % align
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        assert view.data_ptr() % align == remainder % align
        if is_param:
            module._parameters[name] = torch.nn.Parameter(view, requires_grad=False)
        else:
            module._buffers[name] = view


def _mods(pipe: Any, modulo: int) -> dict[int, int]:
    return dict(sorted(Counter(t.data_ptr() % modulo for _m, _n, t, _p in _tensors(pipe)).items()))


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def measure(tmp: Path) -> dict[str, Any]:
    import diffusers
    import test_pipeline_kinds as kinds

    from dduf_plus import load_dduf
    from dduf_plus.packing.pack import pack

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(kinds.SD, dtype=torch.float32)
    sd = {n: getattr(pipe, n) for n in ("vae", "text_encoder", "tokenizer", "unet", "scheduler")}
    cls = diffusers.StableDiffusionXLControlNetImg2ImgPipeline
    built = cls(**kinds._sdxl_components(sd), controlnet=[kinds._sdxl_controlnet(3), kinds._sdxl_controlnet(4)])
    folder = tmp / "sdxl-img2img"
    built.save_pretrained(folder)
    archive = tmp / "sdxl-img2img.dduf"
    pack(folder, archive, quiet=True)
    args = kinds._inputs("img2img", 2)

    def fresh_reference() -> Any:
        return diffusers.DiffusionPipeline.from_pretrained(folder)

    reference, loaded = fresh_reference(), load_dduf(archive)
    kinds._same_pipeline(loaded, reference)  # every tensor bit-identical
    out_ref, out_loaded = kinds._run(reference, args), kinds._run(loaded, args)
    result: dict[str, Any] = {
        "tensors": len(_tensors(reference)),
        "address_mod_64": {"from_pretrained(folder)": _mods(reference, 64), "load_dduf(archive)": _mods(loaded, 64)},
        "max_abs_diff_vs_reference": {
            "reference run again": _diff(kinds._run(reference, args), out_ref),
            "load_dduf(archive)": _diff(out_loaded, out_ref),
        },
    }
    diffs = result["max_abs_diff_vs_reference"]
    for remainder in (0, 4, 8, 16, 32):  # the reference's weights moved: does the address alone change outputs?
        moved = fresh_reference()
        _rehome(moved, lambda t, r=remainder: (64, r))
        diffs[f"reference, every tensor at address % 64 == {remainder}"] = _diff(kinds._run(moved, args), out_ref)
    moved = load_dduf(archive)
    ref_mods = {(type(m).__name__, n, tuple(t.shape)): t.data_ptr() % 64 for m, n, t, _p in _tensors(reference)}
    _rehome(moved, lambda t: (64, 0))
    diffs["load_dduf, every tensor copied to address % 64 == 0"] = _diff(kinds._run(moved, args), out_ref)
    moved = load_dduf(archive)
    misaligned = [t for _m, _n, t, _p in _tensors(moved) if t.data_ptr() % 16]
    result["load_dduf_tensors_not_16_aligned"] = {"count": len(misaligned),
                                                  "bytes": sum(t.numel() * t.element_size() for t in misaligned)}
    _rehome(moved, lambda t: (64, 0) if t.data_ptr() % 16 else (4096, t.data_ptr() % 4096))
    diffs["load_dduf, only tensors at address % 16 != 0 copied (to % 64 == 0)"] = _diff(kinds._run(moved, args), out_ref)
    for align in (64, 4096, 65536):  # a larger data-section alignment keeps each tensor's address % 4096
        moved = load_dduf(archive)
        _rehome(moved, lambda t, a=align: (a, t.data_ptr() % 4096 % a))
        diffs[f"load_dduf, data section aligned to {align} (tensor address % 4096 kept)"] = _diff(
            kinds._run(moved, args), out_loaded)
    result["reference_tensors_64_aligned"] = all(v == 0 for v in ref_mods.values())
    return result


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="dduf-align-") as tmp:
        result = measure(Path(tmp))
    result["cpu"] = {"torch_threads": torch.get_num_threads(),
                     "capability": torch.backends.cpu.get_cpu_capability()}
    write_result(ROOT / "bench" / "results" / "alignment.json", result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
