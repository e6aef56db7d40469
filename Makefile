# The README's two commands call these targets.
PYTHON ?= python3

.PHONY: install run test lint bench-sampler

install:
	$(PYTHON) -m pip install --quiet .

run: install
	gpuscope agent

# Installs everything the tests need, then runs them (GPU tests are deselected; see `make test-gpu`).
test:
	$(PYTHON) -m pip install --quiet -e '.[test]'
	$(PYTHON) -m pytest -q
	$(PYTHON) -m ruff check src tests benchmarks

test-gpu:
	$(PYTHON) -m pytest -m gpu tests/gpu -q -s

bench-sampler:
	$(PYTHON) benchmarks/bench_sampler.py --seconds 20
