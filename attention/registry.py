"""Name -> mixer class, filled by ``@register`` in the variant modules."""

from __future__ import annotations

import inspect

from .errors import UserError

COMPLEXITIES = ("linear", "quadratic")  # a mixer's ``complexity``: how its cost grows with N (attention/base.py)


class Registry:
    """Name -> class, filled by a class decorator; one kind of thing per registry (mixers here, backbones in
    ``tasks/nets/backbones/registry.py``). ``what`` names the kind in messages, ``option`` the config option
    that picks one and ``example`` a command that does."""

    def __init__(self, what: str, option: str, example: str):
        self.what, self.option, self.example = what, option, example
        self.classes: dict[str, type] = {}

    def add(self, name: str, cls: type) -> None:
        """Register ``cls`` as ``name``; two modules claiming one name are a bug, so it raises."""
        if name in self.classes and self.classes[name] is not cls:
            raise KeyError(f"{self.what} {name!r} is registered twice "
                           f"({self.classes[name].__module__} and {cls.__module__}).")
        self.classes[name] = cls

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self.classes)

    def get(self, name: str) -> type:
        if name not in self.classes:
            raise UserError(f"Unknown {self.what} {name!r} ({self.option}). "
                            f"Available: {', '.join(self.names())}. Pick one with e.g. `{self.example}`.")
        return self.classes[name]


MIXERS = Registry("attention variant", "option `attn`", "attn=external")


def register(name: str):
    """Class decorator: make a mixer buildable as ``attention.build(name, ...)``.

    Duplicate names are a bug (two modules claiming one variant), so they raise, as does a ``complexity`` other
    than those of :data:`COMPLEXITIES` (the benchmark and the tests read it).
    """

    def deco(cls):
        if getattr(cls, "complexity", None) not in COMPLEXITIES:
            raise ValueError(f"attention variant {name!r} ({cls.__module__}) declares complexity="
                             f"{getattr(cls, 'complexity', None)!r}; expected one of {', '.join(COMPLEXITIES)}.")
        MIXERS.add(name, cls)
        cls.name = name
        return cls

    return deco


def names() -> list[str]:
    """Registered variant names, sorted."""
    return MIXERS.names()


def get(name: str) -> type:
    return MIXERS.get(name)


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
