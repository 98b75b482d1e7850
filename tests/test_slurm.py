"""SLURM through Hydra's submitit launcher (``hydra/launcher=slurm``), without a cluster.

What is checked: the launcher config takes its resources from the trainer config; the sbatch script submitit
writes for it asks for them and for the SIGUSR1 warning Lightning's auto-requeue listens for; the submitted job
finds the same output directory however late it (re)starts; a sweep runs end to end through submitit's local
executor; Lightning recognises SLURM from srun's variables alone, its handlers coexist with submitit's; and a
run that gets SIGUSR1 saves an hpc checkpoint, calls ``scontrol requeue`` and, started again, resumes from it.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_run import TINY, env, run  # noqa: F401  (env is a fixture)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# What srun exports to each task of a job-array element (job 4242, element 1 = SLURM job 4243), one task.
SLURM_VARS = {"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "1",
              "SLURM_JOB_NAME": "run", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1",
              "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODELIST": "node001", "SLURM_JOB_NODELIST": "node001"}


def stub_commands(folder: Path, **scripts: str) -> Path:
    """``folder/bin/<name>``: executable shell scripts standing in for SLURM's commands."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return bin_dir


def launcher_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), job_name="run", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


# --- the launcher configs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, devices, nodes", [
    ([], 1, 1),
    (["trainer.devices=4"], 4, 1),
    (["trainer.devices=4", "++trainer.num_nodes=2"], 4, 2),  # ++: the trainer config may or may not have it
])  # fmt: skip
def test_slurm_launcher_takes_resources_from_the_trainer(overrides, devices, nodes):
    cfg = launcher_config("hydra/launcher=slurm", "hydra.launcher.partition=gpu", *overrides)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")  # extends the plugin's submitit_slurm
    assert launcher["partition"] == "gpu"
    assert launcher["tasks_per_node"] == devices and launcher["gpus_per_node"] == devices  # one process per GPU
    assert launcher["nodes"] == nodes
    assert launcher["additional_parameters"]["signal"] == f"USR1@{launcher['signal_delay_s']}"
    assert launcher["max_num_timeout"] == 0  # Lightning requeues, not submitit
    # What the plugin's launcher receives once Hydra instantiates it: interpolations resolved against the job config.
    params = instantiate(cfg.hydra.launcher).params
    assert (params["tasks_per_node"], params["gpus_per_node"], params["nodes"]) == (devices, devices, nodes)


def test_signal_follows_signal_delay():
    cfg = launcher_config("hydra/launcher=slurm", "hydra.launcher.signal_delay_s=300")
    assert cfg.hydra.launcher.additional_parameters.signal == "USR1@300"


def test_local_launcher_composes():
    launcher = launcher_config("hydra/launcher=local", "trainer.devices=2").hydra.launcher
    assert launcher._target_.endswith("LocalLauncher")
    assert launcher.tasks_per_node == 1 and launcher.gpus_per_node == 2


# --- the sbatch script and the submitted job ---------------------------------------------------------------------
def _task(cfg):  # stands for run.py's main in the pickled launcher
    return cfg


