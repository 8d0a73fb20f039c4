"""The :class:`Strategy` wrapper behind :func:`pepo.weighting.get_strategy` (public there): input
checks, cleaned entropies, masked output, the one validating host sync, and ``torch.compile`` of
the built-in strategies on CUDA."""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Callable, Optional

import torch

from pepo import _checks
from pepo import _windows as _w

__all__ = ["Strategy", "StrategyFn", "compile_enabled", "declares", "set_compile",
           "validate_flag"]

_COMPILE = {"on": os.environ.get("PEPO_COMPILE", "1") != "0"}
# PEPO_TRITON=0: the strategies that have a Triton kernel run torch.compile-d instead
_TRITON = {"on": os.environ.get("PEPO_TRITON", "1") != "0"}
# PEPO_COMPILE_CPP=1: inductor's C++ wrapper launches a compiled strategy's kernels without
# Python. On one H200 it halved the launch-bound calls (gtpo 380-457 -> 198-202 us), but its
# first call took 72 s against 18 (proximal_softmax, empty cache): at one call a step it never
# pays back within a run, so it is off unless asked for (benchmarks/bench_weighting_variants.py
# --overhead, --first-call)
_COMPILE_OPTIONS = {"cpp_wrapper": os.environ.get("PEPO_COMPILE_CPP", "0") == "1"}
# an out-of-memory error drops no way of running a strategy (torch 1.13 names it too)
_OUT_OF_MEMORY = getattr(torch.cuda, "OutOfMemoryError", ())


def set_compile(enabled: bool) -> None:
    """Whether the built-in strategies run ``torch.compile``-d on CUDA tensors: a few fused
    kernels instead of dozens, after a first call that compiles for tens of seconds
    (every built-in strategy but ``uniform``, a single ``where``, runs Triton kernels instead,
    where Triton is installed: one to four launches, no compiling; ``PEPO_TRITON=0`` compiles
    them too). On by default; ``PEPO_COMPILE=0`` in the
    environment turns it off at import. CPU tensors never compile."""
    _COMPILE["on"] = bool(enabled)


def compile_enabled() -> bool:
    """Whether the built-in strategies run through ``torch.compile`` on a GPU (see
    :func:`set_compile`)."""
    return _COMPILE["on"]


StrategyFn = Callable[..., torch.Tensor]
"""What a registered factory returns: ``fn(advantages, entropies, mask[, positive][, groups])
-> weighted advantages``. ``positive`` and ``groups`` may be left out of the signature by
strategies that do not use them; :class:`Strategy` passes each only when declared, by name or
through ``**kwargs``."""


def validate_flag(validate: bool, check_finite: Optional[bool]) -> bool:
    """``validate``, or the deprecated ``check_finite`` when given (with a FutureWarning)."""
    if check_finite is None:  # a bool: None or "false" would pass a truth test as a setting
        return _checks.check_flag("validate", validate)
    warnings.warn("check_finite= is deprecated: use validate= (the same switch)", FutureWarning,
                  stacklevel=3)
    return _checks.check_flag("check_finite", check_finite)


