# Multi-Head Attention, from Intuition to GPU.
#
#   make book     set up .venv and build the book   -> _build/html/index.html
#   make test     set up everything and run every test (lint, unit, notebooks, Colab path, book, browser)
#   make lint     ruff format --check, ruff check and mypy over the package, tests and tools
#   make test-colab   run every chapter the way Colab's "Run all" does (part of make test)
#   make test-newest  the Colab-path test on the newest Python, torch, numpy, matplotlib (downloads)
#   make serve    serve the built book on http://localhost:8000
#   make execute  re-execute every chapter in place (after editing a chapter or mha) and
#                 refresh their text twins in chapters/text/ (make text does only that)
#   make bench    measure the performance targets (tools/bench_report.py), each a ratio to PyTorch
#   make gpu-check  run every chapter and the report on this machine -> results/<device>.json
#   make clean    remove build outputs (keeps .venv and node_modules)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

CHAPTERS := $(sort $(wildcard chapters/[0-9]*.ipynb))
JB_BUILD := $(BIN)/jupyter-book build . -W -n --keep-going --all
COLAB_TEST := tests/test_colab_run.py
NEWEST   := .venv-newest
# What the Colab-path test needs besides mha's own dependencies (torch, numpy, matplotlib).
NEWEST_PACKAGES := torch numpy matplotlib triton setuptools ipykernel nbclient nbformat pytest pyyaml
NBVAL    := $(BIN)/pytest -p no:cacheprovider --nbval --nbval-current-env \
            --nbval-sanitize-with tests/sanitize.cfg

.PHONY: help venv book lint test test-unit test-notebooks test-colab test-newest test-browser mathjax \
        serve execute text bench gpu-check clean

help:
	@sed -n '3,14p' Makefile

# The virtual environment is (re)installed whenever requirements.txt or pyproject.toml changes.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(STAMP)

# A local MathJax 3 for the browser test (the book itself loads MathJax from its CDN).
node_modules/mathjax/package.json: package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

mathjax:
	@if command -v npm >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory node_modules/mathjax/package.json; \
	else \
		echo "npm not found: the browser test needs a local MathJax (npm ci) and will be skipped"; \
	fi

# --all rebuilds every page, so that -W sees the warnings of unchanged pages too.
book: $(STAMP)
	$(JB_BUILD)
	@echo "The book is in _build/html/index.html"

test: $(STAMP) mathjax
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory test-notebooks
	$(MAKE) --no-print-directory test-colab
	$(MAKE) --no-print-directory book
	$(MAKE) --no-print-directory test-browser

lint: $(STAMP)
	$(BIN)/ruff format --check mha tests tools
	$(BIN)/ruff check mha tests tools
	$(BIN)/mypy

test-unit: $(STAMP)
	$(BIN)/pytest -m "not browser" --ignore=$(COLAB_TEST) tests

test-notebooks: $(STAMP)
	$(NBVAL) chapters

# Colab's "Run all": a fresh kernel per chapter that imports a fake google.colab, so the setup
# cell %pip-installs mha from a git repository (a commit of this working tree), no cell tags
# honoured, stopping at the first error. Offline; never touches .venv.
test-colab: $(STAMP)
	$(BIN)/pytest -v -p no:cacheprovider --durations=0 $(COLAB_TEST)

# The same test on the newest releases pip resolves today (and the newest Python here): builds
# $(NEWEST) (downloads torch, several GB) and upgrades it on every run; delete it to move to a
# newer Python. Not part of make test or CI.
test-newest:
	test -x $(NEWEST)/bin/python || "$$(tools/newest_python.sh)" -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --disable-pip-version-check --upgrade pip
	$(NEWEST)/bin/python -m pip install --disable-pip-version-check --upgrade \
		--upgrade-strategy eager $(NEWEST_PACKAGES)
	$(NEWEST)/bin/python tools/versions.py
	$(NEWEST)/bin/pytest -v -p no:cacheprovider --durations=0 $(COLAB_TEST)

test-browser: $(STAMP)
	$(BIN)/pytest -m browser tests/test_browser.py

serve:
	@test -f _build/html/index.html || { echo "No book yet: run make book first"; exit 1; }
	$(BIN)/python -m http.server $(PORT) --bind 127.0.0.1 --directory _build/html

execute: $(STAMP)
	$(BIN)/python tools/execute_notebook.py $(CHAPTERS)
	$(BIN)/python tools/chapter_text.py write

# The text twins of the chapters (chapters/text/*.md) from the notebooks.
text: $(STAMP)
	$(BIN)/python tools/chapter_text.py write

bench: $(STAMP)
	$(BIN)/python tools/bench_report.py

# Every chapter strictly, the performance report and (on a GPU) the Triton kernel's throughput,
# recorded in results/<device>.json. On a machine without CUDA it writes results/cpu.json.
gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py

clean:
	rm -rf _build .pytest_cache .hypothesis
	find . -path ./.venv -prune -o -path ./node_modules -prune -o \
		-name __pycache__ -type d -prune -exec rm -rf {} +
