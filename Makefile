# Set-up and entry points. `make demo` and `make test` each create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed

.PHONY: demo test lint format protos bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned so pip takes the CPU build that lies on disk instead of downloading one.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/plait demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
