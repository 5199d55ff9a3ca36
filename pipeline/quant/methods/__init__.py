"""One file per quantization method or export format (pipeline/quant/method.py is the interface they implement,
pipeline/quant/registry.py the one list of them). A method file imports no other method's file."""
