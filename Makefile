# The two commands that set up a fresh machine: `make demo` and `make test`.
# Both create the environment in .venv when it is missing (or pyproject.toml changed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-hsdp test unit lint typecheck soak bench clean env harness

env: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,lightning,torchdata,hf,megatron]' torch==2.13.0
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# the same through faults with the model sharded by FSDP2 over a 2x2 (replicate, shard) mesh:
# every rank's final shards compared with the fault-free run's
demo-hsdp: $(STAMP)
	$(BIN)/python examples/demo.py --fsdp 2,2 --out runs/demo-hsdp

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy --strict tests/helpers

# Two workers (pytest-xdist), each taking whole test files (--dist loadfile: a file's merged job,
# module fixtures and reference runs stay in one process); the reference runs and the corpus are
# made once for both (tests/helpers/shared.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: lint typecheck
	$(BIN)/python -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadfile

# the unit tests alone (tests/unit/, marked `unit` by tests/conftest.py): the quick loop while editing
unit: $(STAMP)
	$(BIN)/python -m pytest -q -x -m unit

# only the multi-host harness tests (network namespaces, real Slurm); they need root, and skip
# without it unless CHECKPOINTLESS_REQUIRE_HARNESS=1 (set by .ci/run) makes that a failure
harness: $(STAMP)
	$(BIN)/python -m pytest -q -m 'netns or slurm' --durations=10

# the long chaos and soak runs, in the same two workers as `make test`
soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak --durations=15 -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/recovery.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
