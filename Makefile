# make demo: set up .venv and print the parity report. make test: set up and run all tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshgrad-installed

.PHONY: demo test bench setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[torch,jax,test,megatron]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m parity_tests

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
