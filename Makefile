# Two commands for a fresh clone: `make demo` and `make test`. Only Python is needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[examples,checkpoint,test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxsane doctor; status=$$?; \
	  echo "(doctor exit code $$status: 1 is expected, the bundled planted-bug example has errors)"; \
	  test $$status -le 1

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/guard_overhead.py

# re-execute notebooks/*.ipynb (JAXSANE_NB_SMALL=1, as the tests run them) and save them with their outputs
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

clean:
	rm -rf $(VENV) build *.egg-info
