"""``trainer.tf32``: the arithmetic of float32 matrix products and convolutions on GPUs with TF32 (Ampere and later).

torch's defaults treat the two differently: cuDNN convolutions may use TF32 (inputs rounded to 10 mantissa bits,
float32 accumulation), matrix products (``nn.Linear``, ``matmul``, ``bmm``, SDPA's math path) may not. A network
built of 1x1 convolutions (PCT_Pytorch's, the authors' channel-first form) therefore runs in TF32 where the same
network built of ``nn.Linear`` (the suite's token-major form) runs in IEEE float32: two "float32" runs doing
different arithmetic at different speeds. This option makes the two agree:

- ``null`` (the default): torch's defaults, untouched (convolutions TF32, matrix products IEEE float32);
- ``true``: both in TF32 (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cudnn.allow_tf32``);
  Lightning's hint about Tensor Cores asks for this;
- ``false``: both in IEEE float32 (``"highest"``, cuDNN's TF32 off): the arithmetic of a CPU run.

It changes nothing on a CPU, nor what runs in bf16 or fp16 under autocast. The legacy switches are used, not torch's
newer ``fp32_precision`` properties: Lightning reads ``torch.get_float32_matmul_precision()``, which raises once
those properties have been set for one backend and not for all (torch 2.11 to 2.14).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Lightning's hint, logged once a process at the first float32 run on an Ampere or later GPU while matrix products
# are IEEE float32 (lightning.fabric.accelerators.cuda._check_cuda_matmul_precision, through rank_zero_info).
LIGHTNING_HINT = "that has Tensor Cores. To properly utilize them"
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def take_option(trainer_kwargs: dict) -> bool | None:
    """``trainer.tf32`` taken out of the trainer's keyword arguments (it is the suite's, not Lightning's; its type is
    checked at start-up with the other trainer options, ``suite.schema.ArithmeticOptions``)."""
    return trainer_kwargs.pop("tf32", None)


def state() -> tuple[str, bool]:
    """(float32 matmul precision, cuDNN TF32) as torch has them now."""
    return torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)


def apply(tf32: bool | None) -> None:
    """Set both switches as ``tf32`` says (``None``: leave them)."""
    if tf32 is None:
        return
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32


def restore(before: tuple[str, bool]) -> None:
    """Both switches as :func:`state` returned them."""
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@contextmanager
def arithmetic(tf32: bool | None) -> Iterator[None]:
    """``apply(tf32)`` for the block, then the switches as they were: benchmarks alternate the forms step by step,
    and each run of a process (a local multirun's jobs) restores them as it ends (``suite.train.run``), or a
    ``trainer.tf32=null`` job after a ``true`` one would run in TF32, not under torch's defaults."""
    before = state()
    apply(tf32)
    try:
        yield
    finally:
        restore(before)


class TensorCoreHint(logging.Filter):
    """Lightning's hint to call ``torch.set_float32_matmul_precision`` in one's own code, as this suite's option:
    with ``trainer.tf32`` unset (torch's defaults) it names ``trainer.tf32=true`` instead; with ``trainer.tf32=false``
    the user chose IEEE float32 and the hint is dropped. Other records pass unchanged."""

    def __init__(self, tf32: bool | None):
        super().__init__()
        self.tf32 = tf32

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if LIGHTNING_HINT not in message:
            return True
        if self.tf32 is False:
            return False
        device = message.split("(", 1)[1].split(")", 1)[0] if "(" in message else "this GPU"
        record.msg = (f"{device} has Tensor Cores, and float32 matrix products (nn.Linear, matmul, attention) run "
                      "in IEEE float32, torch's default, while cuDNN convolutions run in TF32: trainer.tf32=true runs "
                      "both in TF32 (faster, inputs rounded to 10 mantissa bits), trainer.tf32=false both in IEEE "
                      "float32 (docs/scale.md#precision).")
        record.args = ()
        return True


def install_hint_filter(tf32: bool | None) -> None:
    """:class:`TensorCoreHint` on Lightning's rank-zero loggers, replacing one a previous run of the process put
    there (a multirun's jobs share the process)."""
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, TensorCoreHint)]:
            logger.removeFilter(old)
        logger.addFilter(TensorCoreHint(tf32))


def describe(tf32: bool | None) -> str:
    """What ``tf32`` means, for tables and logs."""
    return {None: "torch's defaults (convolutions TF32, matrix products IEEE float32)", True: "TF32",
            False: "IEEE float32"}[tf32]
