"""Every task on a CUDA GPU, as a researcher runs it on a cluster (issue 27): `make test-gpu` on a GPU machine.

Without a GPU these tests are reported as skipped (tests/conftest.py, the ``cuda`` marker): CI is CPU-only. On one:

- every task (modelnet, shapenet, gan, segmentation, classification) trains, validates and tests on CUDA in float32
  and ``bf16-mixed`` (one Hydra multirun each), ``mode=test`` of its best checkpoint gives the run's test metrics,
  ``mode=summary`` counts it, and it trains with ``trainer.compile=true`` (inductor, the GPU's Triton kernels);
- the GAN's evaluation scores FID, IS, KID and precision/recall there (its features and indices used to meet on
  different devices: issue 27 §1);
- with ``trainer.deterministic=true`` two runs of one seed give identical metrics, and a run killed with SIGKILL
  and resumed gives the uninterrupted run's metrics (PCT between epochs, the GAN mid-epoch);
- no training step synchronises the host with the GPU (CUDA's own sync debug mode, around each step and backward);
- SDPA's flash and memory-efficient kernels, forward and backward, are counted by the FLOP counter.

Runs are the CPU tests' tiny ones (tests/test_run.py, tests/test_resume.py) with ``trainer.accelerator=gpu``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from suite.run_record import quality_metrics
from task_steps import TASKS, CudaSyncErrors, train_watched
from test_resume import ARGS as RESUME_ARGS
from test_resume import kill_after_a_checkpoint
from test_run import GAN_TINY, SEG_TINY, TINY, env, run  # noqa: F401 - env is a fixture

pytestmark = pytest.mark.cuda
GPU = ["trainer.accelerator=gpu", "trainer.devices=1"]

# Each task's smallest whole run: training with at least one validation, then the test of the best checkpoint.
RUNS = {
    "modelnet": [*TINY, "attn=offset"],
    "shapenet": [*TASKS["shapenet"], "attn=linear_elu", "trainer.max_epochs=1"],
    "gan": [*GAN_TINY, "attn=self", "trainer.max_steps=4", "metrics.every_n_steps=2", "metrics.num_samples=8",
            "eval.num_samples=8", "metrics.kid=true", "metrics.kid_subset_size=4", "metrics.prc=true",
            "metrics.vgg16_weights=random", "metrics.prc_neighborhood=3"],
    "segmentation": [*SEG_TINY, "attn=external", "trainer.max_steps=4", "eval.every_n_steps=2"],
    "classification": [*TASKS["classification"], "trainer.max_epochs=1", "+trainer.limit_train_batches=4",
                       "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1"],
}
TEST_METRIC = {"modelnet": "test/oa", "shapenet": "test/imiou", "gan": "test/fid", "segmentation": "test/miou",
               "classification": "test/top1"}


def without_accelerator(args: list[str]) -> list[str]:
    """A CPU test's arguments less its CPU pin."""
    return [a for a in args if not a.startswith("trainer.accelerator=")]


def gpu_run(args: list[str], env, out):  # noqa: F811 - env is a fixture
    """``run.py args`` on the GPU, into ``out``, without a logger."""
    return run([*without_accelerator(args), *GPU, "logger=none", f"hydra.run.dir={out}"], env)


