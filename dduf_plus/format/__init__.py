"""Format layer: ZIP, safetensors headers, the dduf_plus index, validation. Standard library only:
nothing under this package imports torch, diffusers or transformers at import time."""