def test_sbatch_script_and_stable_output_dir(tmp_path, monkeypatch):
    """The launcher's own launch(): submitit writes the real sbatch script (a stub sbatch "submits" it) and
    pickles the launcher with each run's overrides; that pickle is what every start of the job, a requeued
    one included, loads, and it must give the sweep directory decided at submission."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import HydraContext
    from submitit.core.utils import DelayedSubmission
    from submitit.slurm.slurm import SlurmJob

    bin_dir = stub_commands(tmp_path, sbatch='echo "Submitted batch job 4242"', srun="exit 0")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    monkeypatch.chdir(tmp_path)  # the default sweep dir, multirun/<time>, is relative
    monkeypatch.setattr(SlurmJob, "results", lambda self: [self.job_id])  # instead of waiting for the jobs
    task = ["trainer.devices=4", "++trainer.num_nodes=2", "task=modelnet"]
    hydra = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=90"]
    with initialize_config_dir(config_dir=str(CONFIGS), job_name="run", version_base="1.3"):
        cfg = compose("config", overrides=[*hydra, *task], return_hydra_config=True)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=Callbacks())
        launcher = instantiate(cfg.hydra.launcher)
        launcher.setup(hydra_context=context, task_function=_task, config=cfg)
        sweep_dir = Path(cfg.hydra.sweep.dir)  # multirun/<now>: what the launch below prints and creates
        # The basic sweeper's batch for `attn=self,external`: every run's full list of task overrides.
        jobs = launcher.launch([[*task, "attn=self"], [*task, "attn=external"]], initial_job_idx=0)
    assert jobs == ["4242_0", "4242_1"]  # one job array, an element per run

    (script,) = (sweep_dir / ".submitit").glob("*/*_submission.sh")
    sbatch = script.read_text()
    for flag in ["--partition=gpu", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8",
                 "--mem=64GB", "--time=90", "--signal=USR1@120", "--requeue", "--array=0-1%2", "--job-name=run"]:
        assert f"#SBATCH {flag}\n" in sbatch, (flag, sbatch)
    assert sbatch.count("--signal") == 1  # submitit's own --signal=USR2@... replaced
    assert "srun --unbuffered" in sbatch and "-m submitit.core._submit" in sbatch

    # A (re)started job loads its pickle and composes its config as the launcher's __call__ does; `${now:}` in
    # hydra.sweep.dir must give the submission time, not the time the job starts.
    time.sleep(1.1)
    pickles = sorted((sweep_dir / ".submitit").glob("*/*_submitted.pkl"))
    assert [p.name for p in pickles] == ["4242_0_submitted.pkl", "4242_1_submitted.pkl"]
    for num, path in enumerate(pickles):
        delayed = DelayedSubmission.load(path)
        job_overrides, job_dir_key, job_num = delayed.args[:3]
        assert job_overrides == [*task, f"attn={['self', 'external'][num]}"] and job_num == num
        job_cfg = delayed.function.hydra_context.config_loader.load_sweep_config(delayed.function.config,
                                                                                 job_overrides)
        assert Path(OmegaConf.select(job_cfg, job_dir_key)) == sweep_dir
        assert (job_cfg.attn.name, job_cfg.trainer.devices, job_cfg.trainer.num_nodes) == (
            ["self", "external"][num], 4, 2)


# --- a sweep through submitit, locally ---------------------------------------------------------------------------
def test_local_launcher_runs_a_sweep(env, tmp_path):
    """`python run.py -m hydra/launcher=local ...`: each run a submitit job in its own process. The first job fails
    (seed=-1, refused when the job starts) while the second is still running: the launcher used to raise at the
    first failed job's result, a traceback and exit code 1 while the others were still running. Now it waits for
    both, the finished one is reported back, and the end lists the failed one with its message and log, exit code
    2. (Two jobs, not more: each is two cold processes, submitit's and the run's.)"""
    sweep = tmp_path / "sweep"
    proc = run(["-m", "hydra/launcher=local", *TINY, "task=modelnet", "attn=external", "seed=-1,0",
                "trainer.fast_dev_run=true", "data.eval_batch_size=4", "logger=none", f"hydra.sweep.dir={sweep}"],
               env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = proc.stderr[proc.stderr.index("error: 1 of the sweep's 2 jobs failed (1 finished)"):]
    (line,) = [x for x in summary.splitlines() if x.startswith("  #")]  # the failed job, by what sets it apart
    assert line.startswith("  #0 0_modelnet_external (seed=-1): seed=-1 is not a seed: it must be a whole"), line
    log = Path(line.split("(its log: ")[1].rstrip(")"))
    assert "error: seed=-1 is not a seed" in log.read_text()  # the job's own error stream
    assert f"resume=true hydra.sweep.dir={sweep}" in summary
    job = sweep / "1_modelnet_external"
    assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["seed"] == 0
    metrics = json.loads((job / "metrics.json").read_text())
    assert 0.0 <= metrics["test/oa"] <= 1.0
    (result,) = sorted((sweep / ".submitit").glob("*/*_result.pkl"))  # the finished job, reported back
    with result.open("rb") as f:
        assert pickle.load(f)[0] == "success"


# --- Lightning under SLURM ---------------------------------------------------------------------------------------
DETECT = r"""
import json, os, signal, sys
import lightning as L
from hydra import compose, initialize_config_dir
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf
from submitit.core.utils import DelayedSubmission, JobPaths
from submitit.slurm.slurm import SlurmJobEnvironment

