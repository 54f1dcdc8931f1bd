# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-integrations lint format bench soak clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -e '.[dev,postgres]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/errands demo

# The main suite, then the framework integrations on both Django stacks (own venvs) and
# the FastAPI/Flask examples; both always run, and either failing fails the target.
test: $(STAMP)
	@status=0; $(BIN)/python -m pytest -q $(PYTEST_ARGS) || status=$$?; \
	bash scripts/test_integrations.sh || status=$$((status ? status : 1)); \
	exit $$status

test-integrations: $(STAMP)
	bash scripts/test_integrations.sh $(INTEGRATIONS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak tests/soak $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
