# Two commands for a fresh clone: `make demo` and `make test`. Only Python is needed.
# Contributors also use `make lint`, `make test-fast` and `make docs`; CI runs them all (.ci/run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := examples,checkpoint,test,lint,docs,release

.PHONY: demo test test-fast lint format docs wheel-check venv bench notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxsane doctor; status=$$?; \
	  echo "(doctor exit code $$status: 1 is expected, the bundled planted-bug example has errors)"; \
	  test $$status -le 1

# everything, as CI runs it
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# the fast tier: no end-to-end doctor/fit runs, no subprocess or multi-process jobs, no network
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not subprocess and not multiprocess and not network" tests

lint: $(STAMP)
	$(BIN)/ruff check jaxsane tests/test_layout.py
	$(BIN)/ruff format --check jaxsane tests/test_layout.py
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format jaxsane tests/test_layout.py
	$(BIN)/ruff check --fix jaxsane tests/test_layout.py

# the manual: guides, the generated reference (API, finding codes, doctor options), notebooks as committed
docs: $(STAMP)
	rm -rf docs/_build
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

# build the sdist and wheel, check them, install the wheel in a fresh venv and run the doctor outside the checkout
wheel-check: $(STAMP)
	$(BIN)/python .ci/wheel_check.py

bench: $(STAMP)
	$(BIN)/python benchmarks/guard_overhead.py

# re-execute notebooks/*.ipynb (JAXSANE_NB_SMALL=1, as the tests run them) and save them with their outputs
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

clean:
	rm -rf $(VENV) build dist docs/_build *.egg-info
