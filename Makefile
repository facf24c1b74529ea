# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bench model install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,fast]'
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvprefetch serve

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/kvprefetch bench ingest --json
	$(VENV)/bin/kvprefetch bench replay --json

# Rebuild the bundled model from the shared traces (first 70% of each by time).
model: $(STAMP)
	$(PY) -m training.bundle --out models/default

clean:
	rm -rf $(VENV) var .pytest_cache
