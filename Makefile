# make demo: set up .venv and print the parity report. make test: set up and run all tests.
# make wheel: build dist/meshgrad-*.whl. The exact versions CI uses are in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
STAMP := $(VENV)/.meshgrad-installed
# megatron-core 0.19.2 sources for tests/test_megatron019_oracle.py (git-ignored cache)
MEGATRON019 := .cache/megatron-core-0.19.2/src/megatron/core/distributed/finalize_model_grads.py

.PHONY: demo test bench wheel setup clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[torch,jax,test,megatron]'
	touch $(STAMP)

# Downloaded once (pip download, unpacked; never installed); quiet when offline: the
# oracle tests then skip with the reason.
$(MEGATRON019): | $(STAMP)
	-$(PY) -m parity_tests.megatron019 fetch

setup: $(STAMP) $(MEGATRON019)

demo: $(STAMP)
	$(PY) -m parity_tests

test: $(STAMP) $(MEGATRON019)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench

# One wheel (pure Python) in dist/, built from this checkout without build isolation
# (setuptools from the venv); tests/test_packaging.py builds its own the same way.
wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build dist
