# The two commands: `make demo` runs a whole GPUFlex network on this machine; `make test` runs every check.
# Both set up .venv first (torch==2.13.0 before the rest, so pip takes the CPU build this machine has);
# `make install` only sets it up.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "GPUFlex needs Python >= 3.11 (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	# torch==2.13.0 again: without it pip's resolver may trade the CPU build for a newer (CUDA) one
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' torch==2.13.0
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuflex demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/lint-imports

test: lint
	scripts/ensure-chromium
	$(BIN)/python -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) gpuflex-demo .pytest_cache .ruff_cache .hypothesis
