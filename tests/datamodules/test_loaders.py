"""Training loaders: shuffles that are a function of (seed, epoch), and a position that survives a resume; the
loaders, option checks and bad-file policy of the one data-module base (``datamodules.base``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

from attention.errors import UserError
from datamodules.base import BadFiles, DataError, DataModule, choice_option, float_option
from datamodules.loaders import EpochRandomSampler, LoaderPosition, ResumableLoader, train_sampling


def loader(num_workers=0, seed=7):
    data = TensorDataset(torch.arange(23))
    return ResumableLoader(data, batch_size=4, drop_last=True, sampler=EpochRandomSampler(data, seed),
                           generator=torch.Generator().manual_seed(seed), num_workers=num_workers)


def batches(dl, epoch, limit=None):
    dl.sampler.set_epoch(epoch)
    out = []
    for (batch,) in dl:
        out.append(batch.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


def test_shuffle_is_a_function_of_seed_and_epoch_only():
    torch.manual_seed(0)
    a = batches(loader(), 3)
    torch.manual_seed(1)  # the global generator plays no part
    assert batches(loader(), 3) == a
    assert batches(loader(), 4) != a and batches(loader(seed=8), 3) != a
    assert len(a) == 5 and len({i for b in a for i in b}) == 20  # a permutation, last partial batch dropped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_state_resumes_with_the_next_batch(num_workers):
    full = batches(loader(), 2)
    first = loader(num_workers)
    assert batches(first, 2, limit=2) == full[:2]
    state = first.state_dict()
    assert state == {"epoch": 2, "samples": 8, "batch_size": 4, "processes": 1}

    resumed = loader(num_workers)
    resumed.load_state_dict(state)  # sets the sampler's epoch itself
    assert [b.tolist() for (b,) in resumed] == full[2:]  # the rest of epoch 2, nothing repeated
    assert resumed.state_dict() == {"epoch": 3, "samples": 0, "batch_size": 4, "processes": 1}  # complete: the
    # next epoch starts afresh
    assert len(resumed) == 5
    assert batches(resumed, 3) == batches(loader(), 3)  # and later epochs are whole



def test_a_mid_epoch_resume_on_another_number_of_processes_says_it_is_not_the_same_run(caplog):
    """Each process skips the samples it had served, but of the split of the samples among the processes it has
    now: on another number of processes the rest of the epoch is not the uninterrupted run's. Said, not silent."""
    written_on_two = {"epoch": 2, "samples": 8, "batch_size": 4, "processes": 2}
    with caplog.at_level("WARNING", logger="datamodules.loaders"):
        loader().load_state_dict(written_on_two)
        loader().load_state_dict({**written_on_two, "samples": 0})  # at an epoch's start: nothing differs
        loader().load_state_dict({**written_on_two, "processes": 1})
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("Resumed in the middle of epoch 2 on 1 process(es), from a checkpoint written on 2")
    assert "Resuming on 2 process(es) (trainer.devices, trainer.num_nodes) continues it exactly" in said


def sized(batch_size, drop_last=True, seed=7, size=23):
    data = TensorDataset(torch.arange(size))
    return ResumableLoader(data, batch_size=batch_size, drop_last=drop_last, sampler=EpochRandomSampler(data, seed))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("new_size", [2, 3, 4, 8])
def test_a_mid_epoch_resume_with_another_batch_size_serves_the_rest_of_the_epoch_once(new_size, drop_last):
    """The advice after running out of memory is to resume with a smaller data.batch_size. The position was a count
    of batches, and the resumed loader skipped that many of the new size: 2 of 4 served, 2 of 2 skipped, so 4 of the
    8 samples served trained twice in that epoch (a larger batch: samples never seen). It is the samples served
    now: the rest of the epoch is the samples not served yet, in their order, in batches of the new size (the last
    partial one dropped as the loader drops it)."""
    order = [i for b in batches(sized(1, drop_last=False), 2) for i in b]  # epoch 2's permutation of the 23
    first = sized(4, drop_last)
    assert [i for b in batches(first, 2, limit=2) for i in b] == order[:8]
    state = first.state_dict()
    resumed = sized(new_size, drop_last)
    resumed.load_state_dict(state)
    rest = [b.tolist() for (b,) in resumed]
    left = order[8:]
    if drop_last:
        left = left[:len(left) - len(left) % new_size]
    assert [i for b in rest for i in b] == left
    assert all(len(b) == new_size for b in rest[:-1]) and 0 < len(rest[-1]) <= new_size
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["samples"] == 0  # the epoch is complete
    assert batches(resumed, 3) == batches(sized(new_size, drop_last), 3)  # and later epochs are whole


