"""A stand-in for the two vLLM names kvtail's worker module imports.

Only for benchmarks/bench_worker_gpu.py on a GPU machine without vLLM: the
worker's completion path (the thing measured) touches no other vLLM code.
"""

__version__ = "0.33.0"
