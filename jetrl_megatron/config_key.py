"""A config key's facts besides its type and default, declared on the dataclass field that holds the key.

Why on the field: a key is declared once, where its type and default are (``rl/config/schema.py``,
``megatron/optimizer_settings.py``); the range check, the NeMo-RL key table (``rl/config/nemo_rl_keys.py``) and the
errors about the FP8 recipe read its facts from there, so no second table can drift from the schema.

A field's :class:`Key` holds: the range of its values (:class:`Range`), how this project reads NeMo-RL's key of that
name (a note, and the values it accepts: any other value is refused with the note), the
:class:`~jetrl_megatron.recipe.Fp8Recipe` field it sets, and the rules of keys inside a free mapping (``vllm_kwargs``).
Plain data, no imports from the layers above, so every layer can declare its keys.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

__all__ = ["IGNORED", "IMPLEMENTED", "REFUSED", "Key", "KeyRule", "Range", "above", "at_least", "field_keys",
           "key", "key_of", "within"]

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
_META = "jetrl_key"


@dataclass(frozen=True)
class KeyRule:
    """A NeMo-RL key's status here: ``pattern`` is dotted; "*" matches one segment, a trailing "**" any number (zero
    included). ``allowed``: the values accepted under ``status``; any other value is refused."""

    pattern: str
    status: str
    note: str
    allowed: tuple[Any, ...] | None = None

    def matches(self, key: str) -> bool:
        pat, parts = self.pattern.split("."), key.split(".")
        if pat[-1] == "**":
            pat = pat[:-1]
            parts = parts[: len(pat)] if len(parts) >= len(pat) else parts + [""]
        return len(pat) == len(parts) and all(fnmatchcase(k, p) for p, k in zip(pat, parts, strict=True))

    def accepts(self, value: Any) -> bool:
        return self.allowed is None or any(_same(value, a) for a in self.allowed)


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not confuse True with 1 (YAML booleans and integers are different answers)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(value, int | float) and isinstance(allowed, int | float):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take. ``hi`` infinite and ``hi_in`` false: any finite value above ``lo``.
    ``lo_when_set``: (another key, a lower ``lo``) that applies while that key is set (not null or empty)."""

    lo: float
    hi: float = math.inf
    lo_in: bool = True
    hi_in: bool = True
    lo_when_set: tuple[str, float] | None = None

    def describe(self, lo: float | None = None) -> str:
        lo = self.lo if lo is None else lo
        if self.hi == math.inf:
            return f"{'>=' if self.lo_in else '>'} {lo}" + ("" if self.hi_in else " and finite")
        return f"in {'[' if self.lo_in else '('}{lo}, {self.hi}{']' if self.hi_in else ')'}"

    def contains(self, value: float, lo: float | None = None) -> bool:
        lo = self.lo if lo is None else lo
        ok = math.isfinite(value) or (self.hi == math.inf and self.hi_in)
        return ok and (value >= lo if self.lo_in else value > lo) and (value <= self.hi if self.hi_in else
                                                                        value < self.hi)


def at_least(lo: float, *, finite: bool = False, lo_when_set: tuple[str, float] | None = None) -> Range:
    """``>= lo`` (``finite``: and not infinite, for float keys)."""
    return Range(lo, math.inf, True, not finite, lo_when_set)


def above(lo: float) -> Range:
    """``> lo`` and finite."""
    return Range(lo, math.inf, False, False)


def within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Range:
    """``[lo, hi]``, either end open on request."""
    return Range(lo, hi, not lo_open, not hi_open)


@dataclass(frozen=True)
class Key:
    """The facts of one key besides type and default (see the module docstring)."""

    bounds: Range | None = None
    note: str = ""  # what NeMo-RL's key means here (the key table's note); "" with no ``allowed``: no rule
    allowed: tuple[Any, ...] | None = None  # NeMo-RL values implemented; any other is refused with the note
    recipe: str | None = None  # the Fp8Recipe field this key sets (recipe errors name this key)
    below: tuple[KeyRule, ...] = ()  # keys inside a free mapping, patterns relative to this field

    def rules(self, path: str) -> tuple[KeyRule, ...]:
        """This key's NeMo-RL rules with absolute patterns (``path`` is the field's dotted key)."""
        own = (KeyRule(path, IMPLEMENTED, self.note, self.allowed),) if self.note or self.allowed is not None else ()
        return own + tuple(dataclasses.replace(r, pattern=f"{path}.{r.pattern}") for r in self.below)


def key(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, bounds: Range | None = None,
        note: str = "", allowed: tuple[Any, ...] | None = None, recipe: str | None = None,
        below: tuple[KeyRule, ...] = ()) -> Any:
    """A dataclass field with its :class:`Key` (``factory``: a default factory, for mutable defaults)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={_META: Key(bounds, note, allowed, recipe, below)})


def key_of(f: dataclasses.Field) -> Key:
    return f.metadata.get(_META) or Key()


def section_of(tp: Any) -> Any:
    """The dataclass inside a declared type (``Cfg`` or ``Cfg | None``), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def field_keys(root: type, prefix: str = "") -> Iterator[tuple[str, Any, Key]]:
    """(dotted key, declared type, Key) of every field below the dataclass ``root``, sections before their
    fields, in declaration order."""
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        path = f"{prefix}.{f.name}" if prefix else f.name
        yield path, hints[f.name], key_of(f)
        section = section_of(hints[f.name])
        if section is not None:
            yield from field_keys(section, path)
