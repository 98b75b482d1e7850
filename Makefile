# make demo  - create .venv if missing, install (again only when pyproject.toml changed), run the demo
# make test  - same set-up, then the test suite
# make bench - same set-up, then what every attention variant costs here (tables and plots into benchmarks/);
#              more overrides with ARGS, e.g. make bench ARGS='bench.dtypes=[float32,bfloat16]'
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[dev]'   # the first install fetches torch (several GB with CUDA)
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) run.py experiment=demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=30   # two workers: CI has 2 cores (see tests/conftest.py)

bench: $(STAMP)
	$(PY) run.py mode=bench bench.tasks=true bench.table_dir=benchmarks 'hydra.run.dir=outputs/bench/$${run_stamp:}' $(ARGS)

clean:
	rm -rf outputs multirun wandb .pytest_cache
