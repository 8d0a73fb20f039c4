"""pepo._triton's kernels against the paper's formulas (slow loops, ``tests/reference.py``) and
the pure-PyTorch strategies they stand in for on CUDA.

They run on a GPU where Triton is installed, or on a CPU under Triton's interpreter
(``TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py`` in an environment with
Triton and NumPy below 2.4, as CI runs them: Triton 3.6's interpreter hands a kernel's loop
bound to ``range`` as a 1-element array, which NumPy 2.4 no longer converts); elsewhere
conftest does not collect them. The interpreter computes
with NumPy, so two properties are checked on a GPU only: a min that drops NaN, and the
rounding of ``|A|/κ`` as CUDA rounds it (the bit-equality test with κ = 3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import pepo.weighting as pw  # noqa: E402
from pepo import _triton  # noqa: E402
from pepo import _windows as _w  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests._triton_helpers import DEVICE, count_calls, pytestmark  # noqa: E402, F401
from tests.conftest import ragged_batch  # noqa: E402


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
    calls = count_calls(monkeypatch, "entropy_bonus")
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


# ------------------------------------------------------------------ windowed (PEPO, window_average)

# rows of length 0, 1, 2 (shorter than W // 2: repeated reflection), a few, either side of
# W // 2 + 1 for W = 5, 7 and 101 (where the window kernel's one-reflection path begins), and
# one past the compaction's 1,024-column block and the window kernel's 256-token tile
LENGTHS = [0, 1, 2, 3, 4, 9, 40, 50, 51, 1100]


def windowed_reference(name, adv, ent, mask, window, temperature, apply_to, positive):
    """Eq. 6 (or the window average) and Eq. 7, one row at a time (tests/reference.py)."""
    if name == "proximal_softmax":
        def row(v):
            return ref.proximal_entropy_row(v, window, temperature)
    else:
        def row(v):
            return ref.window_average_row(np.maximum(v, 0.0), window)
    return torch.from_numpy(ref.multiplicative(adv, ent.float().cpu(), mask.cpu(), row,
                                               apply_to, positive.cpu()))


def strategy_kernel(name, **params):
    s = pw.get_strategy(name, **params)
    assert s._triton is not None
    return s._triton


SMALL = [("proximal_softmax", dict(window=7, temperature=1.0, apply_to="positive")),
         ("window_average", dict(window=5, apply_to="positive"))]
WIDE = [("proximal_softmax", dict(window=101, temperature=0.5, apply_to="all")),
        ("window_average", dict(window=101, apply_to="all"))]


# The small chunks are the compaction's test, which the window's width does not reach: they run
# at the small windows only (at W = 101 the interpreter took 17 s a case for nothing new).
@pytest.mark.parametrize("name,params,holes,small_chunks", [
    pytest.param(name, params, holes, small,
                 id=f"{name}-W{params['window']}-{'holes' if holes else 'prefix'}"
                    + ("-small_chunks" if small else ""))
    for cases, chunks in [(SMALL, [(False, False), (True, False), (True, True)]),
                          (WIDE, [(False, False), (True, False)])]
    for name, params in cases for holes, small in chunks])
def test_windowed_kernel_is_the_formula(name, params, holes, small_chunks, monkeypatch):
    """Catches: the window or temperature ignored, the padding not a reflection at each row's
    own ends (or one reflection only, for rows shorter than W // 2), holes in the mask not
    compacted, the compaction's count not carried past its first block, a chunk's start not
    counting the valid tokens before it, the length stored by another chunk than the last,
    tiles past the first left unwritten, Eq. 7's sum taken over one tile, the flags ignored
    (apply_to). With small chunks (64 columns, blocks of 32) a row spans many of the
    compaction's programs. Every row is weighted but two (A = 0 on the empty row, A < 0 on the
    row of 9 under "positive"), so the rows either side of W // 2 + 1 are checked at every W."""
    if small_chunks:
        monkeypatch.setattr(_triton, "_BLOCK", 32)
        monkeypatch.setattr(_triton, "_CHUNK", 64)
    adv, ent, mask = ragged_batch(LENGTHS, 1130, holes=holes, seed=3, scale=3.0)
    adv = adv.abs() + 0.1
    adv[0], adv[5] = 0.0, -0.7  # rows left uniform under "positive"
    positive = adv > 0
    adv, ent, mask, positive = (x.to(DEVICE) for x in (adv, ent, mask, positive))
    got = strategy_kernel(name, **params)(adv, ent, mask, positive)
    want = windowed_reference(name, adv.cpu(), ent, mask, params["window"],
                              params.get("temperature"), params["apply_to"], positive)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_windowed_kernel_reads_any_float_dtype_and_strides(dtype):
    """Entropies of each float dtype, stored column-major, every other row; mask, advantages
    and flags strided too: a kernel that assumed contiguous fp32 rows would read other tokens.
    It must agree with the PyTorch body (the path it replaces) on the same inputs."""
    adv_all, ent_all, mask_all = ragged_batch([30, 5, 300, 12, 64, 1, 200, 33], 310, holes=True,
                                              seed=8, dtype=dtype)
    ent = ent_all.to(DEVICE).t().contiguous().t()[::2]
    mask = mask_all.to(DEVICE).t().contiguous().t()[::2]
    adv = adv_all.to(DEVICE)[::2]
    positive = torch.tensor([True, False] * 4, device=DEVICE)[::2].flip(0)
    assert not ent.is_contiguous() and mask.stride(1) != 1 and adv.stride(0) == 2
    for name in ("proximal_softmax", "window_average"):
        s = pw.get_strategy(name, window=11)
        got = s._triton(adv, ent, mask, positive)
        want = s._body(adv, ent, mask, positive=positive)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def test_windowed_kernel_non_finite_and_special_rows():
    """A valid NaN or inf entropy turns its weighted row NaN (never a finite value) and leaves
    an unweighted row's A; the same values masked change nothing. A window average of zeros is
    uniform; negative entropies count as 0 there; a softmax row wider than the shifted exp
    holds comes out NaN as the body gives it."""
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, 2.0], device=DEVICE)
    t = 6
    ent = torch.rand(5, t, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones(5, t, dtype=torch.bool, device=DEVICE)
    ent[0, 2] = math.nan
    ent[1, 4] = math.inf
    ent[2, 1] = math.inf  # A < 0: not weighted under "positive"
    ent[3] = 0.0
    ent[4, :3] = math.nan
    mask[4, :3] = False  # masked NaN
    positive = adv > 0
    for name in ("proximal_softmax", "window_average"):
        s = pw.get_strategy(name, window=3)
        out = s._triton(adv, ent, mask, positive).cpu()
        assert out[0].isnan().all() and out[1].isnan().all(), name
        torch.testing.assert_close(out[2], torch.full((t,), -1.0))
        torch.testing.assert_close(out[3], torch.ones(t))  # zeros: uniform either way
        assert out[4, :3].eq(0).all() and out[4, 3:].isfinite().all()
        torch.testing.assert_close(out[4].sum(), torch.tensor(2.0 * 3))
    neg = torch.tensor([[0.5, -0.3, 1.0]], device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    m3 = torch.ones(1, 3, dtype=torch.bool, device=DEVICE)
    s = pw.get_strategy("window_average", window=3, apply_to="all")
    torch.testing.assert_close(s._triton(one, neg, m3, None).cpu(),
                               s._body(one.cpu(), neg.cpu(), m3.cpu(), positive=one.cpu() > 0))
    wide = torch.tensor([[0.0, 30.0, 1.0]], device=DEVICE)  # a range of 30 > 80 τ at τ = 0.3
    s = pw.get_strategy("proximal_softmax", window=3, temperature=0.3, apply_to="all")
    assert s._triton(one, wide, m3, None).isnan().all()
    assert s._body(one.cpu(), wide.cpu(), m3.cpu(), positive=one.cpu() > 0).isnan().all()


def test_windowed_kernel_shifts_each_row_and_flags_wide_rows_alone():
    """Entropies near 96 nats (exp overflows fp32 unshifted) in a row without padding come out
    as the formula gives them; the next row, 85-86 nats beside its padding zeros, is wider
    than the shifted exp holds and comes out NaN, as the body gives it, without touching the
    first (a flag from row 0, or one for the batch, would); a valid -inf entropy makes its
    softmax row NaN and counts as 0 in the window average."""
    g = torch.Generator().manual_seed(3)
    ent = torch.stack([95 + torch.rand(40, generator=g), 85 + torch.rand(40, generator=g),
                       torch.rand(40, generator=g)]).to(DEVICE)
    mask = torch.ones(3, 40, dtype=torch.bool, device=DEVICE)
    mask[1, 30:] = False
    ent[2, 7] = -math.inf
    adv = torch.ones(3, device=DEVICE)
    s = pw.get_strategy("proximal_softmax", window=11, apply_to="all")
    out = s._triton(adv, ent, mask, None).cpu()
    want = windowed_reference("proximal_softmax", adv.cpu(), ent[:1], mask[:1], 11, 1.0, "all",
                              adv[:1].cpu() > 0)
    torch.testing.assert_close(out[:1].double(), want, rtol=2e-5, atol=1e-6)
    body = s._body(adv.cpu(), ent.cpu(), mask.cpu(), positive=adv.cpu() > 0)
    assert out[1][mask[1].cpu()].isnan().all() and body[1][mask[1].cpu()].isnan().all()
    assert out[2].isnan().all() and body[2].isnan().all()
    w = pw.get_strategy("window_average", window=11, apply_to="all")
    got = w._triton(adv[2:], ent[2:], mask[2:], None)
    torch.testing.assert_close(got.cpu(), w._body(adv[2:].cpu(), ent[2:].cpu(), mask[2:].cpu(),
                                                  positive=adv[2:].cpu() > 0))
    assert got[0, 7] == 0 and got.isfinite().all()


def test_windowed_kernel_row_of_many_chunks(monkeypatch):
    """Rows of 75 chunks (more than the 64 the shift reads at once): the formula holds, a NaN
    past the 64th chunk makes its row NaN, and so does a range that is wide only through
    values past the 64th chunk, its lowest (row 2) or its highest (row 3). A loop over the
    first 64 chunks only misses either: the row then comes out finite where the body gives
    NaN (row 2's low values as ratios of tiny exps, row 3's top as exps that still fit)."""
    monkeypatch.setattr(_triton, "_BLOCK", 4)  # one block a chunk (several: the formula test)
    monkeypatch.setattr(_triton, "_CHUNK", 4)
    g = torch.Generator().manual_seed(5)
    ent = torch.rand(4, 300, generator=g)
    ent[1, 297] = math.nan
    ent[2, :280] += 30.0  # a range of 30 > 80 τ at τ = 0.3, through the values of chunk 70 on
    ent[3] = 0.5 * ent[3]
    ent[3, 280:] += 25.0  # 24.5-25.5 > 24 = 80 τ, its top past chunk 64; exp(85) holds in fp32
    ent, mask, one = ent.to(DEVICE), torch.ones(4, 300, dtype=torch.bool, device=DEVICE), None
    adv = torch.ones(4, device=DEVICE)
    s = pw.get_strategy("proximal_softmax", window=11, temperature=1.0, apply_to="all")
    out = s._triton(adv, ent, mask, one).cpu()
    want = windowed_reference("proximal_softmax", adv[:1].cpu(), ent[:1], mask[:1], 11, 1.0,
                              "all", adv[:1].cpu() > 0)
    torch.testing.assert_close(out[:1].double(), want, rtol=2e-5, atol=1e-6)
    assert out[1].isnan().all()
    s = pw.get_strategy("proximal_softmax", window=11, temperature=0.3, apply_to="all")
    assert s._triton(adv[2:], ent[2:], mask[2:], None).isnan().all()
    assert s._body(adv[2:].cpu(), ent[2:].cpu(), mask[2:].cpu(), positive=None).isnan().all()


def test_windowed_kernel_rows_of_several_chunks_as_shipped():
    """Rows of 4,500 columns (three of the shipped chunks of 2,048), with holes, a row whose
    first chunk is all masked and a row whose range is wide only through its third chunk's
    values (a shift read from the first chunk misses it): both strategies as their bodies.
    The window is 11: its width meets the chunks nowhere (the compaction is done before it),
    and W = 101 cost the interpreter 30 s here."""
    adv, ent, mask = ragged_batch([4500, 3000, 4100], 4500, holes=True, seed=11, scale=3.0)
    adv = adv.abs() + 0.1
    mask[1, :2048] = False
    ent[2] = 0.5 * ent[2] / 3.0
    ent[2, 4096:] += 41.0  # range > 40 = 80 τ at τ = 0.5; exp(84) holds in fp32
    adv, ent, mask = adv.to(DEVICE), ent.to(DEVICE), mask.to(DEVICE)
    for name, params in [("proximal_softmax", dict(window=11, temperature=0.5)),
                         ("window_average", dict(window=11))]:
        s = pw.get_strategy(name, apply_to="all", **params)
        got = s._triton(adv, ent, mask, None).cpu()
        want = s._body(adv.cpu(), ent.cpu(), mask.cpu(), positive=None)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6, equal_nan=True)
        if name == "proximal_softmax":
            assert got[2][mask[2].cpu()].isnan().all() and got[:2].isfinite().all()


def test_windowed_kernel_empty():
    for shape in [(0, 5), (3, 0)]:
        adv = torch.ones(shape[0], device=DEVICE)
        ent = torch.zeros(shape, device=DEVICE)
        out = _triton.windowed(adv, ent, ent > 0, adv > 0, 5, 1.0)
        assert out.shape == shape


def test_low_temperature_softmax_has_no_kernel():
    """Below τ = 0.3 the body takes its exact log-domain path, which the kernel does not have:
    those strategies must run torch.compile instead (a kernel there would give NaN rows)."""
    assert pw.get_strategy("proximal_softmax", temperature=0.29)._triton is None
    assert pw.get_strategy("proximal_softmax", temperature=0.3)._triton is not None
    assert _w.EXP_SAFE_RANGE * 0.3 >= _w.ENTROPY_SPAN > _w.EXP_SAFE_RANGE * 0.29


@pytest.mark.skipif(DEVICE != "cuda", reason="the strategy routes CUDA tensors to the kernel")
@pytest.mark.parametrize("name", ["proximal_softmax", "window_average"])
def test_strategy_runs_the_windowed_kernel_on_cuda(monkeypatch, name):
    """On CUDA the strategy's call goes through the kernel (a hook never made leaves the counter
    at 0) and gives the reference's values; a validated call still raises on inf."""
    calls = count_calls(monkeypatch, "windowed")
    adv, ent, mask = ragged_batch([3, 50, 20, 7], 60, holes=True, seed=2)
    want = windowed_reference(name, adv, ent, mask, 11, 1.0, "positive", adv > 0)
    s = pw.get_strategy(name, window=11)
    got = s(adv.cuda(), ent.cuda(), mask.cuda(), validate=False)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=1e-6)
    assert len(calls) == 1
    bad = ent.clone()
    bad[mask] = math.inf
    with pytest.raises(ValueError):
        s(adv.cuda(), bad.cuda(), mask.cuda())


