# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0
PROTOS := $(wildcard protos/dpex/v1/*.proto)

.PHONY: setup proto demo test test-unit test-integration test-docker bench clean docs docs-serve

setup: $(VENV)/.installed proto

# torch first, pinned: a bare `torch` requirement would pull the CUDA build. The demo needs the
# package and the proto compiler only; the tests add the `test`, `ray` and `docs` extras (the suite
# builds the docs site).
$(VENV)/.torch: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIN)
	touch $@

$(VENV)/.base: $(VENV)/.torch
	$(PIP) install --quiet -e '.[proto]'
	touch $@

# The page test drives Debian's Chromium (Playwright, with no browser download of its
# own): installed here where it is missing and we may (root); without it that test skips.
# One install of the package with every extra (the demo's set is a part: marked done too).
$(VENV)/.installed: $(VENV)/.torch
	$(PIP) install --quiet -e '.[proto,test,ray,docs]'
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -q chromium >/dev/null 2>&1; } \
		|| echo "Chromium not installed: tests/integration/test_page.py will be skipped"
	touch $(VENV)/.base $@

# Generated code lands in dpex/proto/ and is never edited; the virtual include
# path makes the generated imports read `from dpex.proto import ...`.
proto: $(VENV)/.proto

$(VENV)/.proto: $(PROTOS) $(VENV)/.base
	$(PY) -m grpc_tools.protoc -Idpex/proto=protos/dpex/v1 \
		--python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

demo: $(VENV)/.base proto
	$(PY) -m dpex.demo

# The docs site (MkDocs; mkdocs.yml is strict: a broken link or a missing reference fails the build).
$(VENV)/.docs: pyproject.toml $(VENV)/.base
	$(PIP) install --quiet -e '.[proto,docs]'
	touch $@

docs: $(VENV)/.docs proto
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(VENV)/.docs proto
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

# Four test files at a time (pytest-xdist), each on one process, so that a
# module's shared cluster is started once: the suite waits on daemons and
# sockets much of its time (measured: 1.17 cores busy with -n 2). With the
# daemons warm-started four beat three (12 min 57 s against 13 min 29 s);
# six cost more CPU than they fill (14 min 19 s). benchmarks/RESULTS.md §35.
# The files' order is tests/conftest.py's (the long waits first), not xdist's.
PARALLEL := -n 4 --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m pytest $(PARALLEL) tests

test-unit: setup
	$(PY) -m pytest $(PARALLEL) tests/unit

test-integration: setup
	$(PY) -m pytest $(PARALLEL) tests/integration

# Root only: installs Debian's docker.io, starts dockerd, builds the images,
# runs docker/docker-compose.yml and kills a worker container mid-epoch.
test-docker: setup
	docker/test.sh

# The performance suite: each script prints its figures and ratios from one run.
bench: setup
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/scaleout.py
	$(PY) benchmarks/scaleout.py --within
	$(PY) benchmarks/worker_rate.py
	$(PY) benchmarks/dataplane.py
	$(PY) benchmarks/first_batch.py
	$(PY) benchmarks/compression.py
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/cluster_start.py
	$(PY) benchmarks/embedded.py
	$(PY) benchmarks/worker_kill.py
	$(PY) benchmarks/dataport_flood.py

clean:
	rm -rf $(VENV) dpex/proto/*_pb2*.py dpex/proto/*_pb2*.pyi .data
