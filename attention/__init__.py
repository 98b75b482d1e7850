"""One contract, every attention variant.

    import attention
    attention.names()                                  # ['external', 'linear_elu', ...]
    mixer = attention.build("external", dim=256, heads=4, memory=64)
    y = mixer(x, attention.Grid(h, w))                 # x: (B, N, C) -> y: (B, N, C)
    y = mixer(x, attention.Points(xyz))                # xyz: (B, N, 3)

Every module in ``attention/variants`` is imported here and registers itself.
"""

import importlib
import pkgutil

from . import flops, functional, variants  # flops: SDPA kernels' FLOP formulas where torch lacks them
from .base import Mixer
from .errors import UserError
from .layout import Grid, Points
from .registry import build, get, names, options, register

for _mod in pkgutil.iter_modules(variants.__path__):
    importlib.import_module(f"{variants.__name__}.{_mod.name}")

__all__ = ["Grid", "Mixer", "Points", "UserError", "build", "functional", "get", "names", "options", "register"]