# ----------------------------------------------------------------------------------------- gtpo

# groups out of order (not contiguous), an all-failed group (-2), an all-succeeded one (5),
# a group with one empty row (3), one row per side in group 11
GROUPS = torch.tensor([7, 3, 7, -2, 5, 7, 3, 11, -2, 7, 5, 11, 3, 7])
POSITIVE = torch.tensor([1, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 1], dtype=torch.bool)
GTPO_ROWS = [30, 0, 12, 7, 300, 1, 40, 1100, 5, 33, 2, 64, 9, 250]


@pytest.mark.parametrize("normalize,alpha1,alpha2,eps", [("group", 1.0, 0.1, 1e-8),
                                                         ("group", 2.0, 0.1, 1e-8),
                                                         ("side", 0.5, 0.3, 1e-3)])
@pytest.mark.parametrize("holes", [False, True])
def test_gtpo_kernel_is_the_formula(normalize, alpha1, alpha2, eps, holes):
    """GTPO's Eqs. 3, 5 and 6 one token at a time (tests/reference.py): catches a side summed
    over the whole group (or over another group), positions counted on the raw columns
    instead of each row's valid tokens, the count of active rows at a position wrong for
    ragged rows, alpha1/alpha2/eps ignored, the standardisation over one row or one tile, an
    all-success or all-failure group not zeroed, the group/side choice ignored."""
    adv, ent, mask = ragged_batch(GTPO_ROWS, 1130, holes=holes, seed=21)
    ent, mask = ent.to(DEVICE), mask.to(DEVICE)
    s = pw.get_strategy("gtpo", normalize=normalize, alpha1=alpha1, alpha2=alpha2, eps=eps)
    got = s._triton(adv.to(DEVICE), ent, mask, positive=POSITIVE.to(DEVICE),
                    groups=GROUPS.to(DEVICE))
    want = torch.from_numpy(ref.gtpo(ent.cpu(), mask.cpu(), POSITIVE, GROUPS, alpha1, alpha2,
                                     eps, normalize))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert got[GROUPS.to(DEVICE) == 5].eq(0).all() and got[GROUPS.to(DEVICE) == -2].eq(0).all()


