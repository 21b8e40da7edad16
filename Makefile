# The README's two commands. Both do all set-up on a fresh machine (see .ci/bootstrap).
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint typecheck unit clean

$(STAMP): pyproject.toml .ci/bootstrap
	bash .ci/bootstrap
	touch $@

run: $(STAMP)
	$(BIN)/shoal train cartpole

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	bash .ci/typecheck

unit: $(STAMP)
	$(BIN)/pytest -n 2 --dist loadfile -q

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build *.egg-info