def test_a_position_of_before_the_count_of_samples_skips_batches_and_says_so(caplog):
    """Checkpoints written before the position was kept in samples hold batches, of a size they do not record: the
    rest of the epoch skips that many batches of this size (exact when it is the size they were written with)."""
    with caplog.at_level("WARNING", logger="datamodules.loaders"):
        resumed = sized(4)
        resumed.load_state_dict({"epoch": 2, "batches": 2, "processes": 1})
        assert [b.tolist() for (b,) in resumed] == batches(sized(4), 2)[2:]
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("Resumed in the middle of epoch 2 from a checkpoint that records the 2 batches served "
                           "in it, not their size: the rest of the epoch skips 2 batches of data.batch_size=4.")
    assert "resuming with the data.batch_size it was stopped with continues it exactly" in said


def test_a_position_in_an_epoch_that_has_ended_skips_nothing_in_the_next():
    """A checkpoint at the end of an epoch shortened by trainer.limit_train_batches holds a position inside it (the
    loader served 2 of its 5 batches): the next epoch, where the resumed run starts, skipped 2 batches."""
    first = sized(4)
    batches(first, 0, limit=2)
    resumed = sized(4)
    resumed.load_state_dict(first.state_dict())
    assert batches(resumed, 1) == batches(sized(4), 1)


class _Order(L.LightningModule):
    """Records the samples of each training batch and the epochs validated, on the loader of ``batch_size``."""

    def __init__(self, batch_size):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.batch_size, self.trained, self.validated = batch_size, [], []

    def training_step(self, batch, batch_idx):
        self.trained.append((self.current_epoch, batch[0].tolist()))
        return (self.w * batch[0].float()).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.validated.append(self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return sized(self.batch_size, size=64)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TensorDataset(torch.arange(2)))


class _SaveAt(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            trainer.save_checkpoint(self.path)


@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
def test_an_epoch_resumed_with_a_smaller_batch_ends_validated(tmp_path):
    """Lightning counts the batches an epoch has served, and its restored count was of the old size: 5 of 8 served,
    then the 6 batches of 4 left, and the epoch ended at batch 11 of 16 without its validation. LoaderPosition moves
    the count to batch 10 of 16: the rest of the epoch is trained once and validated."""
    def fit(batch_size, ckpt_path=None, callbacks=()):
        module = _Order(batch_size)
        L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0,
                  callbacks=[LoaderPosition(), *callbacks]).fit(module, ckpt_path=ckpt_path)
        return module

    straight = fit(8, callbacks=[_SaveAt(tmp_path / "mid.ckpt")])
    resumed = fit(4, ckpt_path=tmp_path / "mid.ckpt")
    epoch0 = [i for epoch, b in straight.trained if epoch == 0 for i in b]
    assert [i for epoch, b in resumed.trained if epoch == 0 for i in b] == epoch0[40:]
    assert resumed.validated == straight.validated == [0, 1]
    assert len([b for epoch, b in resumed.trained if epoch == 1]) == 16


def test_end_of_epoch_state_starts_the_next_epoch():
    dl = loader()
    batches(dl, 0)
    fresh = loader()
    fresh.load_state_dict(dl.state_dict())
    assert fresh.sampler.epoch == 1
    assert [b.tolist() for (b,) in fresh] == batches(loader(), 1)


