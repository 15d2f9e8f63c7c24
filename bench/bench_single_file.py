"""Single-file checkpoints in, on an SDXL-shaped fp16 fine-tune: pack time and archive size vs the
checkpoint, and load time of the archive vs diffusers' ``from_single_file``.

    python bench/bench_single_file.py [--repeat 3]

The pipeline is SDXL-shaped but smaller than SDXL, to fit a 2-vCPU VM: real CLIP-L text encoder (123M),
real SDXL VAE config (84M), an OpenCLIP-bigG-wide second encoder with 10 layers of 32 (262M), a UNet of SDXL's
widths (320/640/1280, cross-attention 2048) with 1/2/2 transformer layers instead of 1/2/10 (899M); random
seeded weights, saved in fp16 as BASE (bench/_work/single_file/base). The "fine-tune" is BASE's UNet + 0.01 in
the original SGM layout with BASE's VAE and encoders (tests/single_file_ckpt.py's reverse mapping), fp16.
Loads run in fresh subprocesses, imports done before the clock, alternating; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

OUT = WORK / "single_file"
LOAD = r"""
import sys, time, torch, diffusers, transformers
from diffusers import StableDiffusionXLPipeline
from dduf_plus.loading.pipeline import load_dduf
import dduf_plus.refs.resolve  # noqa
which, archive, ckpt, base = sys.argv[1:5]
t = time.perf_counter()
if which == "dduf":
    pipe = load_dduf(archive)
else:
    pipe = StableDiffusionXLPipeline.from_single_file(ckpt, config=base, torch_dtype=torch.float16,
                                                      local_files_only=True)
for m in (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
    for p in m.parameters():
        p.data.view(-1)[:1].sum()
print(time.perf_counter() - t)
"""


def build(base: Path, ckpt: Path) -> None:
    """BASE (fp16 folder) and the fine-tune checkpoint, once."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from safetensors.torch import save_file
    from single_file_ckpt import checkpoint_from_pipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(0)
    tok = CLIPTokenizer.from_pretrained(ROOT / "fixtures" / "pipelines" / "tiny-sd" / "tokenizer")
    unet = UNet2DConditionModel(
        block_out_channels=(320, 640, 1280), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(5, 10, 20),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        transformer_layers_per_block=(1, 2, 2), projection_class_embeddings_input_dim=2816, cross_attention_dim=2048)
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), latent_channels=4, sample_size=1024,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=2, scaling_factor=0.13025)
    ids = {"vocab_size": 49408, "max_position_embeddings": 77}
    te = CLIPTextModel(CLIPTextConfig(hidden_size=768, num_hidden_layers=12, intermediate_size=3072,
                                      num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu", **ids))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, num_hidden_layers=10, intermediate_size=5120,
                                                     num_attention_heads=20, projection_dim=1280, hidden_act="gelu",
                                                     **ids))
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok,
                                     unet=unet, scheduler=EulerDiscreteScheduler())
    pipe.to(torch.float16).save_pretrained(base)
    del pipe, unet, vae, te, te2
    save_file(checkpoint_from_pipeline(base, "xl_base", unet_delta=0.01), ckpt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    base, ckpt, archive = OUT / "base", OUT / "finetune.safetensors", OUT / "finetune.dduf"
    if not ckpt.is_file():
        build(base, ckpt)
    from dduf_plus.packing.single_file import pack_single_file

    packs = []
    for _ in range(args.repeat):
        archive.unlink(missing_ok=True)
        t = time.perf_counter()
        result, partial = pack_single_file(ckpt, archive, base=str(base), quiet=True)
        packs.append(time.perf_counter() - t)
    loads: dict[str, list[float]] = {"dduf": [], "from_single_file": []}
    for _ in range(args.repeat):
        for which in loads:
            done = subprocess.run([sys.executable, "-c", LOAD, which, str(archive), str(ckpt), str(base)],
                                  capture_output=True, text=True, check=True, cwd=ROOT)
            loads[which].append(float(done.stdout.strip().splitlines()[-1]))
    row = {"checkpoint_bytes": ckpt.stat().st_size, "archive_bytes": result.bytes_written,
           "pack_s": round(median(packs), 3), "pack_runs": [round(x, 3) for x in packs],
           "load_dduf_s": round(median(loads["dduf"]), 3),
           "load_from_single_file_s": round(median(loads["from_single_file"]), 3), "loads": loads,
           "referenced": sorted(partial.references), "report": partial.report}
    write_result(RESULTS / "single_file.json", row)
    print(json.dumps({k: v for k, v in row.items() if k != "report"}, indent=2))


if __name__ == "__main__":
    main()
