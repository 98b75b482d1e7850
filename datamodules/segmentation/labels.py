"""Mask values: the ignored index, raw value -> class tables, and the VOC colour map."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attention.errors import UserError

IGNORE_INDEX = 255  # mask value of pixels that no loss or metric counts (boundaries, unlabelled, padding)


class LabelMap:
    """Raw mask value -> class index (0..K-1) or 255 through a 256-entry table.

    ``table[v] == -1`` marks a raw value that must not occur (a bad label);
    ``expected`` says in words which raw values are valid, for error messages."""

    def __init__(self, mapping: dict[int, int], expected: str, default: int = -1):
        self.table = np.full(256, default, np.int16)
        for raw, index in mapping.items():
            self.table[raw] = index
        self.expected = expected

    def __call__(self, raw: np.ndarray, path: Path, fix: str) -> np.ndarray:
        """Map uint8 ``raw`` (H, W); UserError naming ``path`` if it holds a bad value."""
        present = np.bincount(raw.ravel(), minlength=256) > 0  # cheaper than np.unique
        bad = np.flatnonzero(present & (self.table < 0))
        if bad.size:
            values = ", ".join(str(v) for v in bad[:10]) + (", ..." if bad.size > 10 else "")
            raise UserError(f"{path} has label value(s) {values}; expected {self.expected}. {fix}")
        return self.table[raw].astype(np.uint8)


def bit_colormap(n: int) -> np.ndarray:
    """The PASCAL VOC colour map (bits of the index spread over R, G, B), uint8 (n, 3)."""
    cmap = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, rgb = i, [0, 0, 0]
        for bit in range(7, -1, -1):
            for channel in range(3):
                rgb[channel] |= ((c >> channel) & 1) << bit
            c >>= 3
        cmap[i] = rgb
    return cmap
