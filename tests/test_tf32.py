"""``trainer.tf32`` (suite/tf32.py): float32 matrix products and cuDNN convolutions in one arithmetic. What it does to
speed is for a GPU to show (benchmarks/pct_cuda.py's like-for-like rows); here: the switches it sets, that they are
restored around a benchmark's step, the start-up check, and that a run takes the option out of Lightning's way."""

from __future__ import annotations

import pytest
import torch

from suite import tf32
from test_config_checks import compose_run, refused
from test_run import TINY, env, run  # noqa: F401 - env is a fixture


@pytest.fixture
def torch_defaults():
    """torch's own switches before and after each test, whatever it sets."""
    before = tf32.state()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.parametrize("choice, expected", [
    (None, ("highest", True)),   # torch's defaults: convolutions may use TF32, matrix products may not
    (True, ("high", True)),      # both TF32
    (False, ("highest", False)),  # both IEEE float32
])
def test_each_choice_sets_both_switches_and_the_block_restores_them(torch_defaults, choice, expected):
    with tf32.arithmetic(choice):
        assert tf32.state() == expected
        # Lightning reads the matmul precision as a whole (lightning/fabric/accelerators/cuda.py): it must not raise
        assert torch.get_float32_matmul_precision() == expected[0]
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if expected[0] == "high" else "ieee")
    assert tf32.state() == ("highest", True)
    tf32.apply(choice)
    assert tf32.state() == expected


def test_the_block_restores_the_switches_after_an_error(torch_defaults):
    with pytest.raises(RuntimeError, match="inside"), tf32.arithmetic(True):
        raise RuntimeError("inside")
    assert tf32.state() == ("highest", True)


def test_take_option_removes_the_key_lightning_would_refuse():
    kwargs = {"accelerator": "cpu", "tf32": True}
    assert tf32.take_option(kwargs) is True and kwargs == {"accelerator": "cpu"}
    assert tf32.take_option(kwargs) is None


@pytest.mark.parametrize("value", ["maybe", "1.5", "[true]"])
def test_a_value_other_than_true_false_or_null_is_refused_at_start(value):
    message = refused([f"trainer.tf32={value}"])
    assert "trainer.tf32=" in message and "true, false or null" in message and "configs/trainer/" in message


def test_true_false_and_null_pass_the_start_up_check():
    from suite.validate import validate_config

    for value in ("true", "false", "null"):
        validate_config(compose_run([f"trainer.tf32={value}"]), [f"trainer.tf32={value}"])


def test_a_run_takes_the_option_and_says_what_it_set(env, tmp_path):  # noqa: F811
    proc = run([*TINY, "trainer.accelerator=cpu", "trainer.tf32=false", "logger=none",
                f"hydra.run.dir={tmp_path / 'run'}"], env)
    assert "trainer.tf32=false: float32 matrix products and cuDNN convolutions in IEEE float32" in \
        proc.stdout + proc.stderr
    assert (tmp_path / "run" / "metrics.json").is_file()


# Each job prints the switches it trains under (they are set as its Trainer is built).
SAY_SWITCHES = r"""
import suite.train
from suite import determinism, tf32
build = suite.train.build_trainer
def build_trainer(*args, **kwargs):
    out = build(*args, **kwargs)
    print("SWITCHES", *tf32.state(), *determinism.state())
    return out
suite.train.build_trainer = build_trainer
"""


def test_a_null_job_after_a_true_one_in_the_same_process_runs_under_torchs_defaults(env, tmp_path):  # noqa: F811
    """A local multirun's jobs share the process: the `null` job (torch's defaults, untouched) ran in the TF32 that
    the `true` job before it had set, and in the deterministic mode (Lightning's flags and CUBLAS_WORKSPACE_CONFIG)
    of a `trainer.deterministic=true` job before it; each run now puts the switches back as it ends."""
    from test_reliability import launch

    env = {k: v for k, v in env.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    # trainer.deterministic follows trainer.tf32 in each job: job 1 true and true, job 2 null and null
    proc = launch(SAY_SWITCHES, ["-m", *TINY, "trainer.accelerator=cpu", "logger=none", "trainer.tf32=true,null",
                                 "trainer.deterministic=${trainer.tf32}", f"hydra.sweep.dir={tmp_path}"], env)
    said = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("SWITCHES")]
    # a fresh process's (this one's are the same): matmul precision, cuDNN TF32, deterministic algorithms, their
    # warn-only mode, cuDNN benchmarking, CUBLAS_WORKSPACE_CONFIG
    defaults = [torch.get_float32_matmul_precision(), "True", "False", "False", "False", "None"]
    assert said == [["high", "True", "True", "False", "False", ":4096:8"], defaults], proc.stdout[-2000:]


@pytest.mark.parametrize("choice", [None, False])
def test_lightnings_tensor_core_hint_names_the_option(torch_defaults, monkeypatch, caplog, choice):
    """Lightning's own check (lightning.fabric.accelerators.cuda, run as on an H200 with IEEE matrix products) asks
    for ``torch.set_float32_matmul_precision`` in the user's code; a run says ``trainer.tf32`` instead, and says
    nothing when the user chose IEEE float32 (``trainer.tf32=false``). Other records of that logger pass."""
    import logging

    from lightning.fabric.accelerators import cuda as lightning_cuda
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(lightning_cuda, "_is_ampere_or_later", lambda device=None: True)
    try:
        tf32.install_hint_filter(choice)
        with caplog.at_level(logging.INFO):
            lightning_cuda._check_cuda_matmul_precision.__wrapped__(torch.device("cuda", 0))
            rank_zero_info("GPU available: True (cuda), used: True")
    finally:
        for name in tf32.LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for f in [f for f in logger.filters if isinstance(f, tf32.TensorCoreHint)]:
                logger.removeFilter(f)
    messages = [r.getMessage() for r in caplog.records]
    assert "GPU available: True (cuda), used: True" in messages
    assert not any("set_float32_matmul_precision" in m for m in messages), messages
    hints = [m for m in messages if "Tensor Cores" in m]
    if choice is None:
        assert len(hints) == 1 and "'NVIDIA H200' has Tensor Cores" in hints[0] and "trainer.tf32=true" in hints[0]
    else:
        assert hints == []
