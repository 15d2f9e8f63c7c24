"""Native memory safety of quantized components: every field a backend's native kernel uses as an index, count,
size or alignment is checked before the kernel runs, by ``validate`` and by the loader, with the same rule code.

Each backend's saved component (bitsandbytes 4-bit plain and double-quantized, 8-bit, torchao int8, SDNQ) has
each such field corrupted in turn; every case must be a validate error and a DDUFError from ``load_dduf`` and
from the component loader itself (a folder, no validation in front of it), never a signal and never a model
that loads different. The hostile cases run in one child process per backend (tests/native_safety_worker.py):
a segfault fails the test instead of killing pytest. optimum-quanto's misaligned int8 weights (a SIGSEGV on
the first bf16 forward before) are copied and reported as Q008. bitsandbytes 4-bit layers whose shapes the
AVX512-BF16 CPU repack refuses (Q009) are kept on the plain path."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")  # sdnq would torch.compile its quantizer: minutes on CPU
# (reasons without "could not import": .ci/run fails on those, every declared extra being installed there)
pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed here (pip install -e '.[quant]')")
pytest.importorskip("torchao", reason="torchao is not installed here (pip install -e '.[quant]')")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dduf_plus.format import quant_bnb, quant_sdnq  # noqa: E402
from dduf_plus.format.quantization import QuantError  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.packing.pack import pack  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY_SD = HERE.parent / "fixtures" / "pipelines" / "tiny-sd"
WEIGHTS = "diffusion_pytorch_model.safetensors"
BLOCK = "mid_block.attentions.0.transformer_blocks.0"
LAYER = f"{BLOCK}.attn1.to_q"  # nn.Linear [32, 32]
WIDE = f"{BLOCK}.ff.net.0.proj"  # nn.Linear [256, 32]: 8,192 weights, 128 absmax blocks of 64
Tensors = dict[str, torch.Tensor]
Edit = Callable[[Tensors, dict[str, str]], None]


# --- building saved components -------------------------------------------------------------------------------
def _bnb_folder(root: Path, **options: Any) -> Path:
    """tiny-sd whose unet diffusers quantized with bitsandbytes and saved (its GPU gate bypassed: bnb runs on CPU)."""
    from diffusers import BitsAndBytesConfig, UNet2DConditionModel
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    patch = pytest.MonkeyPatch()
    for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
        patch.setattr(cls, "validate_environment", lambda self, *args, **kwargs: None)
    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    try:
        unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", quantization_config=BitsAndBytesConfig(**options),
                                                    device_map="cpu")
        unet.save_pretrained(root / "unet")  # before any forward: a CPU forward may repack 4-bit weights
    finally:
        patch.undo()
    return root


def _torchao_folder(root: Path) -> Path:
    from diffusers import TorchAoConfig, UNet2DConditionModel
    from torchao.quantization import Int8WeightOnlyConfig

    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", torch_dtype=torch.bfloat16,
                                                quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    unet.save_pretrained(root / "unet")
    return root


def _sdnq_folder(root: Path) -> Path:
    from diffusers import SDNQConfig, UNet2DConditionModel

    shutil.copytree(TINY_SD, root, ignore=shutil.ignore_patterns("unet"))
    config = SDNQConfig(weights_dtype="uint4", minimum_allowed_numel=256, minimum_allowed_channel_size=16)
    unet = UNet2DConditionModel.from_pretrained(TINY_SD / "unet", quantization_config=config, torch_dtype=torch.float32)
    unet.save_pretrained(root / "unet")
    return root


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "bnb4": lambda root: _bnb_folder(root, load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb4-nested": lambda root: _bnb_folder(root, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True),
    "bnb8": lambda root: _bnb_folder(root, load_in_8bit=True),
    "torchao": _torchao_folder,
    "sdnq": _sdnq_folder,
}


def _read(folder: Path) -> tuple[Tensors, dict[str, str]]:
    path = folder / "unet" / WEIGHTS
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118 - safe_open's API


def _hostile(base: Path, out: Path, edit: Edit, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(folder, archive) of ``base`` with its unet's tensors / metadata edited and rewritten as safetensors
    writes them, packed as a foreign writer would (nothing checked on the way)."""
    folder = out / "folder"
    shutil.copytree(base, folder)
    tensors, metadata = _read(folder)
    edit(tensors, metadata)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "unet" / WEIGHTS), metadata=metadata)
    monkeypatch.setattr(importlib.import_module("dduf_plus.packing.pack"), "_backend_records", lambda sources: {})
    monkeypatch.setattr(importlib.import_module("dduf_plus.format.pack"), "check_written", lambda tmp, o: None)
    archive = out / "hostile.dduf"
    pack(folder, archive, quiet=True)
    return folder, archive


