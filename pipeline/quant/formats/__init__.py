"""Checkpoint formats the methods write: each format's torch-free declaration (gptq.py: GPTQModel-loaded checkpoints;
ct.py: compressed-tensors) beside its work (ct_export.py: a GPTQ or AWQ folder rewritten as compressed-tensors;
ct_w8a8.py: a W8A8 checkpoint written by compressed-tensors; gguf_export.py and gguf_convert.py: GGUF files)."""