def metrics_of(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def assert_finite_on_cuda(metrics: dict, task: str) -> None:
    quality = quality_metrics(metrics)
    assert TEST_METRIC[task] in quality, sorted(quality)
    bad = {k: v for k, v in quality.items() if not math.isfinite(v)}
    assert not bad, bad
    assert metrics["peak_memory_source"] == "cuda_max_memory_allocated"  # the run's device was the GPU
    assert metrics["peak_memory_bytes"] > 0


@pytest.fixture(scope="module", params=list(RUNS))
def precision_runs(request, env, tmp_path_factory):  # noqa: F811 - env is a fixture
    """One multirun per task: float32 (job 0) and bf16-mixed (job 1)."""
    task, out = request.param, tmp_path_factory.mktemp(f"cuda-{request.param}")
    extra = [f"metrics.cache_dir={out / 'fid'}"] if task == "gan" else []
    run(["-m", *without_accelerator(RUNS[task]), *GPU, *extra, "logger=none", "trainer.precision=32-true,bf16-mixed",
         f"hydra.sweep.dir={out}"], env)
    jobs = sorted(p for p in out.iterdir() if p.is_dir() and (p / "metrics.json").is_file())
    assert len(jobs) == 2, list(out.iterdir())
    return task, jobs, extra


def test_every_task_trains_validates_and_tests_on_cuda_in_float32_and_bf16(precision_runs):
    task, jobs, _ = precision_runs
    for job, precision in zip(jobs, ("32-true", "bf16-mixed")):
        assert f"trainer.precision={precision}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert_finite_on_cuda(metrics_of(job), task)
    assert quality_metrics(metrics_of(jobs[0])).keys() == quality_metrics(metrics_of(jobs[1])).keys()


def test_mode_test_and_summary_on_cuda(precision_runs, env, tmp_path):  # noqa: F811 - env is a fixture
    """``mode=test`` of the float32 run's best checkpoint on the GPU gives that run's test metrics."""
    task, jobs, extra = precision_runs
    [best] = (jobs[0] / "checkpoints").glob("best-*.ckpt")
    gpu_run([*RUNS[task], *extra, "mode=test", f"ckpt_path={best}"], env, tmp_path / "test")
    trained, tested = metrics_of(jobs[0]), metrics_of(tmp_path / "test")
    assert_finite_on_cuda(tested, task)
    key = TEST_METRIC[task]
    assert tested[key] == pytest.approx(trained[key], rel=1e-4, abs=1e-5), key
    out = gpu_run([*RUNS[task], "mode=summary"], env, tmp_path / "summary").stdout
    assert out.strip().splitlines()[-1].startswith("params=")


@pytest.mark.parametrize("task", list(RUNS))
def test_every_task_trains_compiled_on_cuda(task, env, tmp_path):  # noqa: F811 - env is a fixture
    """``trainer.compile=true`` with inductor: Triton kernels for the GPU, the run's metrics finite."""
    extra = [f"metrics.cache_dir={tmp_path / 'fid'}"] if task == "gan" else []
    gpu_run([*RUNS[task], *extra, "trainer.compile=true"], env, tmp_path / "run")
    metrics = metrics_of(tmp_path / "run")
    assert_finite_on_cuda(metrics, task)
    assert metrics["compile_graphs"] > 0 and metrics["compile_time_s"] > 0


@pytest.mark.parametrize("attn", ["linear_elu", "external"])
def test_linear_variants_train_as_cuda_graphs(attn, env, tmp_path):  # noqa: F811 - env is a fixture
    """``trainer.compile_mode=reduce-overhead``, what removes the launches that bound the linear variants at small N
    (``benchmarks/small_n.py``): PCT with them trains, validates and tests with its steps replayed as CUDA graphs
    (FPS and kNN, outside the graphs, between them), the metrics finite."""
    gpu_run([*TINY, f"attn={attn}", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"], env,
            tmp_path / "run")
    metrics = metrics_of(tmp_path / "run")
    assert_finite_on_cuda(metrics, "modelnet")
    assert metrics["compile_graphs"] > 0


@pytest.mark.parametrize("task", list(RUNS))
def test_deterministic_runs_of_one_seed_are_identical_on_cuda(task, env, tmp_path):  # noqa: F811 - env is a fixture
    results = []
    for name in ("a", "b"):
        extra = [f"metrics.cache_dir={tmp_path / 'fid'}"] if task == "gan" else []
        gpu_run([*RUNS[task], *extra, "seed=3", "trainer.deterministic=true"], env, tmp_path / name)
        results.append(quality_metrics(metrics_of(tmp_path / name)))
    assert results[0] == results[1]


# Runs whose attention takes the suite's own Triton kernels on CUDA: dilated attention on a grid (DilateFormer-T's
# stages) and attention over indexed keys on point sets (focal and dilated on PCT's blocks), besides FPS and kNN.
TRITON_RUNS = {
    "dilated-grid": [*TASKS["classification"], "model=dilateformer_t", "attn=dilated", "trainer.max_epochs=1",
                     "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1"],
    "dilated-points": [*TINY, "attn=dilated"],
    "focal-points": [*TINY, "attn=focal"],
}


@pytest.mark.parametrize("name", list(TRITON_RUNS))
def test_triton_kernels_train_deterministically_on_cuda(name, env, tmp_path):  # noqa: F811 - env is a fixture
    """The fused kernels in a real training run: no kernel fails (a failure would warn and hand over to torch, and
    the run would still pass), and two deterministic runs of one seed are identical (no atomics in them)."""
    results = []
    for run_name in ("a", "b"):
        proc = gpu_run([*TRITON_RUNS[name], "seed=3", "trainer.deterministic=true"], env, tmp_path / run_name)
        assert "the Triton kernel failed" not in proc.stdout + proc.stderr
        results.append(quality_metrics(metrics_of(tmp_path / run_name)))
    assert results[0] == results[1] and all(math.isfinite(v) for v in results[0].values())


def test_sigkill_then_resume_matches_an_uninterrupted_run_on_cuda(env, tmp_path):  # noqa: F811 - env is a fixture
    """tests/test_resume.py's PCT run on the GPU, deterministic: killed after a checkpoint, resumed, identical."""
    args = [*(a for a in without_accelerator(RESUME_ARGS) if not a.startswith("logger=")), *GPU,
            "trainer.deterministic=true", "logger=none"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run([*args, f"hydra.run.dir={straight}"], env)
    kill_after_a_checkpoint(args, env, killed)
    run([*args, f"hydra.run.dir={killed}", "resume=true"], env)
    a, b = quality_metrics(metrics_of(straight)), quality_metrics(metrics_of(killed))
    assert a == b


def test_gan_resumed_mid_epoch_continues_where_it_stopped_on_cuda(env, tmp_path):  # noqa: F811 - env is a fixture
    args = [*GAN_TINY, "attn=external", "metrics.every_n_steps=2", "metrics.num_samples=4", "eval.num_samples=4",
            f"metrics.cache_dir={tmp_path / 'fid'}", "+trainer.num_sanity_val_steps=0", "trainer.deterministic=true"]
    gpu_run([*args, "trainer.max_steps=6"], env, tmp_path / "straight")
    gpu_run([*args, "trainer.max_steps=2"], env, tmp_path / "split")
    gpu_run([*args, "trainer.max_steps=6", "ckpt_path=last"], env, tmp_path / "split")
    assert quality_metrics(metrics_of(tmp_path / "straight")) == quality_metrics(metrics_of(tmp_path / "split"))
    states = [torch.load(tmp_path / d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
              for d in ("straight", "split")]
    assert states[0]["global_step"] == states[1]["global_step"] == 6
    for key, value in states[0]["state_dict"].items():
        assert torch.equal(value, states[1]["state_dict"][key]), key


@pytest.mark.parametrize("task", list(TASKS))
def test_training_step_does_not_synchronise_on_cuda(task):
    """Training steps after a first one under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call
    (a value read, a blocking copy between host and device, a value-sized output) raises."""
    assert train_watched(TASKS[task], CudaSyncErrors(), accelerator="gpu") == 3


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_sdpa_kernels_are_counted_on_cuda(backend):
    """attn=self on the GPU, SDPA held to one fused kernel: forward + backward equal the analytic count, and the
    kernel's own ops are among those counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import attention

    b, n, c, heads = 2, 256, 64, 4
    mixer = attention.build("self", dim=c, heads=heads).cuda().to(torch.bfloat16)
    x = torch.randn(b, n, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(getattr(SDPBackend, backend)), FlopCounterMode(display=False) as counter:
        mixer(x, None).sum().backward()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    kernel = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient"}[backend]
    assert {f"aten._scaled_dot_product_{kernel}_attention", f"aten._scaled_dot_product_{kernel}_attention_backward"} \
        <= ops, ops
    projections = 2 * b * n * c * 3 * c + 2 * b * n * c * c  # qkv and output Linear, forward
    attention_fwd = 2 * b * n * n * 2 * c  # Q K^T and A V over all heads
    attention_bwd = 2 * b * n * n * 5 * c  # recomputed Q K^T, dP, dV, dQ, dK
    assert counter.get_total_flops() == 3 * projections + attention_fwd + attention_bwd


def test_quick_bench_on_cuda(env, tmp_path):  # noqa: F811 - env is a fixture
    """``mode=bench bench.device=cuda``: every variant timed on the GPU, the table written."""
    run(["mode=bench", "bench.quick=true", "bench.device=cuda", "logger=none", f"hydra.run.dir={tmp_path}",
         f"bench.table_dir={tmp_path / 'table'}"], env)
    assert (tmp_path / "cost-cuda.csv").is_file(), sorted(p.name for p in tmp_path.iterdir())


def test_bench_attention_clock_reads_cuda_events_without_waiting():
    """``bench.tasks``' attention clock on a GPU: its hooks record CUDA events only (under the sync debug mode's
    "error" a wait raises), and the spans read afterwards cover the mixer's forward and backward."""
    import attention
    from benchmarks.throughput import AttentionClock, Marks

    mixer = attention.build("external", dim=64).cuda()
    clock = AttentionClock(mixer, Marks("cuda"))
    x = torch.randn(2, 256, 64, device="cuda", requires_grad=True)
    mixer(x, None).sum().backward()  # first call: lazy CUDA initialisation may wait
    clock.spans.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = clock.marks.now()
        mixer(x, None).sum().backward()
        end = clock.marks.now()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(clock.spans) == 2  # forward, backward
    assert 0 < clock.seconds(clock.spans) < clock.marks.seconds(start, end)
