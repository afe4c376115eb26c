# Two commands for a newcomer: `make demo` (a local swarm, no arguments) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# the testbed's NAT host needs nftables, the monitor's page test a headless chromium (their tests skip without them):
# installed when we are root on a system with apt-get
system-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v nft >/dev/null && command -v apt-get >/dev/null; then \
		apt-get install -y -q nftables || (apt-get update -q && apt-get install -y -q nftables) || \
		echo "nftables could not be installed: the testbed's NAT tests will skip (apt-get install nftables)"; fi
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then \
		apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium) || \
		echo "chromium could not be installed: the monitor's browser test will skip (apt-get install chromium)"; fi

install: $(STAMP) system-deps

demo: $(STAMP)
	$(BIN)/swarm demo

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
