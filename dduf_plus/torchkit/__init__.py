"""The torch helpers loading and packing share, on a floor of their own beneath both: building models on the meta
device within a construction budget (:mod:`.meta_model`, :mod:`.empty_init`), streaming tensors into archive
entries (:mod:`.tensor_stream`), the state of backend-quantized modules (:mod:`.quant_state`), importing
quantization backends and diffusers with the Hub off (:mod:`.backend_import`) and a thread's default dtype
(:mod:`.thread_dtype`). It imports torch; it never imports ``dduf_plus.packing`` or ``dduf_plus.loading``."""
