"""Archives that live elsewhere: the Hugging Face Hub (``hub``) and URLs read by range requests
(``fetch``). Torch-free; the loader and the packer call it."""
