# Two commands: `make demo` (set up + main job) and `make test` (set up + whole suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint vermin bench setup clean device-check device-check-server fast \
	mutation cuda-check

$(VENV)/.installed: pyproject.toml
	@# Reuse a system torch (NVIDIA's wheel on Jetson) via system site-packages; never reinstall it.
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "torch found on the system: reusing it"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	$(PIP) install --quiet --upgrade pip
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "installing $(TORCH_PIN) (CPU)"; \
		$(PIP) install --quiet $(TORCH_PIN); \
	fi
	$(PIP) install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# The main job: a field trial on an embedded broker with 4 local agents emulating a Nano and
# an Orin NX each (SCALA, MNIST-5k with label skew); the report lands in runs/demo/report.md.
demo: setup
	$(VENV)/bin/jetsplit trial --out runs/demo

# The suite runs on TEST_WORKERS processes (pytest-xdist; 0: one process, in order): most of
# its tests keep one core busy, so two workers fill a 2-core machine.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The fast tier: the methods' numbers on tiny models, hand-computed (well under 90 s).
fast: setup
	$(PY) -m pytest -q -m fast

# Mutation testing, outside `make test`: cosmic-ray mutates the code in place, one mutant at
# a time, and runs the fast tests against each (configs in mutation/; MUTATION=aggregators
# runs one). Sessions and the survivors' report land in runs/mutation/.
MUTATION ?= aggregators algorithm_math completions tiers partition \
	methods_base methods_splitfed methods_scala methods_psl methods_ampere methods_sherl \
	wire_replay wire_chunking wire_envelope wire_codecs transport
mutation: setup
	$(PIP) install --quiet "cosmic-ray>=8.7,<9"
	@mkdir -p runs/mutation
	@for m in $(MUTATION); do \
		rm -f runs/mutation/$$m.sqlite; \
		$(VENV)/bin/cosmic-ray init mutation/$$m.toml runs/mutation/$$m.sqlite || exit 1; \
		if grep -q '^\[cosmic-ray.filters.operators-filter\]' mutation/$$m.toml; then \
			$(VENV)/bin/cr-filter-operators runs/mutation/$$m.sqlite mutation/$$m.toml \
				|| exit 1; \
		fi; \
		$(VENV)/bin/cosmic-ray exec mutation/$$m.toml runs/mutation/$$m.sqlite || exit 1; \
		$(VENV)/bin/cr-report runs/mutation/$$m.sqlite --show-pending \
			> runs/mutation/$$m.txt; tail -4 runs/mutation/$$m.txt; \
	done

bench: setup
	$(PY) benchmarks/bench_runtime.py

lint: setup
	$(VENV)/bin/ruff check .

# The device side (all `jetsplit agent run` imports) must run on JetPack 5's Python 3.8.
DEVICE_SIDE := jetsplit edge_agent
# `jetsplit profile` runs on the device too (tests/core/test_py38_compat.py PROFILE_PATH).
PROFILE_PATH := export/__init__.py export/profile_cli.py export/profiler.py \
	export/cost_model.py export/flop_count.py export/torch_compat.py export/onnx_export.py
vermin: setup
	$(VENV)/bin/vermin --target=3.8 --no-tips --violations $(DEVICE_SIDE) $(PROFILE_PATH)

# The device side on its floor: an arm64 Debian bullseye userland under QEMU (Python 3.9,
# torch 1.13.1): install, doctor, profile, 2 ARM agents training with a native coordinator,
# the device tests; a second copy stands in for a stock JetPack 4.6 Nano (the installer's CPU
# route, its doctor, the CPU-Nano agent). Needs root; the userland is cached outside the clone.
device-check: setup
	$(PY) scripts/device_check.py

# The testbed's coordinator on an arm64 Jetson (JetPack 6 runs Python 3.10 and torch 2.x): a
# Debian bookworm arm64 userland (Python 3.11, PyPI's CPU torch 2.5.1) runs `jetsplit server
# run` for two native agents, beside a native coordinator at the same seed. Needs root.
device-check-server: setup
	$(PY) scripts/device_check.py --coordinator-only

# CUDA against CPU, method by method, on a machine with a GPU (skipped where torch sees none),
# then the server step's CPU/CUDA ratio.
cuda-check: setup
	$(PY) -m pytest -q -o addopts= tests/server/training/test_cuda.py tests/server/training/test_forward_finite_fast.py -rs
	$(PY) benchmarks/bench_server.py

clean:
	rm -rf $(VENV) .venv38 .venv39 build *.egg-info