configs, root = sys.argv[1:]
out = {"detect": SLURMEnvironment.detect()}
slurm = SLURMEnvironment()
out["env"] = [slurm.world_size(), slurm.global_rank(), slurm.local_rank(), slurm.node_rank()]

def names(handler):
    return sorted(getattr(h, "__name__", str(h)) for h in getattr(handler, "signal_handlers", [handler]))

def trainer():
    # As run.py builds it: the trainer config as keyword arguments, no plugins, no cluster environment given.
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose("config", overrides=["trainer.accelerator=cpu", "trainer.devices=4", "++trainer.num_nodes=2",
                                           "logger=none"])
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    for key in ("on_nan", "compile", "compile_backend", "compile_mode", "compile_dynamic", "tf32"):
        kwargs.pop(key)  # run.py's own options, never Lightning's (suite/guard.py, suite/compile.py, suite/tf32.py)
    return L.Trainer(**kwargs, logger=False, default_root_dir=root)

# submitit's job process installs its handlers before it calls the Hydra job (submitit/core/submission.py).
SlurmJobEnvironment()._handle_signals(JobPaths(root), DelayedSubmission(print))
t = trainer()
env = t._accelerator_connector.cluster_environment
out["trainer"] = [type(env).__name__, env.auto_requeue, env.requeue_signal.name,
                  t.world_size, t.global_rank, t.local_rank, t.node_rank]
t._signal_connector.register_signal_handlers()  # what fit() and test() do first
out["usr1"] = names(signal.getsignal(signal.SIGUSR1))
out["usr2"] = names(signal.getsignal(signal.SIGUSR2))
out["term"] = names(signal.getsignal(signal.SIGTERM))
t._signal_connector.teardown()

# Were submitit to take SIGUSR1 (SUBMITIT_PREEMPT_SIGNAL=USR1), Lightning would leave it alone: no checkpoint.
SlurmJobEnvironment.USR_SIG = "USR1"
SlurmJobEnvironment()._handle_signals(JobPaths(root), DelayedSubmission(print))
t = trainer()
t._signal_connector.register_signal_handlers()
out["usr1_if_submitit_took_it"] = names(signal.getsignal(signal.SIGUSR1))

