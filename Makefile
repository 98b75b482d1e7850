# make install - create .venv if missing and install requirements/lock.txt into it (again only when the lock
#                or pyproject.toml changed), then this project, editable
# make demo    - same set-up, then the demo
# make test    - same set-up, then the test suite
# make bench   - same set-up, then what every attention variant costs here (tables and plots into benchmarks/);
#                more overrides with ARGS, e.g. make bench ARGS='bench.dtypes=[float32,bfloat16]'
# make results - same set-up, then the comparison in docs/recipes.md#results: every variant x seeds 0, 1, 2 on
#                generated shapes (experiment=compare, one thread a run) in a new multirun/compare/<time>, then
#                mode=report of it into docs/results/compare; make results RESULTS=multirun/compare/<time> finishes
#                that sweep instead (resume=true: its finished runs kept, the others continued) and reports it
# make test-gpu - on a machine with a CUDA GPU, in GPU_PYTHON (default python3: the GPU image's own torch, not the
#                lock's; needs no .venv): every `cuda` test (tests/gpu/, the kernels' in tests/attention/), then the
#                rest of the suite, each with GPU_WORKERS workers (docs/scale.md#testing-on-a-gpu)
# make bench-gpu - on a machine with a CUDA GPU, in GPU_PYTHON: PCT, FPS and kNN against PCT_Pytorch with its
#                pointnet2_ops (benchmarks/pct-cuda.*; PCT_PYTORCH=<its checkout, pointnet2_ops_lib built in place>),
#                what every attention variant costs there in float32 and bf16 (benchmarks/cost-cuda.*), and what
#                trainer.deterministic=true costs each task (benchmarks/deterministic-cuda.*), DeiT-S against
#                timm's (benchmarks/backbones-cuda.md), every variant at small N eager, compiled and as a CUDA
#                graph (benchmarks/small-n-cuda.md), the GAN validation's FID and KID on the host and on the
#                device (benchmarks/fidelity-cuda.md); docs/cost.md
# make lock    - resolve pyproject.toml (+ requirements/tools.in, under requirements/pins.txt) into
#                requirements/lock.txt again, keeping every pin that still fits; make lock UPGRADE=1 moves every
#                package to the newest release the constraints admit
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements/lock.txt

# One folder per `make results` (a second one into a single folder had every job refuse the finished run it found
# there, and make stop); := dates it once, for both of its commands.
RESULTS     ?=
RESULTS_DIR := $(or $(RESULTS),multirun/compare/$(shell date +%Y-%m-%d_%H-%M-%S))

GPU_PYTHON  ?= python3
GPU_WORKERS ?= 8
PCT_PYTORCH ?=
GPU_ENV     := ATTENTION_UNLOCKED=1 PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"
HAS_CUDA     = @$(GPU_PYTHON) -c 'import importlib.util, sys; importlib.util.find_spec("torch") or sys.exit("make $@: $(GPU_PYTHON) has no torch; set GPU_PYTHON to the Python of the GPU machine'"'"'s environment"); \
	import torch; torch.cuda.is_available() or sys.exit("make $@ needs a CUDA GPU, and torch.cuda.is_available() is False in $(GPU_PYTHON)")'

.PHONY: install demo test test-gpu bench bench-gpu results lock clean

# The lock is made for CPython 3.11 on x86_64 Linux; another Python may need other wheels than it names.
$(STAMP): $(LOCK) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import platform, sys; ok = sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"; \
		ok or print("warning: $(LOCK) is locked for CPython 3.11 on x86_64 Linux; this is Python %s on %s" % (platform.python_version(), platform.machine()))'
	$(PY) -m pip install --quiet "$$(grep '^pip==' $(LOCK))"
	$(PY) -m pip install --quiet -r $(LOCK)   # the first install fetches torch (several GB with CUDA)
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip check
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) run.py experiment=demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=30   # two workers: CI has 2 cores (see tests/conftest.py)

# The GPU image's torch differs from the lock's: ATTENTION_UNLOCKED=1 says so to tests/test_environment.py. PYTHONPATH
# carries the checkout (and whatever the caller put there) into the tests' run.py subprocesses.
test-gpu:
	$(HAS_CUDA)
	$(GPU_ENV) $(GPU_PYTHON) -m pytest -m cuda -n $(GPU_WORKERS) --dist loadgroup -p no:cacheprovider
	$(GPU_ENV) $(GPU_PYTHON) -m pytest -m "not cuda" -n $(GPU_WORKERS) --dist loadgroup -p no:cacheprovider

bench: $(STAMP)
	$(PY) run.py mode=bench bench.tasks=true bench.table_dir=benchmarks 'hydra.run.dir=outputs/bench/$${run_stamp:}' $(ARGS)

bench-gpu:
	$(HAS_CUDA)
	$(GPU_ENV) $(GPU_PYTHON) -m benchmarks.pct_cuda $(if $(PCT_PYTORCH),--reference $(PCT_PYTORCH))
	$(GPU_ENV) $(GPU_PYTHON) -m benchmarks.backbones
	$(GPU_ENV) $(GPU_PYTHON) -m benchmarks.small_n
	$(GPU_ENV) $(GPU_PYTHON) -m benchmarks.fidelity
	$(GPU_ENV) $(GPU_PYTHON) run.py mode=bench bench.device=cuda 'bench.dtypes=[float32,bfloat16]' bench.tasks=true bench.table_dir=benchmarks logger=none 'hydra.run.dir=outputs/bench/$${run_stamp:}' $(ARGS)
	CUBLAS_WORKSPACE_CONFIG=:4096:8 $(GPU_ENV) $(GPU_PYTHON) run.py mode=bench bench.device=cuda 'bench.variants=[]' 'bench.baselines=[]' bench.tasks=true bench.task_deterministic=true bench.task_pct=false bench.name=deterministic bench.table_dir=benchmarks logger=none 'hydra.run.dir=outputs/bench/$${run_stamp:}-deterministic'

results: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) run.py -m experiment=compare 'attn=glob(*)' seed=0,1,2 hydra.sweep.dir=$(RESULTS_DIR) \
		$(if $(RESULTS),resume=true)
	$(PY) run.py mode=report report.runs=$(RESULTS_DIR) report.out=docs/results/compare

lock: $(STAMP)
	$(PY) -m piptools compile --quiet $(if $(UPGRADE),--upgrade) --extra dev --allow-unsafe --strip-extras \
		--no-emit-index-url --no-emit-find-links --constraint requirements/pins.txt \
		--output-file $(LOCK) pyproject.toml requirements/tools.in

clean:
	rm -rf outputs multirun wandb .pytest_cache
