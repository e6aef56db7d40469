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

# Installs everything the tests need, then runs them (GPU tests are deselected; see `make test-gpu`), on two
# pytest-xdist workers per core: most tests wait on real servers and processes, not on the CPU. The package is
# compiled first: with PYTHONDONTWRITEBYTECODE set (as on CI) every `python -m gpuscope` the tests start would
# compile it again. `pytest tests/test_x.py` alone still runs in one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 2 )))
test: web
	$(PYTHON) -m pip install --quiet -e '.[test]'
	$(PYTHON) -m compileall -q src
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal
	$(PYTHON) -m ruff check src tests benchmarks

test-gpu:
	$(PYTHON) -m pytest -m gpu tests/gpu -q -s

bench-sampler:
	$(PYTHON) benchmarks/bench_sampler.py --seconds 20

bench-dashboard:
	$(PYTHON) benchmarks/bench_dashboard.py
