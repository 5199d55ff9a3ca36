"""CUDA benchmark: `python -m benchmarks.gpu.gpu_bench` (README.md here)."""