# --- corruptions ---------------------------------------------------------------------------------------------
def _state(layer: str, change: Callable[[dict[str, Any]], None]) -> Edit:
    """An edit of a 4-bit layer's packed quant_state JSON."""
    def edit(tensors: Tensors, metadata: dict[str, str]) -> None:
        key = next(k for k in tensors if k.startswith(f"{layer}.weight.quant_state."))
        state = json.loads(bytes(tensors[key].tolist()))
        change(state)
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return edit


def _set(key: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
    def edit(tensors: Tensors, metadata: dict[str, str]) -> None:
        tensors[key] = make(tensors[key])
    return edit


def _drop(key: str) -> Edit:
    def edit(tensors: Tensors, metadata: dict[str, str]) -> None:
        del tensors[key]
    return edit


def _description(layer: str, change: Callable[[dict[str, Any]], None]) -> Edit:
    """An edit of a torchao layer's JSON description in the safetensors __metadata__."""
    def edit(tensors: Tensors, metadata: dict[str, str]) -> None:
        value = json.loads(metadata[f"{layer}.weight"])
        change(value)
        metadata[f"{layer}.weight"] = json.dumps(value)
    return edit


W = f"{LAYER}.weight"
BNB4_CASES: dict[str, tuple[Edit, str]] = {
    "quant_map 8 values": (_set(f"{W}.quant_map", lambda t: t[:8]), "Q003"),
    "quant_map float16": (_set(f"{W}.quant_map", lambda t: t.half()), "Q007"),
    "absmax one short": (_set(f"{W}.absmax", lambda t: t[:-1]), "Q003"),
    "absmax uint8 without nesting": (_set(f"{W}.absmax", lambda t: t.to(torch.uint8)), "Q007"),
    "packed data one short": (_set(W, lambda t: t[:-1]), "Q003"),
    "blocksize 128": (_state(LAYER, lambda s: s.update(blocksize=128)), "Q003"),
    "shape one row short": (_state(LAYER, lambda s: s.update(shape=[31, 32])), "Q003"),
    "shape 3-D": (_state(LAYER, lambda s: s.update(shape=[1, 32, 32])), "Q007"),
    "dtype missing": (_state(LAYER, lambda s: s.pop("dtype")), "Q007"),
    "unknown field": (_state(LAYER, lambda s: s.update(bogus=1)), "Q005"),
    "stray nested_offset": (_state(LAYER, lambda s: s.update(nested_offset=0.5)), "Q007"),
}
NESTED_CASES: dict[str, tuple[Edit, str]] = {
    "nested_quant_map 1 value": (_set(f"{W}.nested_quant_map", lambda t: t[:1]), "Q007"),  # 816 bytes over-read
    "nested_quant_map 255 values": (_set(f"{W}.nested_quant_map", lambda t: t[:255]), "Q007"),
    "nested_quant_map float16": (_set(f"{W}.nested_quant_map", lambda t: t.half()), "Q007"),
    "nested_quant_map missing": (_drop(f"{W}.nested_quant_map"), "Q002"),
    "nested_absmax empty": (_set(f"{W}.nested_absmax", lambda t: t[:0]), "Q007"),
    "nested_absmax two values": (_set(f"{W}.nested_absmax", lambda t: t.repeat(2)), "Q007"),
    "nested_absmax float16": (_set(f"{W}.nested_absmax", lambda t: t.half()), "Q007"),
    "absmax float32 with nesting": (_set(f"{W}.absmax", lambda t: t.float()), "Q007"),
    "nested_blocksize under the stored count": (_state(WIDE, lambda s: s.update(nested_blocksize=32)), "Q007"),
    "nested_blocksize missing": (_state(LAYER, lambda s: s.pop("nested_blocksize")), "Q007"),
    "nested_offset not a number": (_state(LAYER, lambda s: s.update(nested_offset="nan")), "Q005"),
    "nested_offset infinite": (_state(LAYER, lambda s: s.update(nested_offset=float("inf"))), "Q005"),
    "nested_dtype a torch function": (_state(LAYER, lambda s: s.update(nested_dtype="load")), "Q005"),
}
BNB8_CASES: dict[str, tuple[Edit, str]] = {
    "SCB one short": (_set(f"{LAYER}.SCB", lambda t: t[:-1]), "Q003"),
    "SCB one value": (_set(f"{LAYER}.SCB", lambda t: t[:1]), "Q003"),
    "SCB float16": (_set(f"{LAYER}.SCB", lambda t: t.half()), "Q003"),
    "weight flattened": (_set(W, lambda t: t.reshape(-1)), "Q003"),
}
Q = f"{LAYER}._weight"
TORCHAO_CASES: dict[str, tuple[Edit, str]] = {
    "block_size not tiling qdata": (_description(LAYER, lambda d: d["_data"].update(block_size=[1, 7])), "Q007"),
    "block_size per-group over a per-row scale": (
        _description(LAYER, lambda d: d["_data"].update(block_size=[1, 16])), "Q007"),
    "block_size not integers": (_description(LAYER, lambda d: d["_data"].update(block_size=["1", 32])), "Q007"),
    "scale two columns": (_set(f"{Q}_scale", lambda t: t.repeat(1, 2)), "Q007"),
    "scale one row": (_set(f"{Q}_scale", lambda t: t[:1]), "Q003"),
    "zero_point one value": (_set(f"{Q}_zero_point", lambda t: t[:1]), "Q003"),
    "qdata flattened": (_set(f"{Q}_qdata", lambda t: t.reshape(-1)), "Q003"),
}
SDNQ_CASES: dict[str, tuple[Edit, str]] = {
    "scale one value": (_set(f"{LAYER}.scale", lambda t: t[:1]), "Q003"),
    "scale without its kept axis": (_set(f"{LAYER}.scale", lambda t: t.reshape(-1)), "Q003"),
    "scale int8": (_set(f"{LAYER}.scale", lambda t: t.to(torch.int8)), "Q003"),
    "zero_point one value": (_set(f"{LAYER}.zero_point", lambda t: t[:1]), "Q003"),
    "zero_point missing": (_drop(f"{LAYER}.zero_point"), "Q002"),
    "weight int8 for uint4": (_set(W, lambda t: t.to(torch.int8)), "Q004"),
    # a packed weight's value count is the model's to say: validate cannot see it, the loader refuses by Q006
    "packed weight a quarter of its bytes": (_set(W, lambda t: t[: t.numel() // 4]), "-Q006"),
    "packed weight under its groups": (_set(W, lambda t: t[:4]), "Q003"),
}
CASES = {"bnb4": BNB4_CASES, "bnb4-nested": NESTED_CASES, "bnb8": BNB8_CASES, "torchao": TORCHAO_CASES,
         "sdnq": SDNQ_CASES}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(backend: str) -> Path:
        if backend not in cache:
            if backend == "sdnq" and importlib.util.find_spec("sdnq") is None:
                pytest.skip("sdnq is not installed here")
            cache[backend] = BUILDERS[backend](tmp_path_factory.mktemp(backend) / "tiny-sd")
        return cache[backend]
    return get


def _run_worker(cases: list[dict[str, str]], tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The cases through validate / load_dduf / the loader in a child process; a signal fails the test, naming
    the case it died in."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    done = subprocess.run([sys.executable, str(HERE / "native_safety_worker.py"), str(spec)], capture_output=True,
                          text=True, env=env, timeout=900, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert done.returncode == 0, (f"worker died with {done.returncode} in case {started[-1] if started else None!r}: "
                                  f"{done.stderr[-2000:]}")
    return {line["name"]: line for line in lines if "name" in line}


@pytest.mark.parametrize("backend", list(CASES))
def test_each_kernel_field_corrupted_is_refused_by_validate_and_loader(
        backend: str, built: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = built(backend)
    cases = []
    for i, (name, (edit, _code)) in enumerate(CASES[backend].items()):
        folder, archive = _hostile(base, tmp_path / f"case{i}", edit, monkeypatch)
        cases.append({"name": name, "archive": str(archive), "folder": str(folder), "component": "unet"})
    results = _run_worker(cases, tmp_path)
    wrong = []
    for name, (_edit, code) in CASES[backend].items():
        got = results[name]
        if code.startswith("-"):  # only the loader can tell (it needs the model class): validate sees no error
            code = code[1:]
            if [f for f in got["validate"] if f[1] == "error"]:
                wrong.append((name, "validate", got["validate"]))
        elif (code, "error") not in [tuple(f) for f in got["validate"]]:
            wrong.append((name, "validate", got["validate"]))
        wrong += [(name, how, got[how]) for how in ("load_dduf", "loader")
                  if got[how]["kind"] != "DDUFError" or code not in got[how]["codes"]]
    assert not wrong, wrong


def test_the_unmodified_components_validate_and_load(built: Callable[[str], Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same path with no edit loads everywhere (so the refusals above are the edits')."""
    cases = []
    for backend in CASES:
        folder, archive = _hostile(built(backend), tmp_path / backend, lambda t, m: None, monkeypatch)
        cases.append({"name": backend, "archive": str(archive), "folder": str(folder), "component": "unet"})
    results = _run_worker(cases, tmp_path)
    for backend in CASES:
        got = results[backend]
        assert not [f for f in got["validate"] if f[1] == "error"], (backend, got["validate"])
        assert got["load_dduf"] == {"kind": "loaded"} and got["loader"] == {"kind": "loaded"}, (backend, got)


# --- bitsandbytes 4-bit on CPUs with AVX512-BF16 (Q009) ---------------------------------------------------------
def test_unfit_4bit_layers_stay_off_the_avx512_bf16_repack(built: Callable[[str], Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU with avx512_bf16 (simulated: bitsandbytes asks has_avx512bf16() when it builds a Linear4bit),
    Linear4bit.forward repacks its weight first and fails on shapes it cannot repack (diffusers' own load of
    this unet: RuntimeError in the first forward). validate warns (Q009, naming a layer and its limit); the
    loader keeps exactly those layers on the plain path, and the others still take the repack."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import modules as bnb_modules

    from dduf_plus import load_dduf

    archive = tmp_path / "bnb4.dduf"
    pack(built("bnb4"), archive, quiet=True)
    report = validate(archive)
    assert report.valid and [f.code for f in report.warnings] == ["Q009"], str(report)
    assert "out_features 16 is not a multiple of 32" in report.warnings[0].message \
        or "narrower than one block (64)" in report.warnings[0].message, report.warnings[0].message
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    with caplog.at_level(logging.DEBUG, logger="dduf_plus"):
        unet = load_dduf(archive).unet
    layers = {name: m for name, m in unet.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    unfit = {n for n, m in layers.items()
             if quant_bnb.bnb_cpu_repack_problem(m.weight.quant_state.shape, m.weight.quant_state.blocksize)}
    assert unfit and len(unfit) < len(layers)  # tiny-sd has both kinds (ff.net.2 [32, 128] fits)
    assert {n for n, m in layers.items() if not m.support_avx512bf16_for_cpu} == unfit
    assert any(f"Q009: {len(unfit)} bitsandbytes 4-bit layers kept on the plain CPU path" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    first = next(iter(unfit))
    state = layers[first].weight.quant_state
    with pytest.raises((RuntimeError, AssertionError)):  # what the repack does to such a layer
        bnb_functional._convert_weight_packed_for_cpu(layers[first].weight.data.clone(), copy_state(state))
    repacked: list[tuple[int, ...]] = []

    def recording(weight: torch.Tensor, quant_state: Any, block_n: int = 32) -> tuple[torch.Tensor, Any]:
        repacked.append(tuple(quant_state.shape))
        return weight, quant_state  # the plain path computes with it as stored

    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", recording)
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=gen, dtype=torch.float16)
    text = torch.randn(1, 77, unet.config.cross_attention_dim, generator=gen, dtype=torch.float16)
    with torch.no_grad():
        out = unet(sample, 1, encoder_hidden_states=text).sample
    assert torch.isfinite(out).all()
    fit_shapes = {tuple(m.weight.quant_state.shape) for n, m in layers.items() if n not in unfit}
    assert repacked and set(repacked) <= fit_shapes
    assert not {s for s in repacked if quant_bnb.bnb_cpu_repack_problem(s, 64)}


def copy_state(state: Any) -> Any:
    import copy

    return copy.deepcopy(state)


# --- optimum-quanto: misaligned int8 weights (Q008) ---------------------------------------------------------------
QUANTO_CHILD = r"""
import json, sys, torch
from dduf_plus import load_dduf
from dduf_plus.loading import quant
outs = {}
for name in ("aligned", "misaligned"):
    model = load_dduf(sys.argv[1 if name == "aligned" else 2], torch_dtype=torch.bfloat16).transformer
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 5, 32, generator=g).bfloat16(), timestep=torch.tensor([10]),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    with torch.no_grad():
        outs[name] = model(**inputs).sample
    assert all(m.weight._data.data_ptr() % quant.KERNEL_ALIGNMENT == 0 for m in model.modules()
               if hasattr(getattr(m, "weight", None), "_data") and m.weight._data.dtype == torch.int8)
print(json.dumps({"equal": bool(torch.equal(outs["aligned"], outs["misaligned"]))}))
"""


def test_misaligned_quanto_int8_with_fp16_scales_loaded_as_bf16(tmp_path: Path) -> None:
    """qint8 weights with float16 scales, written in safetensors.save_file's order (int8 data off 16-byte
    boundaries) and loaded as bfloat16: the loader used to decide the copy from the stored scales' dtype (fp16:
    no copy) and quanto's bf16 kernel then read the misaligned data: SIGSEGV in the first forward. Now every
    misaligned int8 weight is copied (validate lists them: Q008), in a child process so a crash fails here."""
    from diffusers import PixArtTransformer2DModel

    try:
        from optimum.quanto import freeze, qint8, quantize
    except ImportError:
        pytest.skip("optimum-quanto is not installed here (pip install -e '.[quanto]')")

    from conftest import PIPELINES
    from dduf_plus.loading import quant

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     torch_dtype=torch.float16)
    quantize(model, weights=qint8)
    freeze(model)
    archives = []
    for aligned in (True, False):
        root = tmp_path / ("aligned" if aligned else "misaligned")
        shutil.copytree(PIPELINES / "tiny-dit", root)
        folder = root / "transformer"
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        if aligned:
            quant.save_quanto_component(model, folder)
        else:
            tensors, qmap = quant.quanto_state(model)
            save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
            (folder / quant.QMAP_NAME).write_bytes(qmap)
        archives.append(tmp_path / f"{root.name}.dduf")
        pack(root, archives[-1], quiet=True)
    assert "Q008" not in validate(archives[0]).codes
    report = validate(archives[1])
    assert report.valid and [f.code for f in report.warnings] == ["Q008"], str(report)
    assert "the loader copies them" in report.warnings[0].message
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    done = subprocess.run([sys.executable, "-c", QUANTO_CHILD, str(archives[0]), str(archives[1])],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, f"child died with {done.returncode}: {done.stderr[-2000:]}"
    assert json.loads(done.stdout.splitlines()[-1]) == {"equal": True}


def test_sdnq_wildcard_patterns_are_capped() -> None:
    """SDNQ matches every parameter name against each '*' pattern with re.match on a pattern string: past the re
    module's cache (512) every call compiles again. 8,000 such patterns made a tiny UNet's load take 81 s here
    (0.31 s without; 19 s on a quieter machine); 256 take 0.36 s. Past 256: Q005, validate and loader alike."""
    cap = quant_sdnq.MAX_SDNQ_WILDCARD_PATTERNS
    names = [f"block{i}.attn" for i in range(4000)]  # plain names stay cheap (string compares): still allowed
    quant_sdnq.check_sdnq_config({"modules_to_not_convert": names + [f"x{i}.*.proj" for i in range(cap)]})
    with pytest.raises(QuantError, match=r"257 module patterns with '\*'") as refused:
        quant_sdnq.check_sdnq_config({"modules_to_not_convert": [f"x{i}.*.proj" for i in range(cap)],
                                       "modules_to_not_use_matmul": ["y.*"]})
    assert refused.value.code == "Q005"


@pytest.mark.parametrize(("part", "make"), [("_scale", lambda t: t[:1]), ("_data", lambda t: t.reshape(-1)),
                                            ("_data", lambda t: t[:4])])
def test_quanto_parts_unlike_their_layer_are_refused_at_load(tmp_path: Path, part: str,
                                                             make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """quanto wraps whatever shapes it is given; torch's int8 kernel then indexes one scale per output row in
    the first forward. The loader compares the stored parts with the layer first: Q006, nothing built."""
    from diffusers import PixArtTransformer2DModel

    try:
        from optimum.quanto import freeze, qint8, quantize
    except ImportError:
        pytest.skip("optimum-quanto is not installed here (pip install -e '.[quanto]')")

    from conftest import PIPELINES
    from dduf_plus.errors import DDUFError
    from dduf_plus.loading import quant
    from dduf_plus.loading.files import FolderComponentFiles

    model = PixArtTransformer2DModel.from_pretrained(PIPELINES / "tiny-dit", subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)
    quantize(model, weights=qint8)
    freeze(model)
    root = tmp_path / "pipe"
    shutil.copytree(PIPELINES / "tiny-dit", root)
    for f in (root / "transformer").glob("*.safetensors*"):
        f.unlink()
    tensors, qmap = quant.quanto_state(model)
    key = next(k for k in tensors if k.endswith(f"attn1.to_q.weight.{part}"))
    tensors[key] = make(tensors[key]).contiguous()
    save_file(tensors, str(root / "transformer" / WEIGHTS), metadata={"format": "pt"})
    (root / "transformer" / quant.QMAP_NAME).write_bytes(qmap)
    with pytest.raises(DDUFError, match=r"Q003 transformer/quanto_qmap.json: optimum-quanto: \S*attn1\.to_q: qint8"):
        pack(root, tmp_path / "pipe.dduf", quiet=True)
    config = json.loads((root / "transformer" / "config.json").read_text())  # the loader's own check, unvalidated:
    with pytest.raises(DDUFError, match=r"Q006: \S*attn1\.to_q \(qint8\) is stored with weight\." + part) as refused:
        quant.load_quanto_component(PixArtTransformer2DModel, config, FolderComponentFiles(root / "transformer"))
    assert refused.value.code == "Q006"
