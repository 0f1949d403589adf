# ipyfence — everyday commands. Works on a fresh Debian/Ubuntu machine (as root, or with sudo).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
NPM_GLOBAL := @anthropic-ai/sandbox-runtime@0.0.78 @modelcontextprotocol/server-everything@2026.8.31 @modelcontextprotocol/inspector@0.15.0

.PHONY: run demo test lint bench soak install install-test system-deps test-deps doctor clean

# --- set-up -------------------------------------------------------------------------------
UNAME := $(shell uname -s)

$(VENV)/.installed: pyproject.toml
ifeq ($(UNAME),Darwin)
	@command -v srt >/dev/null || { echo "macOS needs sandbox-runtime: npm install -g @anthropic-ai/sandbox-runtime (Node.js: brew install node)" >&2; \
		command -v npm >/dev/null && npm install -g --silent @anthropic-ai/sandbox-runtime >&2 || exit 1; }
else
	@command -v bwrap >/dev/null || { echo "installing bubblewrap" >&2; $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap util-linux >&2; }
endif
	@python3 -m venv $(VENV) >&2
	@$(PIP) install -q --upgrade pip >&2
	@$(PIP) install -q -e . >&2
	@touch $@

install: $(VENV)/.installed

# Debian packages the tests need, installed only when their command is missing.
APT_FOR := bwrap:bubblewrap prlimit:util-linux setpriv:util-linux socat:socat rg:ripgrep git:git node:nodejs npm:npm
system-deps:
	@missing=""; for pair in $(APT_FOR); do command -v "$${pair%%:*}" >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then echo "apt-get install$$missing" >&2; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) install -q -e ".[test]" >&2
	touch $@

test-deps: system-deps $(VENV)/.test-installed
	@command -v srt >/dev/null && command -v mcp-server-everything >/dev/null && command -v mcp-inspector >/dev/null \
		|| npm install -g --silent $(NPM_GLOBAL) >/dev/null

# --- everyday -----------------------------------------------------------------------------
run: install  ## install and serve MCP on stdio for --workspace .
	@exec $(VENV)/bin/ipyfence --workspace .

demo: install  ## a real MCP client drives the server: cells, a blocked .env read, blocked internet
	$(PY) scripts/demo.py

doctor: install
	$(VENV)/bin/ipyfence doctor

test: test-deps  ## install what the tests need and run them
	$(PY) -m pytest -q -ra

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check src tests scripts bench
	$(VENV)/bin/ruff format --check src tests scripts bench
	$(VENV)/bin/mypy

bench: install  ## side-by-side figures: ipyfence, --no-sandbox, ipybox 0.9.2, raw jupyter_client
	$(PY) bench/run.py

soak: $(VENV)/.test-installed
	IPYFENCE_SOAK=1 $(PY) -m pytest -q tests/integration/test_soak.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
