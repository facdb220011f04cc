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

test: install
	$(BIN)/streamtune stack up
	$(BIN)/pytest

stack-up: install
	$(BIN)/streamtune stack up

stack-down:
	$(BIN)/streamtune stack down
