"""Triton kernels for the elementwise strategies on CUDA: one launch where the eager formula
takes six and ``torch.compile``'s call costs more than the six (at the paper's batch sizes a
strategy's call is bound by its launches, not by the GPU's work). Imported only for CUDA
tensors, and only where Triton is installed; the pure-PyTorch body in :mod:`pepo.weighting`
stays the reference the tests compare with and the path on CPUs.

``TRITON_INTERPRET=1`` in the environment before the first import runs these kernels on CPU
tensors (Triton's interpreter), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

try:  # optional: the core imports torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

__all__ = ["available", "entropy_bonus"]

_BLOCK = 1024


def available() -> bool:
    """Whether Triton imported (the kernels below can run)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _entropy_bonus_kernel(adv_ptr, ent_ptr, mask_ptr, out_ptr, T,  # noqa: N803
                              s_a, s_eb, s_et, s_mb, s_mt, alpha, inv_kappa,
                              BLOCK: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        # masked entropies are never read: their contents (NaN included) go no further
        h = tl.load(ent_ptr + row * s_eb + col * s_et, mask=valid, other=0.0).to(tl.float32)
        a = tl.load(adv_ptr + row * s_a).to(tl.float32)
        cap = tl.abs(a) * inv_kappa  # as CUDA's eager a / κ and inductor: a * fl32(1/κ)
        bonus = tl.minimum(alpha * h, cap, propagate_nan=tl.PropagateNan.ALL)
        bonus = tl.where(tl.abs(h) == float("inf"), float("nan"), bonus)  # the cap hides no inf
        tl.store(out_ptr + row * T + col, tl.where(valid, a + bonus, 0.0), mask=inside)


def entropy_bonus(adv: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, alpha: float,
                  inv_kappa: float) -> torch.Tensor:
    """``A_i + min(α H_{i,t}, |A_i| · inv_kappa)`` at valid tokens, 0 elsewhere, ``[B, T]``
    fp32, in one launch, on the tensors' device; an inf entropy gives NaN, as in
    :func:`pepo.weighting.entropy_bonus` (whose ``inv_kappa`` is ``1/κ`` rounded to fp32).
    ``adv`` is ``[B]`` fp32; ``ent`` ``[B, T]`` of any float dtype and any strides; ``mask``
    ``[B, T]`` bool."""
    b, t = ent.shape
    out = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    if b and t:
        grid = (b, triton.cdiv(t, _BLOCK))
        args = (adv, ent, mask, out, t, adv.stride(0), ent.stride(0), ent.stride(1),
                mask.stride(0), mask.stride(1), float(alpha), float(inv_kappa))
        if ent.is_cuda and ent.device.index != torch.cuda.current_device():
            with torch.cuda.device(ent.device):  # Triton launches on the current device
                _entropy_bonus_kernel[grid](*args, BLOCK=_BLOCK)
        else:
            _entropy_bonus_kernel[grid](*args, BLOCK=_BLOCK)
    return out
