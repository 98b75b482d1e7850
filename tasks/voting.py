"""Voting: the point-cloud test-time augmentation of RS-CNN, PAConv and PointMLP (``eval.votes``).

The reference scripts (RS-CNN ``voting_evaluate_cls.py`` / ``voting_evaluate_partseg.py``, PAConv
``obj_cls/eval_voting.py`` / ``part_seg/eval_voting.py``, PointMLP ``voting.py``) run each test batch
``NUM_VOTE`` times: vote 0 on the cloud as it is, every later vote on the cloud scaled by a random factor per
shape and per axis drawn uniformly from ``[scale_low, scale_high]`` (``PointcloudScale``, xyz only: normals
are not scaled); they average the softmax over the votes (``pred += F.softmax(...)``, ``pred /= NUM_VOTE``)
and score the argmax of that average.

Here the same, with two documented differences: each shape's scales come from the run's ``seed`` and the shape
itself (its ``index`` in the batch, the row the data set read it from), so a seed gives one set of scales and one
number whatever the batch size, the number of processes or the device, where the references draw from numpy's global
stream in batch order and report the best of 300 repeats (``NUM_REPEAT``: that maximum over random draws is not
reported here); and each vote scales the original cloud (``eval.vote_cumulative=false``), where PAConv's, PointMLP's
and RS-CNN's part-segmentation scripts scale their batch in place, so that vote v sees the product of v factors
(``eval.vote_cumulative=true`` reproduces that).

Seed rule (the test of this module recomputes it): the shape of index ``i`` draws
``numpy.random.default_rng([seed, i]).random((votes - 1, 3))`` (float64) and its scales are
``low + (high - low) * u`` cast to the points' dtype (cumulative: then their running product over votes). The
indices are read on the host, one small copy per voted test batch (testing only; training steps never wait).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from attention.errors import UserError

WHERE = "configs/task/{task}.yaml (eval block)"


def check_voting(evaluation: Mapping, task: str) -> None:
    """``eval.votes`` an integer >= 1; ``eval.vote_scale`` two positive numbers, low <= high;
    ``eval.vote_cumulative`` true or false. Raises a UserError naming the option."""
    where = WHERE.format(task=task)
    votes = evaluation.get("votes", 1)
    if not isinstance(votes, int) or isinstance(votes, bool) or votes < 1:
        raise UserError(f"eval.votes={votes!r} is not valid: eval.votes must be an integer >= 1 (1 = one pass, no "
                        "test-time augmentation; the voting papers use 10). Fix it on the command line or in "
                        f"{where}, e.g. `python run.py task={task} eval.votes=10`.")
    scale = evaluation.get("vote_scale")
    numbers = (isinstance(scale, (list, tuple)) and len(scale) == 2
               and all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scale))
    if not numbers or not 0 < scale[0] <= scale[1]:
        raise UserError(f"eval.vote_scale={scale!r} is not valid: eval.vote_scale must be a list of 2 numbers [low, "
                        "high] with 0 < low <= high, the range of the random per-axis scale factors of votes 1 and "
                        f"later. Fix it on the command line or in {where}, e.g. `python run.py task={task} "
                        "eval.vote_scale=[0.8,1.18]`.")
    cumulative = evaluation.get("vote_cumulative", False)
    if not isinstance(cumulative, bool):
        raise UserError(f"eval.vote_cumulative={cumulative!r} is not valid: eval.vote_cumulative must be true (vote v "
                        "scales by the product of v factors, as PAConv's in-place scaling) or false (each vote scales "
                        f"the original cloud). Fix it on the command line or in {where}, e.g. `python run.py "
                        f"task={task} eval.vote_cumulative=false`.")


def shape_indices(batch: Mapping, task: str) -> list[int]:
    """Which shapes ``batch`` holds (its ``"index"``, every point data module's batches carry it): the key of each
    shape's scales. A UserError when a data module of one's own leaves it out."""
    if "index" not in batch:
        raise UserError(f"eval.votes > 1 needs each test sample's 'index' (which shape it is, the key of its random "
                        f"scales), and this data module's batches have only {sorted(batch)}. Return "
                        "'index': torch.tensor(i) from the dataset's __getitem__ as the suite's point data sets do "
                        f"(datamodules/points/base.py), or test with one pass: `python run.py task={task} "
                        "eval.votes=1`.")
    return [int(i) for i in batch["index"].tolist()]


def draw_scales(seed: int, indices: list[int], votes: int, scale: tuple[float, float], cumulative: bool,
                device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-axis scale factors (votes - 1, B, 3) of votes 1..votes-1 for the shapes ``indices`` (module docstring's
    rule: each shape's from ``(seed, its index)`` alone)."""
    low, high = float(scale[0]), float(scale[1])
    u = np.stack([np.random.default_rng([int(seed), i]).random((votes - 1, 3)) for i in indices], axis=1)  # (V-1, B, 3)
    factors = torch.from_numpy(low + (high - low) * u).to(device=device, dtype=dtype)
    if cumulative:
        factors = factors.cumprod(dim=0)  # vote v: the product of v factors, as in-place scaling gives
    return factors


def voted_probabilities(forward: Callable[[torch.Tensor], torch.Tensor], points: torch.Tensor,
                        scales: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean softmax over the votes, logits of vote 0). ``points`` (B, N, C) with xyz first; ``scales``
    (V-1, B, 3) from :func:`draw_scales`; ``forward`` maps points to logits with classes on ``dim``.
    One forward of the whole batch per vote; only xyz is scaled (normals and other features are not)."""
    logits = forward(points)
    total = logits.softmax(dim)
    for factors in scales:  # (B, 3)
        scaled = torch.cat([points[..., :3] * factors[:, None, :], points[..., 3:]], dim=-1)  # (B, N, C)
        total = total + forward(scaled).softmax(dim)
    return total / (len(scales) + 1), logits
