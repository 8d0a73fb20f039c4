"""pepo._triton's kernels against the paper's formulas (slow loops) and the pure-PyTorch
strategies they stand in for on CUDA.

They run on a GPU where Triton is installed, or on a CPU under Triton's interpreter
(``TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py`` in an environment with
Triton, as CI runs them); elsewhere conftest does not collect them. The interpreter computes
with NumPy, so two properties are checked on a GPU only: a min that drops NaN, and the
rounding of ``|A|/κ`` as CUDA rounds it (the bit-equality test with κ = 3).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

import pepo.weighting as pw  # noqa: E402
from pepo import _triton  # noqa: E402

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None,
                                reason="needs a GPU, or TRITON_INTERPRET=1 on a CPU")


def bonus_loop(adv, ent, mask, alpha, kappa):
    """Cheng et al. (2025), one token at a time: ``A_i + min(α H_{i,t}, |A_i| / κ)`` at valid
    tokens (fp32 entropies, float64 arithmetic), 0 at masked ones; a non-finite valid entropy
    gives NaN (pepo's rule: the cap must not hide it)."""
    b, t = ent.shape
    h32 = ent.float().cpu()
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        a = float(adv[i])
        for j in range(t):
            if not bool(mask[i, j]):
                continue
            h = float(h32[i, j])
            out[i, j] = (math.nan if not math.isfinite(h)
                         else a + min(alpha * h, abs(a) / kappa))
    return out


def batch(b, t, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(b, generator=g)
    adv[0] = 0.0  # no bonus at A = 0
    ent = (torch.rand(b, t, generator=g) * 4.0).to(dtype)
    mask = torch.rand(b, t, generator=g) > 0.25
    ent = torch.where(mask, ent, torch.tensor(math.nan, dtype=dtype))  # padding holds NaN
    return adv.to(DEVICE), ent.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 1030)])  # 1030: a tail past one block
def test_entropy_bonus_kernel_is_the_formula(dtype, shape):
    """Catches: alpha or kappa ignored (non-default values), a masked NaN read, the columns
    past the first block left unwritten, a dtype read as fp32 bits."""
    adv, ent, mask = batch(*shape, seed=shape[1], dtype=dtype)
    out = _triton.entropy_bonus(adv, ent, mask, alpha=0.7, inv_kappa=1 / 3.0)
    assert out.dtype == torch.float32 and out.shape == shape
    want = bonus_loop(adv.cpu(), ent, mask.cpu(), 0.7, 3.0)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-6, atol=1e-6)
    assert out[~mask].eq(0).all()


def test_entropy_bonus_kernel_non_finite_entropies():
    """A valid inf, -inf or NaN entropy gives NaN (the cap would give a finite value; so would a
    min that drops NaN, on a GPU), and so does an fp64 entropy beyond fp32's range (inf once
    read as fp32, as the body reads it); the same values at masked positions give 0."""
    adv = torch.tensor([1.0, -2.0], device=DEVICE)
    ent = torch.tensor([[math.inf, -math.inf, math.nan, 1e300, 0.5],
                        [math.inf, -math.inf, math.nan, 1e300, 0.5]], dtype=torch.float64,
                       device=DEVICE)
    mask = torch.tensor([[True] * 5, [False, False, False, False, True]], device=DEVICE)
    out = _triton.entropy_bonus(adv, ent, mask, alpha=0.4, inv_kappa=0.5).cpu()
    assert out[0, :4].isnan().all()
    assert out[1, :4].eq(0).all()
    torch.testing.assert_close(out[:, 4], torch.tensor([1.0 + 0.2, -2.0 + 0.2]))


def test_entropy_bonus_kernel_reads_strides():
    """Transposed entropies and mask, every other row, every other advantage: a kernel that
    assumed contiguous rows (of any of the three) would read the wrong tokens."""
    adv_all, ent_t, mask_all = batch(8, 40, seed=5)
    adv = adv_all[::2]  # stride 2
    ent = ent_t.t().contiguous().t()[::2]  # column-major storage, then every other row
    mask = mask_all.t().contiguous().t()[::2]
    assert not ent.is_contiguous() and adv.stride(0) == 2 and mask.stride(1) != 1
    out = _triton.entropy_bonus(adv, ent, mask, alpha=0.4, inv_kappa=0.5)
    want = bonus_loop(adv.cpu(), ent, mask.cpu(), 0.4, 2.0)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-6, atol=1e-6)


def test_entropy_bonus_kernel_equals_the_pytorch_body():
    """The kernel and the library's pure-PyTorch body (the path it replaces, and the reference
    of the other tests) agree bit for bit on a batch of the benchmarks' kind, on the same
    device. On a GPU with κ = 3, whose inverse is inexact: CUDA's eager division by a scalar
    multiplies by fl32(1/κ), so a kernel that divided would differ by an ulp in a third of the
    caps. A CPU divides exactly, so there κ = 2 (an exact inverse) keeps the two comparable."""
    adv, ent, mask = batch(16, 3000, seed=11, dtype=torch.bfloat16)
    s = pw.get_strategy("entropy_bonus", alpha=0.7, kappa=3.0 if DEVICE == "cuda" else 2.0)
    want = s._body(adv, ent, mask)  # the plain body, also on CUDA
    got = s._triton(adv, ent, mask)  # the strategy's kernel, with its own parameters
    assert torch.equal(got, want)


def test_entropy_bonus_kernel_empty():
    for shape in [(0, 5), (3, 0)]:
        adv = torch.zeros(shape[0], device=DEVICE)
        ent = torch.zeros(shape, device=DEVICE)
        out = _triton.entropy_bonus(adv, ent, ent > 0, 0.4, 0.5)
        assert out.shape == shape


@pytest.mark.skipif(DEVICE != "cuda", reason="the strategy routes CUDA tensors to the kernel")
def test_strategy_runs_the_kernel_on_cuda(monkeypatch):
    """On CUDA, entropy_bonus's call goes through the kernel (validated and not): a hook never
    made would leave the counter at 0; a validated call still raises on inf."""
    calls = []
    real = _triton.entropy_bonus

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_triton, "entropy_bonus", counted)
    adv, ent, mask = batch(4, 50, seed=2)
    s = pw.get_strategy("entropy_bonus")
    torch.testing.assert_close(s(adv, ent, mask, validate=False).cpu().double(),
                               bonus_loop(adv.cpu(), ent, mask.cpu(), 0.4, 2.0),
                               rtol=1e-6, atol=1e-6)
    s(adv, ent, mask)
    assert len(calls) == 2
    bad = ent.clone()
    bad[mask] = math.inf
    with pytest.raises(ValueError):
        s(adv, bad, mask)
