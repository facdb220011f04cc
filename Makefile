# The two commands a newcomer needs: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench stack-up stack-down
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $@

demo: install
	$(BIN)/streamtune demo

# The full suite; PYTEST_ARGS narrows it (CI: -m "not slow").
test: install
	$(BIN)/streamtune stack up
	$(BIN)/pytest $(PYTEST_ARGS)

# The benchmarks of bench/, one after another, then one table (README "Benchmarks").
bench: install
	$(BIN)/streamtune stack up
	$(BIN)/python bench/freshness.py
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/cdc_latency.py --modes process
	$(BIN)/python bench/submit.py
	$(BIN)/python bench/serving.py
	$(BIN)/python bench/many_models.py
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/report.py

stack-up: install
	$(BIN)/streamtune stack up

stack-down:
	$(BIN)/streamtune stack down
