"""The work of each quantization method (pipeline/quant/methods/<name>.py holds its declarations): quantize, save
and the session around them, with torch and the method's engine imported at the top. A method names its work module
by dotted path and pipeline.quant.method.load_work imports it on first use, so `compress check` never does. A work
module imports its own method's file and no other method's or work module (tests/unit/test_method_identity.py)."""
