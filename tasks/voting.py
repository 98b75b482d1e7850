"""Voting: the point-cloud test-time augmentation of RS-CNN, PAConv and PointMLP (``eval.votes``).

The reference scripts (RS-CNN ``voting_evaluate_cls.py`` / ``voting_evaluate_partseg.py``, PAConv
``obj_cls/eval_voting.py`` / ``part_seg/eval_voting.py``, PointMLP ``voting.py``) run each test batch
``NUM_VOTE`` times: vote 0 on the cloud as it is, every later vote on the cloud scaled by a random factor per
shape and per axis drawn uniformly from ``[scale_low, scale_high]`` (``PointcloudScale``, xyz only: normals
are not scaled); they average the softmax over the votes (``pred += F.softmax(...)``, ``pred /= NUM_VOTE``)
and score the argmax of that average.

Here the same, with two documented differences: the scales come from a ``torch.Generator`` seeded with the
run's ``seed`` (plus the process rank), so a seed gives one set of scales and one number, where the references
draw from numpy's global stream and report the best of 300 repeats (``NUM_REPEAT``: that maximum over random
draws is not reported here); and each vote scales the original cloud (``eval.vote_cumulative=false``), where
PAConv's, PointMLP's and RS-CNN's part-segmentation scripts scale their batch in place, so that vote v sees the
product of v factors (``eval.vote_cumulative=true`` reproduces that).

Seed rule (the test of this module recomputes it): a test epoch makes ``torch.Generator(device)`` seeded with
``seed + global_rank``; each test batch of B shapes then draws ``torch.rand((votes - 1, B, 3), generator,
float32)`` on that device and scales = ``low + (high - low) * u`` cast to the points' dtype (cumulative: then
their running product over votes). So the scales depend on the seed, the batch size, the number of processes
and the device type (CUDA's generator draws other numbers than the CPU's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

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


def vote_generator(seed: int, rank: int, device: torch.device) -> torch.Generator:
    """The generator of a test epoch's scales: ``seed + rank`` on ``device``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) + int(rank))
    return generator


def draw_scales(generator: torch.Generator, votes: int, batch: int, scale: tuple[float, float],
                cumulative: bool, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-axis scale factors (votes - 1, B, 3) of votes 1..votes-1 for one batch (module docstring's rule)."""
    low, high = float(scale[0]), float(scale[1])
    u = torch.rand((votes - 1, batch, 3), generator=generator, device=device, dtype=torch.float32)
    factors = (low + (high - low) * u).to(dtype)  # (V-1, B, 3)
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
