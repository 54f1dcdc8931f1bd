# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Python caches what it compiles in __pycache__ (pytest too, its assertion-rewritten test
# modules). A machine that sets PYTHONDONTWRITEBYTECODE=1 (this sandbox's kind does) had
# every process the suite starts compile errands again (a worker, a CLI call: +0.15 s of
# CPU each, over a thousand of them) and each test process rewrite ~340 test modules
# (10 s of CPU each).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-peers test-integrations lint format bench bench-storage bench-finished bench-scenarios bench-fairness soak clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@bash scripts/venv_install.sh $(VENV) -e '.[dev,postgres]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/errands demo

# errands is compiled and the suite collected once first, on one process: the xdist
# processes and the workers the tests start then read them compiled (the six processes
# compiled the same ~340 test modules at once, on two cores).
# The main suite and, beside it, the framework integrations on both Django stacks (own
# venvs, installed first) and the FastAPI/Flask examples: both always run, either failing
# fails the target, and the integrations' output is printed after the main suite's. (Run
# after it, they added a minute to a suite near its 10-minute budget in CI; the machine
# is about half idle while the suite runs.)
# The suite runs on PYTEST_WORKERS processes (pytest-xdist; 0: in this one); the tests
# that restart PostgreSQL share one process and the tests' own cluster (tests/pg.py).
# Six: most tests wait more than they compute. On five (a clean-clone CI run, 3,072
# tests, 11 min 10 s) both cores were busy while the integrations ran beside the suite,
# then 35-85 % idle for its last three minutes (tests waiting on leases, timeouts and
# processes). The integrations run at a lower priority (nice): they take the cores the
# suite leaves, and end well before it. Their venvs are made while .venv is (each build
# uses one core of two); they run once both are there (the FastAPI and Flask examples
# run in .venv).
PYTEST_WORKERS ?= 6
test:
	@mkdir -p $(VENV); \
	nice -n 10 bash scripts/test_integrations.sh --prepare > $(VENV)/integrations-prepare.log 2>&1 & \
	prepare=$$!; \
	$(MAKE) --no-print-directory $(STAMP) || { wait $$prepare; exit 1; }; \
	( while kill -0 $$prepare 2>/dev/null; do sleep 0.5; done; \
	  nice -n 10 bash scripts/test_integrations.sh > $(VENV)/integrations.log 2>&1; \
	  echo $$? > $(VENV)/integrations.rc ) & \
	integrations=$$!; status=0; \
	$(BIN)/python -m compileall -q src > /dev/null; \
	$(BIN)/python -m pytest -q --collect-only -p no:cacheprovider $(PYTEST_ARGS) > /dev/null 2>&1; \
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) \
	  || status=$$?; \
	wait $$prepare; wait $$integrations; cat $(VENV)/integrations.log; \
	[ "$$(cat $(VENV)/integrations.rc)" = 0 ] || status=$$((status ? status : 1)); \
	exit $$status

# The benchmarks' peer adapters at tiny sizes, each in its own venv (made on first use).
test-peers: $(STAMP)
	$(BIN)/python -m pytest -q -m peers $(PYTEST_ARGS)

test-integrations: $(STAMP)
	bash scripts/test_integrations.sh $(INTEGRATIONS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

# The side-by-side figures (docs/benchmarks.md): about 2 1/2 hours on a quiet 2-core machine
# (5 interleaved runs of every peer at two configurations), fair queues included.
bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# Issue 17's separate steps, each on a throw-away PostgreSQL cluster the harness makes and
# deletes (--scratch-pg), merged into bench/results/latest.json and docs/benchmarks.md.
bench-storage: $(STAMP)  # WAL, bytes and dead tuples per job: ~10 min
	$(BIN)/python -m bench.run --no-systems --storage --scratch-pg --update $(BENCH_ARGS)

bench-finished: $(STAMP)  # claims with 10M finished rows against an empty table: ~15 min
	$(BIN)/python -m bench.run --no-systems --finished-rows 10000000 --scratch-pg --update $(BENCH_ARGS)

bench-scenarios: $(STAMP)  # the third-party chaos and pressure cells: ~2 1/2 hours
	$(BIN)/python -m bench.run --no-systems --scenarios --scratch-pg --update $(BENCH_ARGS)

# The noisy-neighbour benchmark (issue 19) alone: fair claiming against FIFO, on SQLite and
# on a scratch database of BENCH_PG_URL's server, ~10 min each with the defaults; into
# bench/results/partial.json (FAIRNESS_ARGS for bench/fairness.py, e.g. '--backlog 20000').
bench-fairness: $(STAMP)
	$(BIN)/python -m bench.run --no-systems --fairness --fairness-args "$(FAIRNESS_ARGS)" $(BENCH_ARGS)

soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak tests/soak $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
