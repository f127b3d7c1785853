# Two commands set everything up: `make demo` and `make test`. Both go through `make venv`,
# which creates or refreshes .venv only when pyproject.toml or constraints.txt changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test schema clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/precompile plan profiles/examples/text_classifier_planned.yaml
	$(VENV)/bin/precompile build profiles/examples/text_classifier_planned.yaml -o artifacts/text-classifier
	$(PY) profiles/examples/demo.py artifacts/text-classifier

test: venv
	$(PY) -m pytest -q tests

# Regenerate profiles/schema.json from the profile models (a test keeps the two equal).
schema: venv
	$(VENV)/bin/precompile schema > profiles/schema.json

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache
