# The README's two commands call these targets.
PYTHON ?= python3

.PHONY: install run test lint bench-sampler web bench-dashboard

# The dashboard's chart library (uPlot) comes from npm, pinned in src/gpuscope/web/package-lock.json.
web:
	npm ci --prefix src/gpuscope/web --omit=dev --no-audit --no-fund

install: web
	$(PYTHON) -m pip install --quiet .

run: install
	gpuscope agent

# Installs everything the tests need, then runs them (GPU tests are deselected; see `make test-gpu`).
test: web
	$(PYTHON) -m pip install --quiet -e '.[test]'
	$(PYTHON) -m pytest -q
	$(PYTHON) -m ruff check src tests benchmarks

test-gpu:
	$(PYTHON) -m pytest -m gpu tests/gpu -q -s

bench-sampler:
	$(PYTHON) benchmarks/bench_sampler.py --seconds 20

bench-dashboard:
	$(PYTHON) benchmarks/bench_dashboard.py
