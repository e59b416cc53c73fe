# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := prometheus prometheus-alertmanager chromium

.PHONY: demo demo-stack test lint typecheck unit venv system-deps image-deps image image-lock docs clean

venv: $(STAMP)

# torch is no dependency of the package (the training side uses the user's own), so the dev venv installs it
# explicitly, pinned to the CPU wheel that lies on disk here: a plain `torch` would pull a multi-GB CUDA build.
# One pip call: the pin holds torch there while the extras resolve (transformers, lightning), so no second
# install of it. (Byte-compiled up front, as pip does: left to the first import, the compiling lands in the
# parallel tests' time bounds instead.)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
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

# The agent image's build and run tools from Debian, only when missing (root only: the build needs
# mmdebstrap --mode=root). docker-registry, a local registry for the push test, is unpacked from its
# .deb rather than installed, so no registry service starts on the machine.
IMAGE_TOOLS := mmdebstrap buildah podman runc skopeo
REGISTRY_DIR := build/image/tools
image-deps:
	@if [ "$$(id -u)" != 0 ]; then echo "image-deps: not root, skipping (the image tests skip too)"; exit 0; fi; \
	missing=""; \
	for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi; \
	if [ ! -x $(REGISTRY_DIR)/usr/bin/docker-registry ]; then \
	  mkdir -p $(REGISTRY_DIR) && cd $(REGISTRY_DIR) && \
	  { apt-get download -qq docker-registry 2>/dev/null || { apt-get update -qq && apt-get download -qq docker-registry; }; } && \
	  dpkg-deb -x docker-registry_*.deb . && rm docker-registry_*.deb; \
	fi

# build/image/trainpatrol-agent.oci.tar; skipped when its inputs are unchanged (helm/image/build.py).
image: $(STAMP) image-deps
	$(PY) helm/image/build.py

# Re-resolve helm/image/requirements.lock from requirements.in, in a throwaway venv with pip-tools.
image-lock:
	$(PYTHON) -m venv build/image/lock-venv
	build/image/lock-venv/bin/pip install --quiet pip-tools==7.6.2
	cd helm/image && env -i PATH=/usr/bin:/bin HOME=/tmp PIP_CONFIG_FILE=/dev/null \
	  $$([ -f /etc/ssl/certs/ca-certificates.crt ] && echo PIP_CERT=/etc/ssl/certs/ca-certificates.crt) \
	  ../../build/image/lock-venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	  --no-emit-index-url --output-file=requirements.lock requirements.in

# On a machine without an NVIDIA driver the demos' agent serves GPU metrics from readings recorded on an
# H200 (the test double in tests/nvml_fake/, which the package does not ship); where nvidia-smi answers it
# reads the real GPUs. NVML_FAKE=PATH or NVML_FAKE= chooses explicitly.
NVML_FAKE ?= $(if $(shell nvidia-smi -L 2>/dev/null),,$(CURDIR)/tests/nvml_fake/nvml_h200.json)

demo: $(STAMP)
	rm -rf demo-output
	TRAINPATROL_NVML_FAKE=$(NVML_FAKE) $(PY) -m trainpatrol demo --steps 400 --inject nan@150 --agent-url http://127.0.0.1:9402

demo-stack: $(STAMP) system-deps
	rm -rf demo-output
	TRAINPATROL_NVML_FAKE=$(NVML_FAKE) $(PY) -m trainpatrol demo --stack --steps 600 --inject grad_spike@200

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Parallel workers (pytest-xdist): most tests wait on processes and sockets, so four workers on two cores pay;
# tests/conftest.py makes each test file one unit of work (report/ one for its session fixture) and
# starts the longest first. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 4
test: $(STAMP) system-deps image-deps lint typecheck
	$(VENV)/bin/pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

docs: $(STAMP)
	$(PY) -m trainpatrol.catalogue > docs/metrics.md

clean:
	rm -rf $(VENV) demo-output .pytest_cache .mypy_cache .ruff_cache build/image
