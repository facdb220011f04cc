# The two commands a newcomer needs: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test stack-up stack-down
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

stack-up: install
	$(BIN)/streamtune stack up

stack-down:
	$(BIN)/streamtune stack down