class _Draws(torch.utils.data.Dataset):
    """Each sample a number drawn in the loading process: what augmentations see."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.randint(0, 2**30, ())


def test_worker_random_streams_depend_on_seed_and_epoch_only():
    def draws(epoch):
        data = _Draws()
        sampler_kwargs = train_sampling(data)
        dl = ResumableLoader(data, batch_size=4, num_workers=1, **sampler_kwargs)
        dl.sampler.set_epoch(epoch)
        return torch.cat(list(dl)).tolist()

    torch.manual_seed(5)
    first = draws(1)
    torch.manual_seed(5)
    assert draws(1) == first  # a resumed run re-creating its workers at epoch 1 draws the same
    torch.manual_seed(5)
    assert draws(2) != first


class Numbers(DataModule):
    """The base filled in with the least there is: the numbers 0..size-1, one bad "file" when asked."""

    def __init__(self, size=10, bad=False, batch_size=4, eval_batch_size=None, num_workers=0, seed=0,
                 on_bad_file="error"):  # fmt: skip
        super().__init__(batch_size, eval_batch_size, num_workers, seed, on_bad_file)
        self.size, self.has_bad = size, bad

    def _build(self):
        if self.has_bad:
            self.bad.file(DataError("numbers.txt: line 3 is not a number. Fix line 3.", "numbers.txt: line 3"))
        self.train_set = self.val_set = self.test_set = TensorDataset(torch.arange(self.size))


def test_base_loaders_drop_partial_training_batches_and_evaluate_every_sample():
    dm = Numbers(size=10, batch_size=4, eval_batch_size=3)
    assert [len(b) for (b,) in dm.train_dataloader()] == [4, 4]
    assert sorted(x for (b,) in dm.val_dataloader() for x in b.tolist()) == list(range(10))
    assert [len(b) for (b,) in dm.test_dataloader()] == [3, 3, 3, 1]


def test_base_training_split_smaller_than_a_batch():
    with pytest.raises(UserError, match=r"Numbers training split has 3 samples.*data.batch_size=4"):
        Numbers(size=3).train_dataloader()

    class Partial(Numbers):
        full_train_batches = False  # the point-cloud families: one partial batch instead

    assert [len(b) for (b,) in Partial(size=3).train_dataloader()] == [3]


def test_base_option_messages_name_the_option_and_an_example_from_the_signature():
    with pytest.raises(UserError, match=r"data.batch_size must be a positive integer, got 0.*data.batch_size=4"):
        Numbers(batch_size=0)
    with pytest.raises(UserError, match=r"data.num_workers must be an integer >= 0, got -1"):
        Numbers(num_workers=-1)
    with pytest.raises(UserError, match=r"data.on_bad_file must be 'error'"):
        Numbers(on_bad_file="ignore")
    with pytest.raises(UserError, match=r"data.val_fraction must be a number in \[0, 1\), got 1.0"):
        float_option("val_fraction", 1.0, 0.1, 0.0, 1.0, low_closed=True)
    assert float_option("noise", 0, 0.01, low_closed=True) == 0.0
    with pytest.raises(UserError, match=r"data.crop_pct must be a number in \(0, 1\], got 1.5; e.g. data.crop_pct=0.8"):
        float_option("crop_pct", 1.5, 0.875, high=1.0, high_closed=True)
    assert float_option("crop_pct", 1, 0.875, high=1.0, high_closed=True) == 1.0
    with pytest.raises(UserError, match=r"data.verify_images must be one of auto, true, false, got 'yes'"):
        choice_option("verify_images", "yes", ("auto", True, False))


def test_bad_files_error_names_the_file_and_skip_counts_and_warns_once(caplog):
    with pytest.raises(UserError, match=r"numbers.txt: line 3 is not a number. Fix line 3. .*data.on_bad_file=skip"):
        Numbers(bad=True).setup()
    dm = Numbers(bad=True, on_bad_file="skip")
    dm.setup()
    assert dm.skipped == ["numbers.txt: line 3"]
    assert caplog.text.count("Skipped 1 bad file(s) or sample(s) of Numbers (data.on_bad_file=skip)") == 1
    bad = BadFiles("skip")
    bad.problems([("a.png", "no mask"), ("b.png", "no mask")], "Restore them.")
    bad.warn("Pairs", "bad sample(s)")
    bad.warn("Pairs", "bad sample(s)")  # nothing new: no second warning
    assert caplog.text.count("Skipped 2 bad sample(s) of Pairs") == 1
    assert bad.skipped == ["a.png: no mask", "b.png: no mask"]


# A run's main process, with the loaders the data modules build (new training workers each epoch, persistent
# evaluation ones), signalled every 5 ms for 3 s by another process, as a scheduler signals every process of a job.
SIGNALLED = r"""
import os, signal, subprocess, sys, time
import torch
from torch.utils.data import TensorDataset
from datamodules.loaders import Loader, ResumableLoader, WorkerInit

got = []
for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, lambda signum, frame: got.append(signum))  # the run's handlers: note it, go on
data = TensorDataset(torch.arange(16))
train = ResumableLoader(data, batch_size=4, num_workers=2, worker_init_fn=WorkerInit())
evaluate = Loader(data, batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=WorkerInit())
sender = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\n"
                           "for i in range(600):\n"
                           "    os.killpg(int(sys.argv[1]), (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)[i % 3])\n"
                           "    time.sleep(0.005)", str(os.getpgid(0))], start_new_session=True)
epochs = 0
while sender.poll() is None:
    for loader in (train, evaluate):
        assert sum(len(b) for (b,) in loader) == 16
    epochs += 1
print("epochs", epochs, "signals", len(got))
"""


def test_workers_started_while_the_job_is_signalled_live_on(tmp_path):
    """SLURM signals every process of a job. A loader worker that got SIGTERM, SIGUSR1 or SIGUSR2 before its
    ``worker_init_fn`` had run died of it ("DataLoader worker ... is killed by signal", the run's exit code 1: once
    in CI, in the SLURM requeue test). Workers now start with those signals blocked (``Loader``); the main process
    gets every one of them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "signalled.py").write_text(SIGNALLED)
    run = subprocess.run([sys.executable, str(tmp_path / "signalled.py")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, start_new_session=True,  # the signals stay inside its session
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-3000:]
    epochs, signals = (int(w) for w in run.stdout.split()[1::2])
    assert epochs >= 3 and signals >= 30, run.stdout  # it ran on while signalled (same signals pending coalesce)
