"""Models: where they come from (sources, materialize, gguf_header), how a source loads (models), their architectures
and dtypes, compute settings. A checkpoint folder a stage wrote loads through pipeline/quant/checkpoint.py; peak
memory is pipeline/base/memory.py."""
