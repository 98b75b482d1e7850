"""No host synchronisation inside a training step, for every task (tests/task_steps.py says why it matters).

A CPU cannot show a synchronisation (nothing waits), so the ops that would make a GPU run wait are recorded by a
dispatch mode around each training step and backward pass of a real tiny run, taking the GPU's code paths where a
GPU runs other code (tests/task_steps.py). The same steps run under CUDA's own sync debug mode in
tests/gpu/test_cuda_tasks.py.
"""

from __future__ import annotations

import pytest
import torch

from task_steps import TASKS, SyncRecorder, train_watched

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_recorder_sees_each_kind_of_synchronisation():
    """The recorder itself: a value read, a boolean mask, a value-sized output, a Python bool, a tensor made from
    Python data (a copy from the host on a GPU), one inside a backward pass, and not plain math or integer indexing
    by a tensor already made."""
    x = torch.arange(6.0)
    cases = {"item": lambda: x.sum().item(), "bool": lambda: bool(x.any()), "mask": lambda: x[x > 2],
             "nonzero": lambda: x.nonzero(), "equal": lambda: torch.equal(x, x), "unique": lambda: torch.unique(x),
             "repeat": lambda: torch.arange(3).repeat_interleave(torch.arange(3)),
             "from python": lambda: torch.as_tensor(1.0, device=x.device)}
    for name, case in cases.items():
        recorder = SyncRecorder(everywhere=True)
        with recorder:
            case()
        assert recorder.seen, name
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            bool(grad.sum() > 0)
            return grad * 2

    loss = ReadsInBackward.apply(x.clone().requires_grad_()).sum()
    recorder = SyncRecorder(everywhere=True)
    with recorder:
        loss.backward()  # the backward pass is watched too
    assert recorder.seen
    index, repeats = torch.tensor([0, 2]), torch.ones(6, dtype=torch.long)
    recorder = SyncRecorder(everywhere=True)
    with recorder:
        y = (x * 2).softmax(0)[index].sum() * 0.5
        x.repeat_interleave(repeats, output_size=6)
    assert not recorder.seen and y.dim() == 0


@pytest.mark.parametrize("task", list(TASKS))
def test_training_step_does_not_synchronise(task):
    """Each task's training steps after a first one (forward, loss, metric updates, backward; GAN: its d_steps
    discriminator updates and the generator's): no op that would wait for the GPU."""
    recorder = SyncRecorder()
    assert train_watched(TASKS[task], recorder) == 3
    assert not recorder.seen, recorder.report()
