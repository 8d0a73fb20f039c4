"""pepo._triton's ``global_topk`` kernels, both ways to the threshold (one ``torch.sort`` of
the batch, and the radix select), against TRL's quantile rule (``tests/reference.py``) and the
pure-PyTorch strategy they stand in for on CUDA. They run where tests/test_triton_kernels.py
runs (a GPU, or a CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import pepo.weighting as pw  # noqa: E402
from pepo import _triton  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests._triton_helpers import DEVICE, count_calls, pytestmark  # noqa: E402, F401
from tests.conftest import ragged_batch  # noqa: E402

# ---------------------------------------------------------------------------------- global_topk


@pytest.fixture(params=["sort", "radix", "radix12"])
def topk_select(request, monkeypatch):
    """Every way to the threshold: one ``torch.sort`` of the batch, and the radix select over
    the scores' order keys (the top byte's histogram, then three passes of a byte, or two of 12
    bits)."""
    monkeypatch.setattr(_triton, "_TOPK_SELECT", request.param)
    return request.param


def topk_batch(dtype=torch.float32, holes=True, seed=4, lengths=(1, 3, 9, 37, 300, 0, 1500)):
    """Ragged rows (one past the kernels' 1,024-column block, one empty) with many ties: the
    entropies are rounded to quarters, so the threshold falls inside a run of equal scores."""
    adv, ent, mask = ragged_batch(list(lengths), 1600, holes=holes, seed=seed)
    ent = torch.where(mask, (ent * 4).round() / 4, ent).to(dtype)
    return adv.to(DEVICE), ent.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.2, 0.37, 1.0])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_selects_what_torch_quantile_selects(dtype, fraction, holes):
    """80/20's rule as TRL writes it (tests/reference.py: ``s >= torch.quantile(s, 1 - f)``
    in float64): catches a threshold off by one place in the sort, ties at the threshold
    dropped, the count of valid tokens taken from one block, masked tokens counted, the
    fraction ignored, a per-row threshold."""
    adv, ent, mask = topk_batch(dtype, holes)
    s = pw.get_strategy("global_topk", fraction=fraction)
    got = s._triton(adv, ent, mask)
    want = torch.from_numpy(ref.global_topk(adv.cpu(), ent.float().cpu(), mask.cpu(), fraction))
    assert torch.equal(got.cpu().double(), want)
    assert torch.equal(got, s._body(adv, ent, mask))


@pytest.mark.parametrize("n", [11, 26, 101, 1001])
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.37])
@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_keeps_exactly_k_of_distinct_scores(n, fraction):
    """Distinct scores, so no tie hides a miscount: exactly ``k = n - ceil(q (n - 1))``
    tokens, the k largest. With n - 1 a multiple of 5 and fraction 0.2, a q rounded to fp32
    (0.800000012: what a Python float argument becomes in a compiled Triton kernel) gives
    ``k - 1``; a threshold read one place off in the sort gives ``k ± 1``."""
    g = torch.Generator().manual_seed(n)
    scores = torch.randperm(n, generator=g).float().reshape(1, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    pad = torch.full((1, 5), math.nan)
    scores = torch.cat([scores, pad], 1).to(DEVICE)
    mask = torch.cat([mask, torch.zeros(1, 5, dtype=torch.bool)], 1).to(DEVICE)
    s = pw.get_strategy("global_topk", fraction=fraction)
    out = s._triton(torch.ones(1, device=DEVICE), scores, mask).cpu()
    k = n - math.ceil((1.0 - fraction) * (n - 1))
    assert int(out.sum()) == k
    assert out[0, :n][scores[0, :n].cpu() >= n - k].eq(1).all()


@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_selected_tokens_scale_and_strides():
    """``normalize="selected_tokens"`` scales the kept advantages by N_valid / N_selected (the
    bisection's count, ties included, as the body counts it); strided scores, mask and
    advantages are read where they lie."""
    adv_all, ent_all, mask_all = topk_batch(seed=6, lengths=(40, 7, 300, 12, 64, 1, 200, 33))
    ent = ent_all.t().contiguous().t()[::2]
    mask = mask_all.t().contiguous().t()[::2]
    adv = adv_all[::2]
    s = pw.get_strategy("global_topk", fraction=0.3, normalize="selected_tokens")
    got = s._triton(adv, ent, mask)
    assert torch.equal(got, s._body(adv, ent, mask))
    kept = (got != 0) & mask
    scale = mask.sum().double() / kept.sum().double()
    want = torch.from_numpy(ref.global_topk(adv.cpu(), ent.cpu(), mask.cpu(), 0.3)) * scale.cpu()
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_non_finite_scores(bad):
    """A valid NaN or ±inf score anywhere makes every valid token NaN (the threshold is over
    the batch), masked ones 0; the same value at a masked position changes nothing."""
    adv, ent, mask = topk_batch(seed=9)
    s = pw.get_strategy("global_topk")
    clean = s._triton(adv, ent, mask)
    hidden = ent.clone()
    hidden[~mask] = bad
    assert torch.equal(s._triton(adv, hidden, mask), clean)
    poisoned = ent.clone()
    poisoned[6, 1000] = bad
    assert bool(mask[6, 1000])
    out = s._triton(adv, poisoned, mask)
    assert out[mask].isnan().all() and out[~mask].eq(0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("normalize", ["all_tokens", "selected_tokens"])
@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_keeps_a_bad_advantage_where_no_token_is_selected(bad, normalize):
    """As the PyTorch body: a NaN/inf ``A_i`` on a row with no selected token is NaN at that
    row's valid tokens (0 would be a finite guess), masked tokens 0, finite rows exactly 0 or
    ``A_i`` (``A - A`` is +0, never -0)."""
    ent = torch.tensor([[0.1, 0.1, 0.1, 0.0], [2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]], device=DEVICE)
    s = pw.get_strategy("global_topk", fraction=0.2, normalize=normalize)
    for adv in ([bad, 1.0], [-0.5, 1.0]):
        a = torch.tensor(adv, device=DEVICE)
        out = s._triton(a, ent, mask).cpu()
        want = s(a, ent, mask, validate=False).cpu()  # the PyTorch body
        assert torch.equal(out.isnan(), want.isnan())
        assert out.isnan().sum() == (0 if math.isfinite(adv[0]) else 3)
        assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(torch.signbit(out), torch.signbit(want))


@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_small_batches():
    """No valid token (all 0), one valid token (kept: k = 1), empty shapes."""
    adv = torch.tensor([2.0, -1.0], device=DEVICE)
    ent = torch.rand(2, 5, device=DEVICE)
    s = pw.get_strategy("global_topk", normalize="selected_tokens")
    none = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    assert s._triton(adv, ent, none).eq(0).all()
    one = none.clone()
    one[1, 3] = True
    out = s._triton(adv, ent, one).cpu()
    assert out[1, 3] == -1.0 and out.ne(0).sum() == 1
    for shape in [(0, 5), (3, 0)]:
        z = torch.zeros(shape, device=DEVICE)
        assert _triton.global_topk(torch.zeros(shape[0], device=DEVICE), z, z > 0, 0.8,
                                   False).shape == shape


@pytest.mark.usefixtures("topk_select")
def test_global_topk_kernel_proximal_score():
    """``score="proximal"``: the selection the body makes from its own proximal entropies,
    but for tokens whose score ties the threshold to float32 rounding (the kernel's window
    sums add in another order); the temperature reaches the score (τ = 2 selects otherwise)."""
    adv, ent, mask = topk_batch(seed=12)
    ent = torch.where(mask, ent + torch.rand(ent.shape, device=DEVICE) * 0.1, ent)  # fewer ties
    for temperature in (1.0, 2.0):
        s = pw.get_strategy("global_topk", score="proximal", window=11, temperature=temperature)
        got = s._triton(adv, ent, mask)
        want = s._body(adv, ent, mask)
        e = pw.proximal_entropy(ent, mask, window=11, temperature=temperature)
        differ = (got != want) & mask
        threshold = e[mask & (want != 0)].min() if bool((want != 0).any()) else 0.0
        assert torch.allclose(e[differ], torch.full_like(e[differ], float(threshold)),
                              rtol=1e-5, atol=0)
        assert int(differ.sum()) <= 2
    a = pw.get_strategy("global_topk", score="proximal", window=11, temperature=1.0)._triton
    b = pw.get_strategy("global_topk", score="proximal", window=11, temperature=2.0)._triton
    assert not torch.equal(a(adv, ent, mask), b(adv, ent, mask))


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.9])
def test_global_topk_radix_select_orders_every_float(monkeypatch, fraction):
    """The radix select's keys order floats as floats: scores one ulp apart (keys that differ
    in the last byte only), negatives, -0.0 beside +0.0, subnormals, ±max; the selection and
    ``N_selected`` are the reference's and the sort's (a key that flips only the sign bit puts
    negatives in reverse order; a histogram pass that ignores the bytes chosen before counts
    other keys' bytes; ``N_selected`` without the ties at the threshold scales wrongly)."""
    one = torch.tensor(1.0)
    ulps = [one]
    for _ in range(40):
        ulps.append(torch.nextafter(ulps[-1], torch.tensor(2.0)))
    sub = torch.tensor(1e-45)  # the smallest fp32 subnormal
    scores = torch.cat([torch.stack(ulps), -torch.stack(ulps), torch.tensor(
        [0.0, -0.0, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5, -0.5]), sub.repeat(3),
        torch.stack(ulps[:5]).repeat(2)]).reshape(1, -1)
    perm = torch.randperm(scores.shape[1], generator=torch.Generator().manual_seed(2))
    scores = scores[:, perm].to(DEVICE)
    mask = torch.ones_like(scores, dtype=torch.bool)
    adv = torch.ones(1, device=DEVICE)
    got = {}
    for way in ("sort", "radix", "radix12"):
        monkeypatch.setattr(_triton, "_TOPK_SELECT", way)
        s = pw.get_strategy("global_topk", fraction=fraction, normalize="selected_tokens")
        got[way] = s._triton(adv, scores, mask).cpu()
    kept = torch.from_numpy(ref.global_topk(adv.cpu(), scores.cpu(), mask.cpu(), fraction)) != 0
    assert torch.equal(got["radix"] != 0, kept)
    assert torch.equal(got["radix"], got["sort"])
    assert torch.equal(got["radix12"], got["sort"])
    torch.testing.assert_close(got["radix"][kept].double(),
                               torch.full((int(kept.sum()),), scores.numel() / kept.sum().item(),
                                          dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.usefixtures("topk_select")
@pytest.mark.parametrize("normalize", ["all_tokens", "selected_tokens"])
def test_global_topk_proximal_kernel_zeroes_its_own_counts(monkeypatch, normalize):
    """With the proximal score the window kernels write the select's input and counts, and the
    counts come from ``torch.empty``: the compaction zeroes them. Every new buffer is handed
    over full of garbage here, and the output must not change: catches the zeroing left out
    (or done after the window kernel has added to the counts), too short for the radix
    histograms, and a buffer the kernels leave partly unwritten."""
    adv, ent, mask = topk_batch(seed=5)
    ent = torch.where(mask, ent + torch.rand(ent.shape, device=DEVICE) * 0.1, ent)
    s = pw.get_strategy("global_topk", score="proximal", window=11, normalize=normalize)
    clean = s._triton(adv, ent, mask)
    empty = torch.empty

    def dirty(*args, **kwargs):
        return empty(*args, **kwargs).fill_(7)

    monkeypatch.setattr(torch, "empty", dirty)
    got = s._triton(adv, ent, mask)
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.equal(got, clean)
    want = s._body(adv, ent, mask)
    assert int(((got != want) & mask).sum()) <= 2  # ties to fp32 rounding, as above
    assert ((got != 0) & mask).sum() > 0


def test_global_topk_kernel_names_a_bad_select(monkeypatch):
    monkeypatch.setattr(_triton, "_TOPK_SELECT", "heap")
    ent = torch.rand(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="PEPO_TOPK_SELECT='heap'"):
        _triton.global_topk(torch.ones(2, device=DEVICE), ent, ent > 0.5, 0.8, False)


@pytest.mark.parametrize("bad", ["4000x8", "4096x3", "128x4", "131072x8", "4096", "x8",
                                 "4096x8x2", "-1024x4", "\u00b2x8", "\uff14\uff10\uff19\uff16x8"])
def test_a_bad_histogram_setting_is_named(bad):
    """``PEPO_TOPK_HIST``: a block that is no power of two (a ``tl.arange`` length), over 2^16
    (Triton refuses it in the kernel) or under one 256-count histogram, a warp count Triton
    refuses, no ``x``, or digits other than ASCII's (``int`` of a superscript two fails without
    the variable's name) is one line naming the value, not a kernel failure later."""
    with pytest.raises(ValueError, match=f"PEPO_TOPK_HIST={bad!r}"):
        _triton._hist_setting(bad)


def test_the_histogram_setting_is_read_from_the_environment(monkeypatch):
    """The variable is read at import (as ``PEPO_TOPK_SELECT``), spelt either way; without it,
    4,096 scores and 8 warps. A bad value does not fail the import (every other kernel strategy
    imports the module too): ``global_topk``'s radix select names it, and the sort runs."""
    import os
    import subprocess
    import sys

    code = "import pepo._triton as t; print(t._HIST_BLOCK, t._HIST_WARPS)"
    env = {k: v for k, v in os.environ.items() if k != "PEPO_TOPK_HIST"}
    for value, want in ((None, "4096 8"), ("1024X4", "1024 4"), (" 16384x16 ", "16384 16"),
                        ("4096x6", "0 0")):
        run_env = env if value is None else {**env, "PEPO_TOPK_HIST": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, check=True).stdout
        assert out.split("\n")[-2] == want
    monkeypatch.setattr(_triton, "_HIST", "4096x6")
    monkeypatch.setattr(_triton, "_HIST_BLOCK", 0)
    monkeypatch.setattr(_triton, "_TOPK_SELECT", "radix")
    ent = torch.rand(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="PEPO_TOPK_HIST='4096x6'"):
        _triton.global_topk(torch.ones(2, device=DEVICE), ent, ent > 0.5, 0.8, False)
    monkeypatch.setattr(_triton, "_TOPK_SELECT", "sort")
    assert _triton.global_topk(torch.ones(2, device=DEVICE), ent, ent > 0.5, 0.8, False).shape \
        == (2, 5)


@pytest.mark.parametrize(("select", "passes"), [("radix", [(1, 8), (2, 8), (3, 8)]),
                                               ("radix12", [(1, 12), (2, 12)])])
def test_the_histogram_passes_launch_with_the_setting(monkeypatch, select, passes):
    """The passes' grid, block and warps come from the setting (catches the setting read and
    then not passed to the launch: a grid of ``_BLOCK`` programs, Triton's default warps), one
    launch a digit below the top byte (three of 8 bits, or two of 12), and the selection is the
    sort's."""
    ent = torch.rand(2, 1000, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    adv = torch.ones(2, device=DEVICE)
    monkeypatch.setattr(_triton, "_TOPK_SELECT", "sort")
    want = _triton.global_topk(adv, ent, ent > 0.1, 0.8, False)
    monkeypatch.setattr(_triton, "_TOPK_SELECT", select)
    real, seen = _triton._radix_hist_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((tuple(grid), kw["BLOCK"], kw.get("num_warps"), kw["PASS"],
                             kw["DIGIT"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(_triton, "_radix_hist_kernel", Spy())
    monkeypatch.setattr(_triton, "_HIST_BLOCK", 256)
    monkeypatch.setattr(_triton, "_HIST_WARPS", 2)
    got = _triton.global_topk(adv, ent, ent > 0.1, 0.8, False)
    assert seen == [((8,), 256, 2, *p) for p in passes]  # 2,000 scores in programs of 256
    assert torch.equal(got, want)


def test_global_topk_kernel_only_where_it_computes_the_same():
    """A bound process group bisects across ranks, and the proximal score below τ = 0.3 takes
    the exact log path: neither has the kernel; the default strategy does."""
    assert pw.get_strategy("global_topk")._triton is not None
    assert pw.get_strategy("global_topk", score="proximal", temperature=0.29)._triton is None
    group = type("Group", (), {"size": lambda self: 2})()  # what a ProcessGroup answers
    assert pw.get_strategy("global_topk", process_group=group)._triton is None


@pytest.mark.skipif(DEVICE != "cuda", reason="the strategy routes CUDA tensors to the kernel")
@pytest.mark.usefixtures("topk_select")
def test_strategy_runs_the_topk_kernel_on_cuda(monkeypatch):
    calls = count_calls(monkeypatch, "global_topk")
    adv, ent, mask = topk_batch()
    s = pw.get_strategy("global_topk")
    want = torch.from_numpy(ref.global_topk(adv.cpu(), ent.cpu(), mask.cpu(), 0.2))
    assert torch.equal(s(adv, ent, mask, validate=False).cpu().double(), want)
    assert len(calls) == 1
