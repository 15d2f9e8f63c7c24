"""The README quick start's main job, on the built-in fixtures (no network):

pack a fixture pipeline, show `dduf info`, unpack it, load the archive with torch_dtype="auto",
print per-component dtypes and the load times (the first load in a process, split into diffusers' and
transformers' lazy imports and loading, and a second load, which imports nothing), write a generated image to
a PNG (noise: the fixture has random weights), then pack a fine-tune against its base as a partial archive and
load that too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "pipelines"
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "out"


def dduf(*args: str) -> None:
    print(f"$ dduf {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "dduf_plus.cli", *args], check=True)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    archive = OUT / "tiny-sd.dduf"
    dduf("pack", str(FIXTURES / "tiny-sd"), "-o", str(archive), "--quiet", "--force")  # --force: rerunnable
    dduf("info", str(archive))
    dduf("unpack", str(archive), "-o", str(OUT / "tiny-sd-unpacked"), "--force")
    dduf("validate", str(archive))

    try:
        from dduf_plus import load_dduf  # also drops transformers' harmless torchvision-fallback notice
    except ImportError:
        print("(load_dduf not available in this build)")
        return
    import torch

    # The first load_dduf in a process also imports the diffusers/transformers model code the pipeline needs
    # (diffusers imports lazily): seconds on a small VM, paid once per process, by diffusers' own
    # from_pretrained too. The second load of the same archive imports nothing: the difference is the imports.
    started = time.perf_counter()
    load_dduf(archive, torch_dtype="auto")
    first = time.perf_counter() - started
    started = time.perf_counter()
    pipe = load_dduf(archive, torch_dtype="auto")
    seconds = time.perf_counter() - started
    print(f"first load_dduf in this process {first:.2f} s: about {max(first - seconds, 0):.2f} s importing diffusers, "
          f"transformers and the pipeline's model code (once per process) + {seconds:.2f} s loading; a second load of this "
          f"{archive.stat().st_size / 1e6:.1f} MB archive took {seconds * 1000:.0f} ms ({type(pipe).__name__})")
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            print(f"  {name:<14} {next(component.parameters()).dtype}")
    pipe.set_progress_bar_config(disable=True)  # two steps: diffusers' bar would be noise here
    image = pipe("a red square", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator("cpu").manual_seed(0)).images[0]
    image.save(OUT / "tiny-sd.png")
    print(f"wrote {OUT / 'tiny-sd.png'} (32x32 noise: the fixture's weights are random, the pipeline ran as saved)")

    partial = OUT / "tiny-sd-finetune.partial.dduf"
    dduf("pack", str(FIXTURES / "tiny-sd-finetune"), "-o", str(partial), "--base", str(FIXTURES / "tiny-sd"),
         "--quiet", "--force")
    dduf("info", str(partial))
    pipe = load_dduf(partial, torch_dtype="auto")
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red square", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator("cpu").manual_seed(0)).images[0]
    image.save(OUT / "tiny-sd-finetune.png")
    print(f"loaded the partial archive ({partial.stat().st_size} bytes, references resolved locally); "
          f"wrote {OUT / 'tiny-sd-finetune.png'} (noise too)")


if __name__ == "__main__":
    main()
