# Set-up and entry points. `make demo` and `make test` each create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed

.PHONY: demo test test-gpu wheelhouse lint format protos bench docs clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned so pip takes the CPU build that lies on disk instead of downloading one.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The elastic-rendezvous test starts an etcd server; install it where apt and root allow.
	command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q etcd-server >/dev/null 2>&1; } || echo "etcd-server not installed: the etcd test will skip"
	# The recording rules' test runs Debian's Prometheus against two daemons.
	command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } || \
		echo "prometheus not installed: the recording rules' test will skip"
	# The web page's test drives Debian's headless Chromium through its chromedriver.
	command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "chromium not installed: the browser test will skip"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/plait demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The GPU tier on a CUDA machine: Triton compiles its kernels (the interpreter stays off).
test-gpu: $(STAMP)
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -q -rs tests/gpu

# Wheels for an offline GPU node (its torch, triton and CUDA packages stay): plait's own and its
# dependencies', for WHEELHOUSE_PYTHON and WHEELHOUSE_PLATFORM.
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_PYTHON ?= 3.12
WHEELHOUSE_PLATFORM ?= manylinux_2_28_x86_64
# torchao: the fp8 peer that tools/gpu_check.py's fp8 stage measures plait against.
WHEELHOUSE_ARGS ?= --extra fp8
wheelhouse: $(STAMP)
	$(BIN)/python tools/wheelhouse.py --out $(WHEELHOUSE) --python $(WHEELHOUSE_PYTHON) \
		--platform $(WHEELHOUSE_PLATFORM) $(WHEELHOUSE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

# The documentation site from docs/ (mkdocs-material, offline), into site/; a broken link fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info site
