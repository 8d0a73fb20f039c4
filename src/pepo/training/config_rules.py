"""The rules a config key's value must follow (:mod:`pepo.training.schema` gives each key one):
type and range checks that raise one ``ValueError`` line naming the key and the value, and
:class:`Component`, which binds a ``_component_`` section's keys to its callable's signature
before anything is built (as torchtune's ``config.validate``)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import DictConfig, ListConfig

from pepo.training.key_aliases import ALIASES

__all__ = ["Betas", "Bool", "Component", "Device", "Int", "Number", "OneOf", "Raw", "StrictInt",
           "Text", "Texts", "bind_component", "bind_names", "resolve_component"]


@dataclass(frozen=True)
class Int:
    """An int ``>= low`` (``nullable``: or null)."""

    low: int
    nullable: bool = False

    def check(self, key: str, v: Any) -> Any:
        if v is None and self.nullable:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < self.low:
            null = " or null" if self.nullable else ""
            raise ValueError(f"{key} must be an int >= {self.low}{null}, got {v!r}")
        return v


@dataclass(frozen=True)
class Number:
    """A number ``> low`` (``closed``: ``>= low``) and ``<= high``; ``finite``: also finite;
    ``nullable``: or null."""

    low: float
    high: Optional[float] = None
    nullable: bool = False
    finite: bool = False
    closed: bool = False

    def check(self, key: str, v: Any) -> Any:
        if v is None and self.nullable:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
            (self.low <= v if self.closed else self.low < v)
            and (self.high is None or v <= self.high)
            and (not self.finite or v < math.inf)
        ):
            low = f"[{self.low}" if self.closed else f"({self.low}"
            bound = (f"in {low}, {self.high}]" if self.high is not None
                     else f"{'>=' if self.closed else '>'} {self.low}")
            what = "a finite number" if self.finite else "a number"
            raise ValueError(f"{key} must be {what} {bound}, got {v!r}")
        return float(v)


@dataclass(frozen=True)
class Bool:
    def check(self, key: str, v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError(f"{key} must be true or false, got {v!r}")
        return v


@dataclass(frozen=True)
class OneOf:
    """One of ``values``; ``shown`` is how the message lists them."""

    values: tuple
    shown: str

    def check(self, key: str, v: Any) -> Any:
        if v not in self.values:
            raise ValueError(f"{key} must be {self.shown}, got {v!r}")
        return v


@dataclass(frozen=True)
class Text:
    """A string (``what`` names it in the message), or null when ``nullable``."""

    what: str = "a string"
    nullable: bool = True
    note: str = ""

    def check(self, key: str, v: Any) -> Any:
        if v is None and self.nullable:
            return v
        if not isinstance(v, str) or not v:
            null = " or null" if self.nullable else ""
            raise ValueError(f"{key} must be {self.what}{null}{self.note}, got {v!r}")
        return v


@dataclass(frozen=True)
class StrictInt:
    """An int (``note`` says why it must be one), within ``bounds`` (inclusive) when given."""

    note: str = ""
    bounds: Optional[tuple[int, int]] = None

    def check(self, key: str, v: Any) -> Any:
        b = self.bounds
        if isinstance(v, bool) or not isinstance(v, int) or (b and not b[0] <= v <= b[1]):
            within = f" in [{b[0]}, {b[1]}]" if b else ""
            raise ValueError(f"{key} must be an int{within}{self.note}, got {v!r}")
        return v


@dataclass(frozen=True)
class Texts:
    """A list of non-empty strings, or null when ``nullable`` (one string is refused: iterated,
    it would be its characters)."""

    what: str = "strings"
    nullable: bool = True

    def check(self, key: str, v: Any) -> Any:
        if v is None and self.nullable:
            return v
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
            hint = f" ({key}=[{v}])" if isinstance(v, str) and v else ""
            raise ValueError(f"{key} must be a list of {self.what}{hint}, got {v!r}")
        return list(v)


@dataclass(frozen=True)
class Betas:
    """An optimizer's ``betas``: two numbers in ``[0, 1)`` (torch checks them only once the
    model is built, and a one-item list is an IndexError there)."""

    def check(self, key: str, v: Any) -> Any:
        if isinstance(v, ListConfig):
            v = list(v)
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                           and 0 <= b < 1 for b in v)):
            raise ValueError(f"{key} must be two numbers in [0, 1), got {v!r}")
        return v


@dataclass(frozen=True)
class Device:
    """``cpu``, ``cuda`` or ``cuda:N``."""

    def check(self, key: str, v: Any) -> Any:
        if not isinstance(v, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"{key} must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v


@dataclass(frozen=True)
class Raw:
    """Any value (a list, a mapping checked elsewhere); kept as the config holds it."""

    def check(self, key: str, v: Any) -> Any:
        return v


@dataclass(frozen=True)
class Component:
    """A ``_component_`` section (or null when ``nullable``). ``positional`` and ``given`` are
    the arguments the recipe passes itself when it builds the section (the optimizer gets the
    model's parameters), so that binding the section's keys to the callable's signature
    finds both unknown and missing arguments; a key of ``given`` in the section is refused
    (the recipe's value would replace it), ``given_note`` saying what the recipe passes.
    ``args`` gives rules to some arguments, ``roles`` their roles (the rest have the field's)."""

    nullable: bool = False
    positional: int = 0
    given: tuple[str, ...] = ()
    given_note: str = ""
    args: tuple[tuple[str, Any], ...] = ()
    roles: tuple[tuple[str, str], ...] = ()

    def check(self, key: str, v: Any) -> Any:
        # `key=null` on torchtune's command line sets the section's _component_ to null and
        # keeps its other keys: that is the section set to null too
        if v is None or (isinstance(v, DictConfig) and "_component_" in v
                         and v.get("_component_") is None):
            if self.nullable:
                return None
            raise ValueError(f"config key {key!r} is required")
        if not isinstance(v, DictConfig) or v.get("_component_") is None:
            raise ValueError(f"{key} must be a section with a _component_, got {v!r}")
        for name in self.given:
            if name in v:
                raise ValueError(f"{key}.{name}={v.get(name)!r} would be ignored: the recipe "
                                 f"passes {name}{self.given_note}; remove it")
        bind_component(key, v, self.positional, self.given)
        for arg, rule in self.args:
            value = v.get(arg)
            if value is not None:
                rule.check(f"{key}.{arg}", value)
        return v


def bind_component(key: str, node: DictConfig, positional: int = 0,
                   given: tuple[str, ...] = ()) -> Callable:
    """Imports ``node._component_`` and binds the section's keys (plus what the recipe passes,
    ``positional`` arguments and the keywords ``given``) to its signature, as torchtune's
    ``config.validate`` does; returns the callable.

    Raises:
        ValueError: ``optimizer: torch.optim.AdamW got an unexpected keyword argument 'lrr';
            did you mean 'optimizer.lr'?``, a missing argument, or a path that does not import.
    """
    path = str(node.get("_component_"))
    target = resolve_component(key, path)
    bind_names(key, path, target, [str(k) for k in node if k != "_component_"], positional,
               given)
    return target


def bind_names(key: str, path: str, target: Callable, names: Any, positional: int = 0,
               given: tuple[str, ...] = ()) -> None:
    """Binds keyword ``names`` (and ``positional`` arguments, keywords ``given``) to the
    signature of ``target`` (the component ``path`` of section ``key``); see
    :func:`bind_component`."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: its call checks
        return
    try:  # an unknown key first (bind_partial), then a missing one: `pth` is named, not `path`
        sig.bind_partial(*([None] * positional), **{k: None for k in (*given, *names)})
        sig.bind(*([None] * positional), **{k: None for k in (*given, *names)})
    except TypeError as e:
        hint = ""
        bad = re.search(r"unexpected keyword argument '([^']+)'", str(e))
        if bad:
            close = difflib.get_close_matches(bad.group(1), list(sig.parameters), n=1,
                                              cutoff=0.5)
            hint = f"; did you mean {key + '.' + close[0]!r}?" if close else ""
            if ALIASES.get(bad.group(1), "").startswith(key + "."):  # optimizer.learning_rate
                hint = f"; pepo calls it {ALIASES[bad.group(1)]}"
        elif key == "reward" and re.search(r"argument: '(responses|completions|prompts)'",
                                           str(e)):  # a reward function as TRL takes one
            hint = (" (reward._component_ is built with its keys, then called on (responses, "
                    "answers): name a class whose instances are, not a function)")
        raise ValueError(f"{key}: {path} {e}{hint}") from None


def resolve_component(key: str, path: str) -> Any:
    """The object a ``_component_`` path names, or one ``ValueError`` line saying why not."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as e:  # this prefix is no module: try a shorter one
            if not e.name or not module.startswith(e.name):
                raise ValueError(f"{key}: cannot import {path!r}: {e}") from None
        except Exception as e:  # the module exists but fails to import
            raise ValueError(f"{key}: cannot import {path!r}: {type(e).__name__}: {e}") from None
    else:
        raise ValueError(f"{key}: cannot import {path!r}: no module {parts[0]!r}")
    for j, attr in enumerate(parts[i:]):
        if not hasattr(obj, attr):
            close = difflib.get_close_matches(attr, [a for a in dir(obj) if not a.startswith("_")],
                                              n=1)
            raise ValueError(f"{key}: cannot import {path!r}: {'.'.join(parts[:i + j])} has no "
                             f"{attr!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        obj = getattr(obj, attr)
    return obj
