# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := prometheus prometheus-alertmanager chromium

.PHONY: demo demo-stack test lint typecheck unit venv system-deps docs clean

venv: $(STAMP)

# torch is no dependency of the package (the training side uses the user's own), so the dev venv installs it
# explicitly, pinned to the CPU wheel that lies on disk here: a plain `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,report,huggingface,lightning]' torch==2.13.0
	touch $(STAMP)

# Prometheus, Alertmanager (with promtool/amtool) and Chromium from Debian, only when missing.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v prometheus-alertmanager >/dev/null || missing="$$missing prometheus-alertmanager"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

demo: $(STAMP)
	rm -rf demo-output
	$(PY) -m trainpatrol demo --steps 400 --inject nan@150 --agent-url http://127.0.0.1:9402

demo-stack: $(STAMP) system-deps
	rm -rf demo-output
	$(PY) -m trainpatrol demo --stack --steps 600 --inject grad_spike@200

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: $(STAMP) system-deps lint typecheck
	$(VENV)/bin/pytest -q

docs: $(STAMP)
	$(PY) -m trainpatrol.catalogue > docs/metrics.md

clean:
	rm -rf $(VENV) demo-output .pytest_cache .mypy_cache .ruff_cache
