"""Quantize at pack time (``dduf pack SRC --quantize unet=bnb-nf4``, ``pack(..., quantize=...)``): the archive equals
quantizing with diffusers (``from_pretrained(quantization_config=...)``), ``save_pretrained`` and packing that folder,
entry for entry (documented differences: ``config.json`` has no ``_name_or_path``, the path diffusers loaded from;
torchao's safetensors ``__metadata__`` key order, which safetensors writes in hash order), loads with ``load_dduf``
to the same outputs, and is fed from the source one batch of tensors at a time."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torchao") is None or importlib.util.find_spec("bitsandbytes") is None:
    pytest.skip("torchao / bitsandbytes are not installed here (pip install -e '.[quant]')", allow_module_level=True)

import torch  # noqa: E402
from bnb_shapes import assert_every_4bit_layer_repacks, four_bit_layers, require_cpu_path, use_cpu_path  # noqa: E402
from test_quant_save import SDNQ, assert_same_archive, bnb_cpu_gate, quantization_config  # noqa: E402

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.assignments import PackNameError  # noqa: E402
from dduf_plus.cli import main  # noqa: E402
from dduf_plus.errors import DDUFPackError  # noqa: E402
from dduf_plus.format.validate import validate  # noqa: E402
from dduf_plus.packing.pack import pack  # noqa: E402

quantize_module = importlib.import_module("dduf_plus.packing.quantize")


@pytest.fixture(scope="module")
def tiny_sd(pipelines_dir: Path) -> Path:
    return pipelines_dir / "tiny-sd"


def forward_on(unet: Any, dtype: torch.dtype, cpu_path: str) -> torch.Tensor:
    """:func:`forward` with a bitsandbytes 4-bit unet's layers on ``cpu_path`` (forced: the tests never depend on
    the CPU they run on; tests/bnb_shapes.py)."""
    if four_bit_layers(unet):
        assert_every_4bit_layer_repacks(unet)
        use_cpu_path(unet, cpu_path)
    return forward(unet, dtype)


def diffusers_then_pack(src: Path, out: Path, config: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Any:
    """What a user does without --quantize: quantize the unet with diffusers, save_pretrained it, pack the folder.
    ``_name_or_path`` (the path diffusers loaded from) is dropped from its config.json: pack-time has none."""
    from diffusers import UNet2DConditionModel

    bnb_cpu_gate(monkeypatch)
    unet = UNet2DConditionModel.from_pretrained(src / "unet", quantization_config=config, device_map="cpu", **kwargs)
    folder = out.parent / "diffusers-folder"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("unet"))
    unet.save_pretrained(folder / "unet")
    config_path = folder / "unet" / "config.json"
    config_path.write_text("".join(line for line in config_path.read_text().splitlines(True)
                                   if '"_name_or_path"' not in line))
    pack(folder, out, quiet=True)
    return unet


def forward(unet: Any, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=gen).to(dtype)
    text = torch.randn(1, 77, unet.config.cross_attention_dim, generator=gen).to(dtype)
    with torch.no_grad():
        return unet(sample, 1, encoder_hidden_states=text).sample


@pytest.mark.parametrize(("scheme", "cpu_path"), [("bnb-nf4", "plain"), ("bnb-nf4", "avx512_bf16"),
                                                  ("bnb-fp4", "plain"), ("bnb-fp4", "avx512_bf16"),
                                                  ("bnb-int8", "plain"), ("torchao-int8", "plain"),
                                                  ("quanto-int8", "plain"), ("quanto-float8", "plain"),
                                                  pytest.param("sdnq-int8", "plain", marks=SDNQ)])
def test_pack_time_quantization_equals_diffusers_then_pack(tiny_sd: Path, bnb_sd: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, scheme: str,
                                                           cpu_path: str) -> None:
    # SDNQ's default minimum layer size (16384 elements) leaves every tiny-sd layer alone: its config object, sized
    # down, is passed as the value (the Python API takes one); the others by name
    config = quantization_config(scheme)
    given: Any = config if scheme.startswith("sdnq") else scheme
    require_cpu_path(cpu_path)  # before the work: skips where the CPU lacks the flag
    source = bnb_sd if scheme.startswith("bnb") else tiny_sd  # bnb_sd: 4-bit layers fit both CPU paths
    ours = tmp_path / "ours.dduf"
    result, _ = pack(source, ours, quiet=True, quantize={"unet": given})
    unet = diffusers_then_pack(source, tmp_path / "theirs.dduf", quantization_config(scheme), monkeypatch)
    assert_same_archive(ours, tmp_path / "theirs.dduf")  # every entry, and the index's quantization record
    if not scheme.startswith("quanto"):  # (the index records torchao / bitsandbytes / SDNQ states; quanto: none)
        assert result.index["components"]["unet"]["quantization"]["quantized"] > 10
    report = validate(ours, verify=True, strict=not scheme.startswith("quanto"))
    # quanto's odd-sized int8 tensors sit as diffusers' save_pretrained lays them: unaligned, copied at load (Q008)
    assert report.valid and set(report.codes) <= ({"Q008"} if scheme.startswith("quanto") else set()), str(report)
    loaded = load_dduf(ours).unet  # loads, and computes what diffusers' quantized model computes
    dtype = next(p.dtype for n, p in unet.named_parameters() if n == "conv_in.weight")
    assert torch.equal(forward_on(loaded, dtype, cpu_path), forward_on(unet, dtype, cpu_path))


def test_dtype_is_the_torch_dtype_of_the_unquantized_layers(tiny_sd: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype unet=bfloat16 with --quantize unet=...: from_pretrained(torch_dtype=bfloat16, quantization_config=...);
    a default --dtype still converts the other components."""
    pack(tiny_sd, tmp_path / "ours.dduf", quiet=True, quantize={"unet": "bnb-int8"},
         dtype={"unet": "bfloat16"})
    diffusers_then_pack(tiny_sd, tmp_path / "theirs.dduf", quantization_config("bnb-int8"), monkeypatch,
                        torch_dtype=torch.bfloat16)
    assert_same_archive(tmp_path / "ours.dduf", tmp_path / "theirs.dduf")
    result, _ = pack(tiny_sd, tmp_path / "both.dduf", quiet=True, quantize=["unet=bnb-int8"], dtype="bfloat16")
    dtypes = {k: v.get("summary", {}).get("dtype") for k, v in result.index["components"].items()}
    assert dtypes["vae"] == "bfloat16" and dtypes["text_encoder"] == "bfloat16"
    with pytest.raises(DDUFPackError, match="compute dtype"):
        pack(tiny_sd, tmp_path / "x.dduf", quiet=True, quantize={"unet": "bnb-nf4"}, dtype={"unet": "float8_e4m3fn"})