os.environ["SLURM_JOB_NAME"] = "interactive"  # an salloc/srun shell hosting runs by hand: not a batch job
out["detect_interactive"] = SLURMEnvironment.detect()
print(json.dumps(out))
"""


def test_lightning_detects_slurm_from_the_environment(env, tmp_path):
    """srun's variables alone make Lightning pick SLURMEnvironment (ranks from SLURM, auto-requeue on SIGUSR1),
    and its SIGUSR1 handler is installed beside submitit's USR2 / SIGTERM ones."""
    slurm = {**SLURM_VARS, "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
             "SUBMITIT_EXECUTOR": "slurm"}
    clean = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run([sys.executable, "-c", DETECT, str(CONFIGS), str(tmp_path)], env={**clean, **slurm},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["detect"] is True
    assert out["env"] == [8, 5, 1, 1]
    assert out["trainer"] == ["SLURMEnvironment", True, "SIGUSR1", 8, 5, 1, 1]
    assert out["usr1"] == ["_slurm_sigusr_handler_fn"]  # Lightning: hpc checkpoint + scontrol requeue
    assert out["usr2"] == ["checkpoint_and_try_requeue"]  # submitit's, never sent: sbatch asks for USR1
    assert "_sigterm_notifier_fn" in out["term"] and "bypass" in out["term"]  # Lightning's, chained to submitit's
    assert out["usr1_if_submitit_took_it"] == ["checkpoint_and_try_requeue"]
    assert out["detect_interactive"] is False


def test_sigusr1_checkpoints_requeues_and_the_job_resumes(env, tmp_path):
    """A run under SLURM (two data-loading workers) gets the time-limit warning: Lightning saves hpc_ckpt_1.ckpt in
    the run directory and calls `scontrol requeue <array job>_<element>`; SLURM then ends it (SIGTERM). Started again
    in the same directory, as the requeued job is, training continues from that checkpoint."""
    out = tmp_path / "run"
    calls = tmp_path / "scontrol.log"
    bin_dir = stub_commands(tmp_path, scontrol=f'echo "$@" >> "{calls}"')
    slurm_env = {**{k: v for k, v in env.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}, **SLURM_VARS,
                 "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}
    args = [*TINY, "task=modelnet", "attn=external", "data.num_classes=3", "data.train_per_class=2",
            "data.val_per_class=1", "data.test_per_class=1", "data.num_workers=2", "logger=none",
            f"hydra.run.dir={out}"]
    log1 = tmp_path / "first.log"
    with log1.open("w") as f:  # a process group of its own: SLURM signals every process of the job, workers too
        first = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args, "trainer.max_epochs=200"],
                                 cwd=env["HOME"], env=slurm_env, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                 start_new_session=True)
    try:
        def wait_for(path: Path, seconds: float):
            deadline = time.monotonic() + seconds
            while not path.exists():
                assert first.poll() is None, f"run.py exited {first.returncode}:\n{log1.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no {path.name}:\n{log1.read_text()[-3000:]}"
                time.sleep(0.1)

        wait_for(out / "checkpoints" / "last.ckpt", 180)  # an epoch done: fit() is running, handlers are set
        # sbatch --signal=USR1@<delay>: to every process of the job. Its data-loading workers died of it (and of the
        # SIGTERM below), and the run crashed with "DataLoader worker ... is killed by signal" before it requeued.
        os.killpg(first.pid, signal.SIGUSR1)
        wait_for(calls, 60)  # the handler calls scontrol after the checkpoint is written
        os.killpg(first.pid, signal.SIGTERM)  # scontrol requeue ends the running job
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert calls.read_text().split() == ["requeue", "4242_1"]
    assert first.returncode == 143, log1.read_text()[-3000:]  # ended by SIGTERM, not finished; it says the requeued job resumes by itself
    assert "interrupted by SIGTERM" in log1.read_text() and "a requeued SLURM job resumes by itself" in log1.read_text()
    assert not (out / "metrics.json").exists()  # stopped mid-training
    saved = torch.load(out / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)

    # The requeued job: same command and directory. (Here with fewer epochs, so that it ends soon: the cosine
    # schedule's T_max, set from max_epochs, shows that the schedule continued from the checkpoint's. One more epoch
    # than the saved one: a signal that lands after an epoch's last batch leaves nothing of that epoch to train.)
    run([*args, f"trainer.max_epochs={saved['epoch'] + 2}"], slurm_env)
    final = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert [s["T_max"] for s in final["lr_schedulers"]] == [200]  # from the first run, not max_epochs=epoch+2
    assert final["global_step"] > saved["global_step"]
    assert 0.0 <= json.loads((out / "metrics.json").read_text())["test/oa"] <= 1.0


def test_runs_of_one_job_get_a_directory_each_and_its_requeue_finds_its_own(env, tmp_path):
    """A W&B agent, or a script's loop over seeds, runs several runs one after the other inside one SLURM job. With
    the job id alone they shared outputs/<task>/<attn>/slurm-<job id>: the second run took the first one's results
    for its own requeued job and "resumed" them, reporting the first run's network under its own seed. Each run of
    the job now has slurm-<job id>-<command digest>; the same command started again (the job requeued) finds its own
    and resumes it."""
    slurm_env = {**{k: v for k, v in env.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}, **SLURM_VARS}
    args = [*TINY, "logger=none"]

    def job_run(seed: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "run.py"), *args, f"seed={seed}"], cwd=tmp_path,
                              env=slurm_env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)

    first, second = job_run(1), job_run(2)
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-3000:]
    runs = sorted((tmp_path / "outputs" / "modelnet" / "external").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("slurm-4243-") for r in runs)
    seeds = {yaml.safe_load((r / "resolved_config.yaml").read_text())["seed"]: r for r in runs}
    assert sorted(seeds) == [1, 2] and all((r / "metrics.json").is_file() for r in runs)
    assert "finished already" not in second.stdout + second.stderr
    kept = (seeds[1] / "metrics.json").read_bytes()
    again = job_run(1)  # the first run's job requeued: same job id, same command
    assert again.returncode == 0 and "this run had finished already" in again.stdout + again.stderr
    assert (seeds[1] / "metrics.json").read_bytes() == kept
    assert len(list((tmp_path / "outputs" / "modelnet" / "external").iterdir())) == 2


