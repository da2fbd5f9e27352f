# Every target creates .venv on a fresh clone. torch==2.13.0 is installed first and explicitly:
# any other torch spec can pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SYSTEM_STAMP := $(VENV)/.system-deps

.PHONY: demo test test-fast bench lint clean system-deps update-plotly

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[server,dev]'
	touch $(STAMP)

# Test-only system packages (Prometheus, Chromium); PostgreSQL 15 binaries are already on the machine.
$(SYSTEM_STAMP):
	bash .ci/system-deps
	touch $(SYSTEM_STAMP)

system-deps: $(SYSTEM_STAMP)

demo: $(STAMP)
	$(BIN)/ddpscope demo --scenario all --exit

# Two streams at once, then one alone (tests/streams.py); `$(BIN)/python -m pytest tests` runs it in one.
test: $(STAMP) $(SYSTEM_STAMP)
	DDPSCOPE_TEST_STRICT=1 $(BIN)/python -m tests.run_suite

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not slow and not browser and not postgres and not prometheus"

bench: $(STAMP) $(SYSTEM_STAMP)
	$(BIN)/python -m bench.run_all

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash .ci/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache

# Replace the vendored plotly.js cartesian bundle with another npm release, checked against npm's
# integrity hash; then put the printed SHA-256 into dashboard/plotly_js.py (VENDORED_SHA256).
PLOTLY_VERSION ?= 4.1.1
update-plotly:
	$(PY) tools/update_plotly.py $(PLOTLY_VERSION)
