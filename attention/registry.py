"""Name -> mixer class, filled by ``@register`` in the variant modules."""

from __future__ import annotations

import inspect

from .errors import UserError

_REGISTRY: dict[str, type] = {}
COMPLEXITIES = ("linear", "quadratic")  # a mixer's ``complexity``: how its cost grows with N (attention/base.py)


def register(name: str):
    """Class decorator: make a mixer buildable as ``attention.build(name, ...)``.

    Duplicate names are a bug (two modules claiming one variant), so they raise, as does a ``complexity`` other
    than those of :data:`COMPLEXITIES` (the benchmark and the tests read it).
    """

    def deco(cls):
        if getattr(cls, "complexity", None) not in COMPLEXITIES:
            raise ValueError(f"attention variant {name!r} ({cls.__module__}) declares complexity="
                             f"{getattr(cls, 'complexity', None)!r}; expected one of {', '.join(COMPLEXITIES)}.")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise KeyError(f"attention variant {name!r} is registered twice "
                           f"({_REGISTRY[name].__module__} and {cls.__module__}).")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def names() -> list[str]:
    """Registered variant names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type:
    if name not in _REGISTRY:
        raise UserError(f"Unknown attention variant {name!r} (option `attn`). "
                        f"Available: {', '.join(names())}. Pick one with e.g. `attn=external`.")
    return _REGISTRY[name]


def options(name: str) -> dict[str, object]:
    """The options a variant accepts, with their defaults (dim excluded)."""
    sig = inspect.signature(get(name).__init__)
    return {p.name: p.default for p in list(sig.parameters.values())[1:]
            if p.name != "dim" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def build(name: str, dim: int, **opts):
    """Build the mixer ``name`` for ``dim`` channels; options as in ``configs/attn/<name>.yaml``.

    Unknown options and impossible values raise :class:`UserError` naming the option.
    """
    cls = get(name)
    accepted = options(name)
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise UserError(f"Attention variant {name!r} has no option {', '.join(f'attn.{u}' for u in unknown)}. "
                        f"Its options are: {', '.join(f'{k}={v!r}' for k, v in accepted.items())}.")
    return cls(dim, **opts)