def test_the_source_is_read_a_batch_at_a_time(tiny_sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never the whole component in full precision: diffusers' loader gets batches of at most BATCH_BYTES (or one
    bigger tensor), read with pread (nothing stays mapped)."""
    from diffusers.models import model_loading_utils

    monkeypatch.setattr(quantize_module, "BATCH_BYTES", 64 << 10)
    sizes: list[int] = []
    real = model_loading_utils.load_model_dict_into_meta

    def recording(model: Any, state_dict: Any, **kwargs: Any) -> Any:
        sizes.append(sum(t.nbytes for t in state_dict.values()))
        largest = max(t.nbytes for t in state_dict.values())
        assert sizes[-1] < (64 << 10) + largest
        return real(model, state_dict, **kwargs)

    monkeypatch.setattr(model_loading_utils, "load_model_dict_into_meta", recording)
    pack(tiny_sd, tmp_path / "x.dduf", quiet=True, quantize={"unet": "bnb-nf4"})
    total = sum(p.stat().st_size for p in (tiny_sd / "unet").glob("*.safetensors"))
    assert len(sizes) > 5 and max(sizes) < total / 4


@pytest.mark.parametrize(("given", "message"), [
    ({"unet": "bnb-nf5"}, r"--quantize unet=bnb-nf5: not a quantization scheme \(did you mean bnb-nf4\?\)"),
    ({"unet": "torchao-int4"}, r"did you mean torchao-int8\?"),
    ({"unte": "bnb-nf4"}, r"--quantize unte: not a component of the pipeline \(did you mean unet\?\)"),
    (["bnb-nf4"], r"name the component \(--quantize unet=bnb-nf4\)"),
])
def test_unknown_names_are_refused_with_the_nearest(tiny_sd: Path, tmp_path: Path, given: Any, message: str) -> None:
    with pytest.raises(PackNameError, match=message):
        pack(tiny_sd, tmp_path / "x.dduf", quiet=True, quantize=given)
    assert not (tmp_path / "x.dduf").exists()


def test_cli_flag(tiny_sd: Path, bnb_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.dduf"
    assert main(["pack", str(bnb_sd), "-o", str(out), "--quiet", "--quantize", "unet=BNB-NF4"]) == 0
    assert validate(out, verify=True, strict=True).valid
    # tiny-sd's 4-bit layers are narrower than one block: packed, valid, and Q009 says the AVX512-BF16 path
    # cannot take them (load_dduf keeps them on the plain path)
    assert main(["pack", str(tiny_sd), "-o", str(tmp_path / "narrow.dduf"), "--quiet", "--quantize", "unet=bnb-nf4"]) == 0
    report = validate(tmp_path / "narrow.dduf", verify=True)
    assert report.valid and [f.code for f in report.warnings] == ["Q009"], str(report)
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "nf4" in json.dumps(info)
    assert main(["pack", str(tiny_sd), "-o", str(tmp_path / "y.dduf"), "--quantize", "unet=bnb-nf5"]) == 2
    assert "did you mean bnb-nf4" in capsys.readouterr().err


def test_extracted_it_loads_with_diffusers_and_cannot_be_quantized_again(tiny_sd: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import UNet2DConditionModel

    with pytest.raises(DDUFPackError, match="text_encoder: transformers.CLIPTextModel is not a diffusers model"):
        pack(tiny_sd, tmp_path / "x.dduf", quiet=True, quantize={"text_encoder": "bnb-nf4"})
    already = tmp_path / "already"
    pack(tiny_sd, tmp_path / "q.dduf", quiet=True, quantize={"unet": "bnb-int8"})
    main(["unpack", str(tmp_path / "q.dduf"), "-o", str(already), "--quiet"])
    bnb_cpu_gate(monkeypatch)
    theirs = UNet2DConditionModel.from_pretrained(already / "unet", device_map="cpu").state_dict()
    ours = load_dduf(tmp_path / "q.dduf").unet.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(DDUFPackError, match="unet: it is already quantized"):
        pack(already, tmp_path / "y.dduf", quiet=True, quantize={"unet": "bnb-nf4"})
    with pytest.raises(DDUFPackError, match="stored as a reference"):
        pack(tiny_sd, tmp_path / "z.dduf", quiet=True, quantize={"unet": "bnb-nf4"}, exclude=["unet"],
             refs={"unet": str(tiny_sd)})


def test_scheme_names_are_checked_without_torch() -> None:
    """`dduf pack --quantize unet=bnb-nf5` answers before torch (or a backend) is imported."""
    import subprocess
    import sys

    code = ("import sys; from dduf_plus.packing.quantize import parse_quantize; "
            "assert parse_quantize(['unet=BNB-NF4']) == {'unet': 'bnb-nf4'}; "
            "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@SDNQ
def test_cli_sdnq_with_its_defaults_on_a_tiny_pipeline(tiny_sd: Path, tmp_path: Path) -> None:
    """`dduf pack --quantize unet=sdnq-int8` with SDNQ's default minimum layer sizes quantizes no tiny-sd layer: the
    archive diffusers would write was refused by Q004 at pack time; now it packs, validates (Q010, a warning: it
    loads in full precision) and loads as diffusers' from_pretrained of the same quantization does."""
    from diffusers import SDNQConfig, UNet2DConditionModel

    out = tmp_path / "sdnq.dduf"
    assert main(["pack", str(tiny_sd), "-o", str(out), "--quiet", "--quantize", "unet=sdnq-int8"]) == 0
    report = validate(out, verify=True)
    assert report.valid and report.codes == ["Q010"], str(report)
    assert not validate(out, verify=True, strict=True).valid
    loaded = load_dduf(out).unet
    ref = UNet2DConditionModel.from_pretrained(tiny_sd / "unet", quantization_config=SDNQConfig(weights_dtype="int8"))
    assert loaded.is_quantized and loaded.config["quantization_config"]["weights_dtype"] == "int8"
    torch.testing.assert_close(forward(loaded, torch.float32), forward(ref, torch.float32), rtol=1e-5, atol=1e-5)


def test_the_help_names_every_scheme() -> None:
    """`dduf pack --help` lists the schemes --quantize takes (quanto's were refused as unknown before)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["pack", "--help"]) == 0
    text = " ".join(out.getvalue().split())
    assert all(name in text.replace("- ", "-") for name in quantize_module.SCHEMES), text
