"""The matmuls' precision: ``compute_dtype`` (``auto``, ``fp32``, ``bf16``).

``bf16`` runs every forward of the run (rollouts, validation, the old-policy pass, the update)
under ``torch.autocast`` to bfloat16 over the parameters of ``dtype`` (fp32 master weights with
``dtype: fp32``; the optimizer and the gradients stay in that dtype). The output head makes fp32
logits all the same (:func:`no_autocast`), and log-probs, entropies, sampling and the loss are
fp32. On a CPU attention runs in fp32 too, in the decoder and the trainer alike
(:func:`cpu_attention_in_fp32`). ``auto`` is bf16 on a CPU with native bf16 matrix units (x86
AMX, AVX512-BF16; Arm's BF16 extension) and fp32 anywhere else: bf16 on a CPU without them is
emulated and slower than fp32. GPU configs train with ``dtype: bf16`` parameters instead.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch

__all__ = ["CHOICES", "autocast", "cpu_attention_in_fp32", "cpu_bf16_units", "cpu_model",
           "cpu_warnings", "describe", "fp32_head", "no_autocast", "resolve_compute_dtype",
           "units_in_cpuinfo"]

CHOICES = ("auto", "fp32", "bf16")
_X86_UNITS = ("amx_bf16", "avx512_bf16")


@lru_cache(maxsize=1)
def cpu_bf16_units() -> tuple[str, ...]:
    """The bf16 matrix features of this CPU, as the OS names them (``("amx_bf16",
    "avx512_bf16")`` on a Sapphire Rapids Xeon, ``("avx512_bf16",)`` on a Zen 4 EPYC, ``()``
    without any), from ``/proc/cpuinfo`` on Linux and ``sysctl`` on macOS."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        return units_in_cpuinfo(info.read_text(encoding="utf-8", errors="replace"))
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ()
        return ("bf16",) if out == "1" else ()
    return ()


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``'s ``model name``, else the platform's), so that
    a result can say which kind of machine gave it."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def units_in_cpuinfo(text: str) -> tuple[str, ...]:
    """The bf16 matrix features named on the ``flags`` (x86) or ``Features`` (Arm) lines of a
    ``/proc/cpuinfo`` text."""
    words: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return tuple(f for f in (*_X86_UNITS, "bf16") if f in words)


def resolve_compute_dtype(setting: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of ``compute_dtype`` on ``device``: ``torch.bfloat16``, or None for
    no autocast (the parameters' own dtype). ``auto`` is bf16 on a CPU with
    :func:`cpu_bf16_units`, None elsewhere."""
    if setting not in CHOICES:
        raise ValueError(f"compute_dtype must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "auto":
        return torch.bfloat16 if device.type == "cpu" and cpu_bf16_units() else None
    return torch.bfloat16 if setting == "bf16" else None


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> ContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def fp32_head(model: torch.nn.Module) -> Any:
    """While in the block, ``model``'s forward makes its logits outside autocast
    (:func:`no_autocast`): its ``unembed`` (torchtune's ``TransformerDecoder`` calls it on the
    last hidden state) is shadowed by one that runs the class's own with autocast off. A model
    without ``unembed`` is left as it is."""
    unembed = getattr(type(model), "unembed", None)
    if unembed is None:
        yield
        return

    def head(h: torch.Tensor) -> Any:
        with no_autocast(h.device):
            return unembed(model, h)

    model.unembed = head  # an instance attribute: shadows the class's method
    try:
        yield
    finally:
        del model.unembed


def no_autocast(device: torch.device) -> ContextManager:
    """Autocast off on ``device``'s type, for the output head: its logits are made in the
    parameters' dtype also under ``compute_dtype: bf16``, by the decoder and the trainer alike.
    bf16 logits are rounded to 1/16 to 1/8 at the magnitudes of a language model's top logits,
    errors the sampled tokens' log-probs would carry (a mean rollout/trainer log-prob gap of
    0.030 nats in a 16-prompt SmolLM2 probe, against 0.017 with the head in fp32)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def describe(setting: str, dtype: Optional[torch.dtype], device: torch.device) -> str:
    """One line for the run's log: what ``compute_dtype`` chose and why."""
    units = cpu_bf16_units() if device.type == "cpu" else ()
    why = (f"this CPU has {', '.join(units)}" if units else "this CPU has no bf16 matrix units"
           ) if device.type == "cpu" and setting == "auto" else f"compute_dtype={setting}"
    what = "bf16 (autocast)" if dtype is not None else "the parameters' dtype"
    return f"matmuls in {what}: {why}"


def cpu_warnings(compute_dtype: Optional[torch.dtype], dtype: Optional[str],
                 device: torch.device) -> list[str]:
    """What a CPU run's precision settings cost that nothing else would say: bf16 products
    forced on a CPU that emulates them, and bf16 parameters (``dtype``; None where nothing is
    trained) trained on a CPU."""
    if device.type != "cpu":
        return []
    out = []
    if compute_dtype is not None and not cpu_bf16_units():
        out.append("compute_dtype=bf16 on a CPU without bf16 matrix units (AMX, AVX512-BF16): "
                   "bf16 is emulated there, several times slower than fp32 (compute_dtype=auto "
                   "chooses fp32 on this CPU)")
    if dtype == "bf16":
        out.append("dtype=bf16 on a CPU: the parameters and the optimizer's state are bf16, "
                   "which rounds away an update smaller than about 1/512 of its weight (the GPU "
                   "configs pair it with a stochastic-rounding AdamW); dtype=fp32 with "
                   "compute_dtype=bf16 keeps fp32 master weights")
    return out


class _Fp32OnCpu:
    """A torchtune attention call (``MultiHeadAttention._attention_call``) that runs bf16 or
    fp16 queries, keys and values on a CPU in fp32 and returns the output in their dtype;
    anything else goes to the original call unchanged. (CPU autocast leaves attention's inputs
    as they come today; the call runs outside it so that it stays fp32 should that change.)"""

    def __init__(self, call: Callable[..., torch.Tensor]) -> None:
        self.call = call

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
            return self.call(q, k, v, *args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            out = self.call(q.float(), k.float(), v.float(), *args, **kwargs)
        return out.to(q.dtype)


def cpu_attention_in_fp32(model: torch.nn.Module) -> int:
    """Makes every torchtune attention of ``model`` run bf16 (and fp16) inputs on a CPU in fp32:
    PyTorch's CPU flash attention is slower in bf16 than in fp32 once its backward counts (at
    SmolLM2's shapes in the recipe's update, ``[8, 9, 88, 64]``, 11.5 against 6.0 ms for the
    forward and backward, the casts included), and it is a small part of the work, so the
    training forward under ``compute_dtype: bf16`` keeps its attention exact to fp32, as the
    in-process decoder's (:mod:`pepo.training.fast_decoder`) on a CPU. Inputs
    on other devices, and fp32 inputs, are left as they are. Returns how many attention modules
    it changed (those already changed are not wrapped again)."""
    changed = 0
    for module in model.modules():
        call = getattr(module, "_attention_call", None)
        if callable(call) and not isinstance(call, _Fp32OnCpu):
            module._attention_call = _Fp32OnCpu(call)
            changed += 1
    return changed
