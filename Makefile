# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint bench model install clean demo demo-litellm walkthrough compose-check

# Every extra (all: sim, training, bench, tune, fleet, mlflow; and fast): the tests run every command.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./client -e '.[test,fast,all]'
	@touch $(STAMP)

install: $(STAMP)

# `make run` needs the service alone (the base install and the compiled model's `fast` extra),
# not the simulator's, training's, benchmarks' or tests' dependencies: a fresh clone serves
# sooner.
RUN_STAMP := $(VENV)/.run-stamp

$(RUN_STAMP): pyproject.toml client/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ./client -e '.[fast]'
	@touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/kvprefetch serve

# Three pytest-xdist workers on the 2-core machine the timings were taken on: at two, the cores
# sat idle a fifth of the suite (82% busy) while tests waited on the processes they start, at
# three 92%, and the suite took 648 s of pytest against 873 (all passing in both); the e2e tests
# still run one at a time (their group). TEST_WORKERS=0 runs in one process.
# --dist loadgroup keeps each module, and the groups in tests/conftest.py, to one worker; the
# groups run in the order that file sets (slow ones first), not reordered by size.
TEST_WORKERS ?= 3

# The dashboard's browser test needs Debian's chromium, the /metrics test promtool (Debian's
# prometheus package), the LMCache sink's tests a real coordinator (its own venv, .venv-lmcache),
# the Mooncake tier's a real master and store (Debian's libibverbs1, the wheel in the venv), the
# agent integrations' LangGraph and the OpenAI Agents SDK (their own venv, .venv-agents), the
# LiteLLM plug-in's a real proxy (its own venv, .venv-litellm): each installed first when
# missing (needs root for apt), a failure where it can't be; the three venvs side by side
# (.ci/ensure-venvs).
#
# Meanwhile the bundled model is compiled into lleaves' cache (`kvprefetch compile-model`): on a
# new machine a first compile takes one to two minutes of a core, and each service the tests
# start would otherwise begin it afresh in the background. And the packages' bytecode is written
# once (where PYTHONDONTWRITEBYTECODE is set, every process the tests start compiled every module
# it imports).
test: $(STAMP) lint
	@$(VENV)/bin/kvprefetch compile-model > $(VENV)/.compile-model.log 2>&1 & compiling=$$!; \
	  bash .ci/ensure-chromium && bash .ci/ensure-promtool && bash .ci/ensure-venvs \
	  && VENV=$(VENV) bash .ci/ensure-mooncake; ready=$$?; \
	  if ! wait $$compiling; then cat $(VENV)/.compile-model.log; exit 1; fi; \
	  cat $(VENV)/.compile-model.log; exit $$ready
	$(PY) -m compileall -q app client/kvprefetch_client sim training bench kvprefetch_cli > /dev/null
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# Style, lint (the 100 columns included) and types: each fails make test.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The service plus a shared trace replayed against it over HTTP at 20x: open the printed
# dashboard URL and watch it fill. Ctrl-C stops both. DEMO_SPEED, DEMO_TRACE: see deploy/demo.sh.
demo: $(STAMP)
	VENV=$(VENV) bash deploy/demo.sh

# A data scientist's round trip: a log, two models trained, tracked, compared, shadowed and
# promoted (deploy/walkthrough.sh; docs/data-science/walkthrough.md).
walkthrough: $(STAMP)
	VENV=$(VENV) bash deploy/walkthrough.sh

# A LiteLLM proxy with the kvprefetch plug-in before two stub servers: three sessions reported,
# one steered by its route hint (deploy/litellm_demo.py).
demo-litellm: $(STAMP)
	bash .ci/ensure-litellm
	PYTHONPATH=. $(PY) deploy/litellm_demo.py

# `docker compose config` on docker-compose.yml, no engine needed (fetches Compose v2 if missing).
compose-check:
	bash .ci/compose-config --quiet

bench: $(STAMP)
	$(VENV)/bin/kvprefetch bench ingest --json
	$(VENV)/bin/kvprefetch bench replay --json

# Rebuild the bundled model from the shared traces (first 70% of each by time).
model: $(STAMP)
	$(PY) -m training.bundle --out models/default

clean:
	rm -rf $(VENV) .venv-lmcache .venv-agents .venv-litellm var .pytest_cache
