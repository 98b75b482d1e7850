"""``mode=summary``: per-module parameters and FLOPs of a network for one sample."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def summarize(model: nn.Module, example: torch.Tensor | tuple, depth: int = 3) -> tuple[str, int, int]:
    """Table of trainable parameters and forward FLOPs per module down to ``depth``.

    FLOPs are ``torch.utils.flop_counter``'s (a multiply-add is 2 FLOPs) for
    ``example`` (a tensor or a tuple of positional inputs) in eval mode.
    Returns (table, total params, total FLOPs).
    """
    was_training = model.training
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*example) if isinstance(example, tuple) else model(example)
    model.train(was_training)
    by_module = counter.get_flop_counts()
    root = type(model).__name__

    def flops_of(name: str, module: nn.Module) -> int:
        # Containers whose forward never runs (ModuleList) are not tracked: sum their children.
        key = f"{root}.{name}" if name else root
        if key in by_module:
            return int(sum(by_module[key].values()))
        return sum(flops_of(f"{name}.{child}" if name else child, m) for child, m in module.named_children())

    rows = []
    for name, module in model.named_modules():
        level = 0 if not name else name.count(".") + 1
        if level > depth:
            continue
        params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        flops = flops_of(name, module)
        if name and not params and not flops:
            continue
        label = "  " * level + (name.rsplit(".", 1)[-1] if name else root)
        rows.append((label, type(module).__name__, params, flops))
    total_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_flops = int(counter.get_total_flops())
    w = max(len(r[0]) for r in rows)
    t = max(len(r[1]) for r in rows)
    lines = [f"{'module':<{w}}  {'type':<{t}}  {'params':>12}  {'FLOPs':>16}", "-" * (w + t + 34)]
    lines += [f"{a:<{w}}  {b:<{t}}  {p:>12,}  {f:>16,}" for a, b, p, f in rows]
    return "\n".join(lines), total_params, total_flops


def print_summaries(module) -> dict:
    """``mode=summary``: each network of the task (``module.summaries()``) as a table, then the totals; a task
    with several networks (the GAN's G and D) prints ``params_<name>=<int> flops_<name>=<int>`` after each, and
    the last line is always ``params=<int> flops=<int>``."""
    result = {"params": 0, "flops": 0}
    for name, net, example in module.summaries():
        table, params, flops = summarize(net, example)
        print(table)
        if name:
            print(f"params_{name}={params} flops_{name}={flops}\n")
            result.update({f"params_{name}": params, f"flops_{name}": flops})
        result["params"] += params
        result["flops"] += flops
    print(f"params={result['params']} flops={result['flops']}")
    return result
