"""Mixed precision to a budget (`[quantize.mix]`): the GPTQ-family recipe table, units and costs (config.py) and
GGUF's (gguf.py), torch-free; the exact allocation (alloc.py); measured sensitivity (sensitivity.py); the plans that
tie them together for a GPTQ-family variant (plan.py) and a gguf variant (gguf_plan.py); runtime rows (runtimes.py)."""
