# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed

.PHONY: venv demo test lint bench clean
.DELETE_ON_ERROR:

venv: $(STAMP)

# torch first (the tested version; the CPU build on CPU-only machines), then the project.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/pdserve demo

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	$(PY) -m pytest -q

bench: venv
	$(PY) -m pdserve.bench.engine

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