def declares(fn: Callable[..., Any], name: str) -> tuple[bool, bool]:
    """Whether ``fn`` takes a keyword ``name`` (by that name, or through ``**kwargs``), and
    whether it requires it (a parameter of that name with no default)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False, False
    named = [p for p in params if p.name == name and p.kind is not p.VAR_POSITIONAL]
    takes = bool(named) or any(p.kind is p.VAR_KEYWORD for p in params)
    return takes, any(p.default is p.empty for p in named)


def _same_layout(adv: Any, ent: Any, mask: Any) -> bool:
    """The shapes, dtypes and devices :func:`_checks.check_batch` asks for, in one expression
    (the unvalidated call's check; the full check runs only to word the error)."""
    return (isinstance(ent, torch.Tensor) and isinstance(adv, torch.Tensor)
            and isinstance(mask, torch.Tensor) and ent.dim() == 2
            and adv.shape == ent.shape[:1] and mask.shape == ent.shape
            and mask.dtype == torch.bool and ent.is_floating_point()
            and adv.is_floating_point() and adv.device == ent.device == mask.device)


class Strategy:
    """A weighting strategy bound to its hyper-parameters; call it on a batch.

    ``strategy(advantages, entropies, mask, positive=None)`` checks its inputs (shapes, bool
    mask; with ``validate``, finite values at valid positions), runs the strategy in fp32
    without autograd, and returns ``[B, T]`` fp32 token advantages, detached, 0 where ``mask``
    is False.
    """

    def __init__(self, name: str, params: dict[str, Any], fn: StrategyFn,
                 builtin: bool = False):
        self.name = name
        self.params = dict(params)
        self._fn = fn
        self._pass_positive = declares(fn, "positive")[0]
        # a fn that names ``groups`` without a default needs them; one that takes them through
        # ``**kwargs`` (or ``groups=None``) gets them when the caller has them, else None
        self._pass_groups, self._needs_groups = declares(fn, "groups")
        try:  # only a fn that names it (not one taking **kwargs) gets the process group
            group = inspect.signature(fn).parameters.get("process_group")
        except (TypeError, ValueError):
            group = None
        self._pass_process_group = group is not None
        # the group bound when the strategy was built (global_topk(process_group=...)), if any
        self._bound_group = None if group is None or group.default is group.empty else group.default
        self._builtin = builtin
        # built-in fns may say they ignore the entropies (no cleaning) and that their output is
        # already fp32 and 0 where masked (no final where): one kernel for ``uniform``
        self._reads_entropies = getattr(fn, "reads_entropies", True) or not builtin
        self._masked = builtin and getattr(fn, "masked_output", False)
        self._compile_ok = builtin and getattr(fn, "compile", True)
        self._compiled: Optional[Callable[..., torch.Tensor]] = None
        # a built-in fn may bring a Triton kernel for CUDA (``fn.triton``, same arguments): one
        # launch instead of torch.compile's call, used where Triton is installed
        self._triton = getattr(fn, "triton", None) if builtin else None

    def __call__(
        self,
        advantages: torch.Tensor,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        *,
        positive: Optional[torch.Tensor] = None,
        groups: Optional[torch.Tensor] = None,
        validate: bool = True,
        process_group: Optional[Any] = None,
        check_finite: Optional[bool] = None,
    ) -> torch.Tensor:
        """Token advantages for one batch.

        Args:
            advantages: sequence-level advantages ``A_i``.
            entropies: per-token entropies ``H_{i,t}`` (any float dtype; fp32 inside).
            mask: True at valid (generated) tokens.
            positive: the rollouts that count as successful (positive reward); strategies with
                ``apply_to="positive"`` weight only these. Default: ``advantages > 0``.
            groups: one integer id per rollout, equal for the rollouts of one prompt. Only
                strategies that compare rollouts within their group read it (``gtpo``, which
                refuses to run without it, as does any strategy whose ``fn`` has a ``groups``
                parameter without a default); the others do not use its values, so a loop may
                always pass it (its form is checked for every strategy: a ``[B]`` integer
                tensor on the rows' device).
            validate: raise ``ValueError`` if ``advantages`` or the valid entropies hold
                NaN/inf, a valid entropy is negative, or the weighted advantages overflow
                float32: all in one host sync, after the strategy ran. With False the call
                reads no tensor value on the host at all (the built-in strategies: a GPU never
                waits on it), nothing is checked, and a NaN/inf in an input a strategy reads
                reaches its output as NaN, never as a finite value (for ``global_topk``, whose
                threshold is over the batch, the whole output): a loss built on it is NaN.
                Shapes, dtypes and devices are checked either way (that reads no values).
            process_group: the data-parallel ranks sharing the batch, read (like ``groups``)
                only by strategies with batch-global statistics (``global_topk``'s threshold).
            check_finite: deprecated name of ``validate``.

        Shape:
            advantages: ``[B]``; entropies, mask: ``[B, T]``; positive: ``[B]`` bool; groups:
            ``[B]`` integer; returns ``[B, T]`` fp32.
        """
        if check_finite is not None or validate.__class__ is not bool:
            validate = validate_flag(validate, check_finite)
        if validate or not _same_layout(advantages, entropies, mask):
            advantages, entropies, mask = _checks.check_batch(advantages, entropies, mask)
        if positive is not None and (validate or not isinstance(positive, torch.Tensor)
                                     or positive.shape != advantages.shape
                                     or positive.dtype != torch.bool
                                     or positive.device != advantages.device):
            positive = _checks.check_row_flags("positive", positive, advantages)
        if groups is not None:  # reads no value: dtype, shape, device (a kernel would need them)
            groups = _checks.check_row_ids("groups", groups, advantages)
        elif groups is None and self._needs_groups:
            raise ValueError(
                f"strategy {self.name!r} compares the rollouts of each prompt's group: pass "
                f"groups= (a [B] integer tensor, equal ids for the rollouts of one prompt)"
            )
        # detach only what autograd tracks (a detach is an op of its own: a launch-bound call
        # pays for each)
        adv = advantages.detach() if advantages.requires_grad else advantages
        adv = adv if adv.dtype == torch.float32 else adv.float()
        ent = entropies.detach() if entropies.requires_grad else entropies
        kwargs: dict[str, Any] = {}
        if self._pass_positive:
            kwargs["positive"] = adv > 0 if positive is None else positive
        if self._pass_groups:
            kwargs["groups"] = groups
        if self._pass_process_group and process_group is not None:
            kwargs["process_group"] = process_group
        if self._builtin:  # no autograd on detached inputs: skip the context's cost
            out = self._run(adv, ent, mask, kwargs)
        else:
            with torch.no_grad():
                out = self._run(adv, ent, mask, kwargs)
        if validate:  # inputs and output in one host sync, after the strategy ran
            out = self._validated(out, adv, ent, mask, kwargs)
        return out

    def _validated(self, out: torch.Tensor, adv: torch.Tensor, ent: torch.Tensor,
                   mask: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """``out`` once the inputs are checked; redone exactly where it came out non-finite
        from finite inputs (rows too wide for the shifted exp, or an overflow, refused then).
        With a process group every rank raises, redoes, or neither: the redo's threshold takes
        collectives, which one rank alone would wait on."""
        group = kwargs.get("process_group", self._bound_group)
        error: Optional[ValueError] = None
        try:
            redo = not _checks.check_finite_clean(advantages=adv, entropies=_w.clean(ent, mask),
                                                  output=out)
        except ValueError as e:
            if group is None:
                raise
            error, redo = e, False
        if group is not None:
            import torch.distributed as dist

            flags = torch.tensor([error is not None, redo], dtype=torch.long, device=adv.device)
            dist.all_reduce(flags, group=group)
            refused, redo_anywhere = flags.tolist()
            if error is not None:
                raise error
            if refused:
                raise ValueError(f"strategy {self.name!r}: another rank's inputs were refused "
                                 f"(its error names them); the batch-wide result needs them all")
            redo = redo_anywhere > 0
        if redo:
            with torch.no_grad(), _w.exact_windows():
                out = self._run(adv, ent, mask, kwargs, eager=True)
            if not bool(torch.isfinite(out).all()):
                nan = 0 if self._builtin else int(torch.isnan(out).sum())
                raise ValueError(  # a registered fn's NaN is its own, not an overflow
                    f"strategy {self.name!r} returned {nan} NaN token advantages from "
                    f"finite inputs" if nan else _checks.overflow_message(self.name, out, adv))
        return out

    def _run(self, adv: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
             kwargs: dict[str, Any], eager: bool = False) -> torch.Tensor:
        """The strategy on cleaned entropies, 0 at masked positions; compiled on CUDA (the
        built-in strategies, while :func:`compile_enabled`)."""
        fn = self._body
        if not eager and entropies.is_cuda and "process_group" not in kwargs:
            fn = self._compiled_body()
        out = fn(adv, entropies, mask, **kwargs)
        if self._builtin:  # their shapes are tested; a registered fn's result is checked
            return out
        if not isinstance(out, torch.Tensor) or out.shape != mask.shape:
            got = (_checks.format_shape(out) if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ValueError(
                f"strategy {self.name!r} returned {got}, expected "
                f"{_checks.format_shape(mask)} (the shape of mask)"
            )
        return out

    def _body(self, adv: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
              **kwargs: Any) -> torch.Tensor:
        ent = _w.clean(entropies, mask) if self._reads_entropies else entropies
        if self._builtin:
            out = self._fn(adv, ent, mask, **kwargs)
        else:  # copies: a fn that edits its inputs in place (mask &= ...) changed the caller's
            out = self._fn(adv.clone(), ent, mask.clone(), **{
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        if self._masked or not isinstance(out, torch.Tensor) or out.shape != mask.shape:
            return out  # a wrong result is refused by _run, with the strategy's name
        return torch.where(mask, out.float(), 0.0)

    def _compiled_body(self) -> Callable[..., torch.Tensor]:
        """The built-in strategies' fast path on CUDA while :func:`compile_enabled`: the first
        that runs of the fn's Triton kernel, ``torch.compile`` of :meth:`_body` with inductor's
        C++ wrapper (only with ``PEPO_COMPILE_CPP=1``), and with its Python wrapper (a warning
        names each that failed, and the next is kept); the plain body otherwise, and for good
        once all failed."""
        if not (_COMPILE["on"] and self._compile_ok):
            return self._body
        if self._compiled is None:
            kernel = self._triton_body()
            ways = [("its Triton kernel", kernel)] if kernel is not None else []
            if _COMPILE_OPTIONS["cpp_wrapper"]:
                ways.append(("torch.compile with the C++ wrapper",
                             self._lazy_compile({"cpp_wrapper": True})))
            ways.append(("torch.compile", self._lazy_compile(None)))

            def guarded(*args: Any, **kwargs: Any) -> torch.Tensor:
                while ways:
                    label, fn = ways[0]
                    try:
                        return fn(*args, **kwargs)
                    except _OUT_OF_MEMORY:  # not the way's fault: the caller may retry smaller
                        raise
                    except Exception as err:  # no compiler, or it failed: the next way
                        ways.pop(0)
                        warnings.warn(f"strategy {self.name!r}: {label} failed "
                                      f"({type(err).__name__}: {str(err)[:200]}); it runs "
                                      f"{ways[0][0] if ways else 'uncompiled'} instead",
                                      RuntimeWarning, stacklevel=4)
                self._compile_ok = False
                return self._body(*args, **kwargs)

            self._compiled = guarded
        return self._compiled

    def _lazy_compile(self, options: Optional[dict[str, Any]]) -> Callable[..., torch.Tensor]:
        """``torch.compile`` of :meth:`_body`, made at its first call, so that a torch without
        it (1.13), or one that refuses this Python, fails inside the fallback chain."""
        made: list[Callable[..., torch.Tensor]] = []

        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            if not made:
                made.append(torch.compile(self._body, dynamic=True, options=options))
            return made[0](*args, **kwargs)

        return run

    def _triton_body(self) -> Optional[Callable[..., torch.Tensor]]:
        """The fn's Triton kernel, where it has one and Triton imports; else None."""
        if self._triton is None or not _TRITON["on"]:
            return None
        import pepo._triton as _triton

        return self._triton if _triton.available() else None

    @property
    def row_local(self) -> bool:
        """Whether each row's token advantages depend on that row alone (its advantage, flag
        and entropies): then the strategy gives the same result on any split of the batch into
        row groups. True for the built-in ``uniform``, ``proximal_softmax``, ``window_average``
        and ``entropy_bonus``; False for batch- or group-wide statistics (``global_topk``,
        ``gtpo``) and for registered strategies, unless their function sets ``row_local``."""
        return bool(getattr(self._fn, "row_local", False))

    @property
    def builtin(self) -> bool:
        """Whether this is one of pepo's own strategies (tested, so their results are trusted
        with ``validate=False``), not a registered one."""
        return self._builtin

    @property
    def reads_positive(self) -> bool:
        """Whether the strategy's function reads the success flags (``positive``)."""
        return self._pass_positive

    @property
    def reads_groups(self) -> bool:
        """Whether the strategy's function takes ``groups=`` (by name, with or without a default,
        or through ``**kwargs``): it may compare the rollouts of a group."""
        return self._pass_groups

    @property
    def needs_groups(self) -> bool:
        """Whether the strategy compares the rollouts of a group (it must get ``groups=``)."""
        return self._needs_groups

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Strategy({self.name!r}{', ' if params else ''}{params})"