def test_gtpo_kernel_strides_dtypes_and_the_body():
    """bf16 entropies stored column-major, every other row; strided flags and int32 groups:
    the kernel agrees with the PyTorch body on them."""
    adv, ent_all, mask_all = ragged_batch([20, 3, 50, 8, 64, 1, 33, 17] * 2, 70, holes=True,
                                          seed=5, dtype=torch.bfloat16)
    ent = ent_all.to(DEVICE).t().contiguous().t()[::2]
    mask = mask_all.to(DEVICE).t().contiguous().t()[::2]
    positive = torch.tensor([1, 1, 0, 0] * 4, dtype=torch.bool, device=DEVICE)[::2]
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1] * 2, dtype=torch.int32, device=DEVICE)[::2]
    assert positive.stride(0) == 2 and groups.stride(0) == 2
    s = pw.get_strategy("gtpo")
    got = s._triton(adv[::2].to(DEVICE), ent, mask, positive=positive, groups=groups)
    want = s._body(adv[::2].to(DEVICE), ent, mask, positive=positive, groups=groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.abs().sum() > 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_gtpo_kernel_propagates_a_bad_entropy_to_its_group_as_nan(bad):
    """A failure's NaN or ±inf entropy (1/inf would be a finite 0) turns its own group NaN and
    no other; masked, it changes nothing."""
    adv, ent, mask = ragged_batch([5, 7, 6, 4], 7, seed=3)
    positive = torch.tensor([True, False, True, False], device=DEVICE)
    groups = torch.tensor([0, 0, 1, 1], device=DEVICE)
    ent, mask = ent.to(DEVICE), mask.to(DEVICE)
    s = pw.get_strategy("gtpo")
    clean = s._triton(adv, ent, mask, positive=positive, groups=groups)
    poisoned = ent.clone()
    poisoned[1, 2] = bad
    out = s._triton(adv, poisoned, mask, positive=positive, groups=groups)
    assert torch.isnan(out[:2][mask[:2]]).all() and torch.equal(out[2:], clean[2:])
    hidden = ent.clone()
    hidden[~mask] = bad
    assert torch.equal(s._triton(adv, hidden, mask, positive=positive, groups=groups), clean)
    # a group whose rollouts all succeeded: 0 (+0) where finite, NaN where its entropy is bad
    agree = torch.tensor([True, True, True, False], device=DEVICE)
    out = s._triton(adv, poisoned, mask, positive=agree, groups=groups)
    assert torch.isnan(out[:2][mask[:2]]).all() and out[:2][~mask[:2]].eq(0).all()
    fine = s._triton(adv, ent, mask, positive=agree, groups=groups)
    assert fine[:2].eq(0).all() and not torch.signbit(fine[:2]).any()


def test_gtpo_kernel_side_mode_keeps_its_digits():
    """By side every shaped reward is about ±α1: with α1 = 3 and α2 = 1e-4 the spread is 1e-4
    of the values, and a variance taken as E[r²] - mean² of the raw rewards keeps three digits
    (1.7e-3 off on outputs of 0.29); the kernel's sums are of r less each side's mean."""
    g = torch.Generator().manual_seed(4)
    ent = (2.0 + 0.01 * torch.rand(8, 400, generator=g)).to(DEVICE)
    mask = torch.ones(8, 400, dtype=torch.bool, device=DEVICE)
    positive = torch.tensor([1, 0, 1, 0, 1, 1, 0, 0], dtype=torch.bool, device=DEVICE)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], device=DEVICE)
    s = pw.get_strategy("gtpo", normalize="side", alpha1=3.0, alpha2=1e-4)
    got = s._triton(positive.float(), ent, mask, positive=positive, groups=groups)
    want = s._body(positive.float(), ent, mask, positive=positive, groups=groups)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gtpo_kernel_more_rows_than_a_block(monkeypatch):
    """70 rows in groups of 4 (two successes, two failures), with blocks of 32 (the shipped
    1,024 is the same code: 1,030 rows took the interpreter 30 s): the rows' group and side
    lists are built block by block, so a count of either not carried past the first block
    would lose the later rows' partners; groups and sides straddle the blocks' ends (rows 29-32
    are one group, its failures rows 31 and 32; rows 69 and 0-2 another)."""
    monkeypatch.setattr(_triton, "_BLOCK", 32)
    b = 70
    g = torch.Generator().manual_seed(2)
    ent = torch.rand(b, 3, generator=g).to(DEVICE)
    mask = torch.ones(b, 3, dtype=torch.bool, device=DEVICE)
    v = torch.arange(b, device=DEVICE).roll(5)  # row i holds (i - 5) mod 70
    groups, positive = v // 4, v % 4 < 2
    s = pw.get_strategy("gtpo")
    got = s._triton(positive.float(), ent, mask, positive=positive, groups=groups)
    want = s._body(positive.float(), ent, mask, positive=positive, groups=groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gtpo_kernel_empty():
    for shape in [(0, 5), (3, 0)]:
        z = torch.zeros(shape, device=DEVICE)
        flags = torch.zeros(shape[0], dtype=torch.bool, device=DEVICE)
        out = _triton.gtpo(z, z > 0, flags, flags.long(), 1.0, 0.1, 1e-8, False)
        assert out.shape == shape


@pytest.mark.skipif(DEVICE != "cuda", reason="the strategy routes CUDA tensors to the kernel")
def test_strategy_runs_the_gtpo_kernel_on_cuda(monkeypatch):
    calls = count_calls(monkeypatch, "gtpo")
    adv, ent, mask = ragged_batch(GTPO_ROWS, 1130, holes=True, seed=21)
    want = torch.from_numpy(ref.gtpo(ent, mask, POSITIVE, GROUPS, 1.0, 0.1, 1e-8, "group"))
    got = pw.get_strategy("gtpo")(adv.cuda(), ent.cuda(), mask.cuda(), positive=POSITIVE.cuda(),
                                  groups=GROUPS.cuda(), validate=False)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


# ------------------------------------------- edges a mutation sample found no test of (CPU or GPU)


def test_entropy_bonus_kernel_counts_a_negative_entropy_as_zero():
    """A valid entropy below 0 (fp32 rounding of an entropy that is 0 lets -1e-6 through
    validation) gives ``A`` exactly, as the body does. Catches the kernel without the clamp
    (``A + α H < A``, a negative bonus); the loop reference has no clamp, so compare the body."""
    adv = torch.tensor([1.0, -2.0], device=DEVICE)
    ent = torch.tensor([[-0.5, -1e-6, 0.3], [-3.0, 0.0, 1.0]], device=DEVICE)
    mask = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    s = pw.get_strategy("entropy_bonus", alpha=0.4, kappa=2.0)
    got = s._triton(adv, ent, mask)
    assert torch.equal(got, s._body(adv, ent, mask))
    assert got[0, 0] == 1.0 and got[0, 1] == 1.0 and got[1, 0] == -2.0


def _huge_row_stride(b, t, dtype):
    """A ``[b, t]`` view with a row stride of 2^30 + 64: row 2 starts past 2^31 elements, where
    an int32 offset wraps; the storage is virtual memory, nearly all of it never touched."""
    s_row = 2**30 + 64
    try:
        base = torch.empty((b - 1) * s_row + t, dtype=dtype, device=DEVICE)
    except (RuntimeError, MemoryError):  # no overcommit here
        pytest.skip("needs a few GiB of (untouched) memory for a strided view")
    return base.as_strided((b, t), (s_row, 1))


def test_kernels_take_row_offsets_past_2_to_the_31():
    """Row offsets in int64: a bf16 entropy view (``entropy_bonus``) and a bool mask view (the
    windowed strategies) whose third row starts past 2^31 elements give the contiguous copy's
    result. Catches a row index left int32 (``row * stride`` wraps: other tokens read, or an
    illegal address; the interpreter crashes)."""
    g = torch.Generator().manual_seed(0)
    ent = _huge_row_stride(3, 64, torch.bfloat16)
    ent.copy_((torch.rand(3, 64, generator=g) * 3).to(DEVICE))
    ones = torch.ones(3, 64, dtype=torch.bool, device=DEVICE)
    adv = torch.tensor([1.0, -1.0, 2.0], device=DEVICE)
    s = pw.get_strategy("entropy_bonus", alpha=0.4, kappa=2.0)
    assert torch.equal(s._triton(adv, ent, ones), s._body(adv, ent.contiguous(), ones))
    del ent
    ent = (torch.rand(3, 64, generator=g) * 3).to(DEVICE)
    mask = _huge_row_stride(3, 64, torch.bool)
    mask.copy_((torch.rand(3, 64, generator=g) > 0.3).to(DEVICE))
    for name in ("proximal_softmax", "window_average"):
        s = pw.get_strategy(name, window=5, apply_to="all")
        torch.testing.assert_close(s._triton(adv, ent, mask, None),
                                   s._body(adv, ent, mask.contiguous(), positive=None),
                                   rtol=2e-5, atol=1e-6)


def test_window_average_kernel_edges_of_its_window_sum():
    """Eq. 7's window average where a window sums to 0 beside others that do not: ``1/W``
    there (``e = [1/3, 1/3, 1/3, 0, 1/2, 1/3]`` for W = 3), not 1 (an all-zero row, the only
    one tested before, normalises any constant to ``c = 1``); and a window whose finite
    entropies overflow fp32 (``3e38 + 3e38``) makes the row NaN, as the body's does (catches
    the kernel's inf-window rule dropped: a finite row, 0 at the huge tokens)."""
    ent = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 2.0]], device=DEVICE)
    mask = torch.ones(1, 6, dtype=torch.bool, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    s = pw.get_strategy("window_average", window=3, apply_to="all")
    got = s._triton(one, ent, mask, None)
    torch.testing.assert_close(got, s._body(one, ent, mask, positive=None), rtol=1e-6, atol=1e-6)
    e = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0, 0.5, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(got.cpu().double()[0], e / e.sum() * 6, rtol=1e-6, atol=1e-6)
    huge = torch.tensor([[3e38, 3e38, 1.0, 2.0]], device=DEVICE)
    mask = torch.ones(1, 4, dtype=torch.bool, device=DEVICE)
    assert s._body(one, huge, mask, positive=None).isnan().all()
    assert s._triton(one, huge, mask, None).isnan().all()


@pytest.mark.parametrize("name", ["proximal_softmax", "window_average"])
def test_windowed_kernels_rows_of_zero_advantage_and_lone_tokens(name):
    """With ``apply_to="all"`` a row of ``A = 0`` whose entropies hold a NaN is NaN (``c · 0``),
    as the body gives: catches the kernel reading the advantages as the positive flags where
    none are given (``A = 0`` then leaves the row unweighted, hiding the NaN; zero-advantage
    rows are every all-same-reward group). And a tile of 256 columns holding one valid token
    (a row's last, or one past a gap) is weighted: catches the padding-tile skip taken for a
    tile with fewer than two."""
    adv = torch.tensor([0.0, 1.0], device=DEVICE)
    ent = torch.tensor([[0.5, math.nan, 1.0, 0.7], [0.5, 0.2, 1.0, 0.7]], device=DEVICE)
    mask = torch.ones(2, 4, dtype=torch.bool, device=DEVICE)
    s = pw.get_strategy(name, window=3, apply_to="all")
    got, want = s._triton(adv, ent, mask, None), s._body(adv, ent, mask, positive=None)
    assert want[0].isnan().all() and got[0].isnan().all()
    torch.testing.assert_close(got[1], want[1])
    g = torch.Generator().manual_seed(1)
    ent = (torch.rand(2, 300, generator=g) * 3).to(DEVICE)
    mask = torch.zeros(2, 300, dtype=torch.bool, device=DEVICE)
    mask[0, :257] = True  # columns 256-299, the second tile, hold one valid token
    mask[1, :200] = True
    mask[1, 280] = True  # and here one past a gap
    adv = torch.tensor([1.0, 2.0], device=DEVICE)
    s = pw.get_strategy(name, window=5, apply_to="all")
    torch.testing.assert_close(s._triton(adv, ent, mask, None),
                               s._body(adv, ent, mask, positive=None), rtol=2e-5, atol=1e-6)
