# The README's two commands call these targets. Everything installs into a virtual environment (system Pythons
# refuse pip, PEP 668): the active one when there is one (VIRTUAL_ENV), else ./.venv, made on first use.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python

.PHONY: install run test lint bench-sampler web bench-dashboard torch-cpu

# The dashboard's chart library (uPlot) comes from npm, pinned in src/gpuscope/web/package-lock.json.
web:
	npm ci --prefix src/gpuscope/web --omit=dev --no-audit --no-fund

$(PY):
	$(PYTHON) -m venv $(VENV)

# Installed again only when the package's files change (a stamp in the venv), not on every `make run`.
INSTALLED := $(VENV)/.gpuscope-installed
$(INSTALLED): $(PY) pyproject.toml $(shell find src/gpuscope -name '*.py' -o -name '*.js' -o -name '*.css' -o -name '*.html' 2>/dev/null)
	$(MAKE) --no-print-directory web
	$(PY) -m pip install --quiet .
	touch $@

install: $(INSTALLED)

# Exit 1 is the agent's own one-sentence answer (no driver: it names the --simulate command; the port is
# taken): it has been said, so make adds no "Error 1" that reads like a failed build.
run: install
	@$(VENV)/bin/gpuscope agent; rc=$$?; [ $$rc -le 1 ] || exit $$rc

# Installs everything the tests need, then runs them (GPU tests are deselected; see `make test-gpu`), on two
# pytest-xdist workers per core: most tests wait on real servers and processes, not on the CPU. The package is
# compiled first: with PYTHONDONTWRITEBYTECODE set (as on CI) every `python -m gpuscope` the tests start would
# compile it again. `pytest tests/test_x.py` alone still runs in one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 2 )))
test: web $(PY) torch-cpu
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(INSTALLED)  # the editable install replaced the one `make install` made
	$(PY) -m compileall -q src
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal
	$(PY) -m ruff check src tests benchmarks

# The tests run torch on the CPU only (the example service). Without an NVIDIA driver, torch comes from PyTorch's
# CPU index (about 0.2 GB) rather than PyPI's CUDA build (about 5 GB with its CUDA wheels); where that index cannot
# be reached, from PyPI, said in one line. A torch already installed is kept.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
torch-cpu: $(PY)
	@if [ ! -e /proc/driver/nvidia/version ] && ! command -v nvidia-smi >/dev/null 2>&1 \
	    && ! $(PY) -c 'import torch' >/dev/null 2>&1; then \
	  echo "make: no NVIDIA driver here: installing torch's CPU build from $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install --quiet --timeout 20 --retries 1 --index-url $(TORCH_CPU_INDEX) 'torch>=2.1' \
	    || echo "make: $(TORCH_CPU_INDEX) could not be used; torch comes from PyPI (its CUDA build, about 5 GB)"; \
	fi

test-gpu:
	$(PY) -m pytest -m gpu tests/gpu -q -s

bench-sampler:
	$(PY) benchmarks/bench_sampler.py --seconds 20

bench-dashboard:
	$(PY) benchmarks/bench_dashboard.py