def test_the_requeue_signal_saves_at_a_step_boundary(tmp_path, monkeypatch):
    """SLURM's time-limit signal (SIGUSR1) landing between two parameters' updates of an optimizer step: Lightning's
    handler saved hpc_ckpt_1.ckpt right there, with the first parameter updated and the second not (half a step),
    then requeued. It now saves at the end of that batch (the whole step in the checkpoint), then requeues."""
    import lightning as L

    from suite.sigterm import AgreedSigterm

    calls = tmp_path / "scontrol.log"
    bin_dir = stub_commands(tmp_path, scontrol=f'echo "$@" >> "{calls}"')
    for name in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(name)
    for name, value in {**SLURM_VARS, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}.items():
        monkeypatch.setenv(name, value)

    class HalfSignalled(torch.optim.SGD):
        """SGD, parameter by parameter, the requeue signal arriving between the two at the third step."""

        def step(self, closure=None):
            loss = closure()
            with torch.no_grad():
                first, second = self.param_groups[0]["params"]
                first.sub_(0.1 * first.grad)
                if self.state.setdefault("steps", [0])[0] == 2:
                    signal.raise_signal(signal.SIGUSR1)
                second.sub_(0.1 * second.grad)
            self.state["steps"][0] += 1
            return loss

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.tensor(2.0))
            self.after = {}

        def training_step(self, batch, batch_idx):
            return (self.a * batch.sum() + self.b) ** 2

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after[self.trainer.global_step] = (self.a.item(), self.b.item())

        def configure_optimizers(self):
            return HalfSignalled(self.parameters(), lr=0.1)

    module = Tiny()
    trainer = L.Trainer(max_steps=5, callbacks=[AgreedSigterm()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=1))
    assert calls.read_text().split() == ["requeue", "4242_1"]
    saved = torch.load(tmp_path / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
    assert (saved["state_dict"]["a"].item(), saved["state_dict"]["b"].item()) == module.after[3]


def test_a_job_requeued_without_the_warning_resumes_in_its_sweep_directory(tmp_path, monkeypatch):
    """Pre-emption or a node failure: SLURM requeues the job (SLURM_RESTART_COUNT=1) with no SIGUSR1 before, so no
    hpc checkpoint, only the last.ckpt its SIGTERM wrote. In a hydra/launcher=slurm job's directory
    (<sweep>/<n>_<task>_<attn>, not slurm-<job id>-<digest>) the requeued job was refused as a fresh run in another
    run's directory (exit 2); it continues the run. The same directory before any requeue is still refused."""
    from attention.errors import UserError
    from suite.run_dirs import check_fresh_run, slurm_restart

    for name in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(name)
    for name, value in SLURM_VARS.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "0_modelnet_external"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert not slurm_restart(run_dir)  # the job's first start: the directory holds another run's results
    with pytest.raises(UserError, match="holds another run's results"):
        check_fresh_run(run_dir, resume=False, ckpt_path=None, overwrite=False, slurm_restart=slurm_restart(run_dir))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert slurm_restart(run_dir)
    check_fresh_run(run_dir, resume=False, ckpt_path=None, overwrite=False, slurm_restart=slurm_restart(run_dir))
    assert not slurm_restart(tmp_path / "1_modelnet_self")  # requeued, but nothing of this run to resume
