# The two commands a newcomer needs: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench stack-up stack-down docs-screenshots
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

# The benchmarks of bench/, one after another, each on a freshly restarted local stack (Tansu
# slows down as topics pile up, and one TaskManager running job after job has crashed:
# docs/benchmarks.md), then one table.
BENCHES := freshness.py "freshness.py --periodic-only" registration.py trainer_overhead.py "cdc_latency.py --modes process" "submit.py --compare-cold" "submit.py --busy 2 --out bench/results/submit-busy.json" "submit.py --busy 2 --idle-timeout-ms 2000 --out bench/results/submit-busy-idle-2s.json" serving.py serving_batching.py serving_load.py many_models.py ingest.py "ingest.py --minutes 5 --out bench/results/ingest-dense.json" "ingest.py --models 1000 --out bench/results/ingest-1000-models.json" "ingest.py --ceiling --out bench/results/ingest-floor.json" "ingest.py --ceiling --models 1000 --out bench/results/ingest-floor-1000-models.json"
bench: install
	for b in $(BENCHES); do \
	  $(BIN)/streamtune stack down && $(BIN)/streamtune stack up && $(BIN)/python bench/$$b || exit 1; \
	done
	$(BIN)/python bench/report.py

# The console screenshots of the manual, taken by the browser tests on the local stack.
docs-screenshots: install
	$(BIN)/streamtune stack up
	STREAMTUNE_SCREENSHOT_DIR=docs/images $(BIN)/pytest tests/test_console.py tests/test_console_editor.py \
	  -k "console_shows or models_page or postgres_pipeline_from_a_previewed_table"

stack-up: install
	$(BIN)/streamtune stack up

stack-down:
	$(BIN)/streamtune stack down
