"""``validate=False``: the core reads no tensor value on the host, so a GPU never waits on it.

The proof runs on ``meta`` tensors, which hold no data: ``.item()``, ``.tolist()``, ``bool()``,
boolean indexing, ``torch.unique`` and ``nonzero`` all raise there. A call that completes on
meta tensors therefore makes no host sync on any device. torch 1.x lacks meta kernels for some
of the ops used (``logcumsumexp``), so there the same calls run on CPU tensors under a counter
of every host read instead (``_HostReads``); on torch 2 both run. Today's code (before ``validate``)
failed every one of these: the window scan read its flags with ``.tolist()``, ``global_topk``
counted its tokens with ``int()``, GTPO renumbered groups with ``torch.unique`` and indexed with
the mask, ``group_advantages`` read its finite count with ``int()``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pepo.weighting as pw
from pepo.estimators import group_advantages
from pepo.loss import clipped_policy_loss
from tests import reference as ref
from tests.conftest import ragged_batch

STRATEGIES = {
    "uniform": {},
    "proximal_softmax": {"window": 5},
    "proximal_softmax(τ=0.1)": {"window": 5, "temperature": 0.1},  # the log-domain path
    "window_average": {"window": 5},
    "entropy_bonus": {},
    "global_topk": {},
    "global_topk(proximal, selected)": {"score": "proximal", "window": 5,
                                        "normalize": "selected_tokens"},
    "gtpo": {},
    "gtpo(side)": {"normalize": "side"},
}


META = int(torch.__version__.split(".")[0]) >= 2  # torch 1.x lacks some meta kernels


def _strategy(key: str) -> pw.Strategy:
    return pw.get_strategy(key.split("(")[0], **STRATEGIES[key])


def _meta_batch(b: int = 6, t: int = 40):
    dev = "meta"
    return (torch.empty(b, device=dev), torch.empty(b, t, device=dev),
            torch.empty(b, t, dtype=torch.bool, device=dev),
            torch.empty(b, dtype=torch.bool, device=dev),
            torch.empty(b, dtype=torch.long, device=dev))


class _HostReads:
    """Counts the host reads of a CPU call: ``.tolist()``, and, seen at the dispatcher, every
    scalar read (``.item()``, ``bool``/``int``/``float`` of a tensor), ``nonzero``,
    ``torch.unique`` and indexing by a bool tensor (a result shaped by values). Only ``tolist``
    (a plain method) is patched: replacing a dunder of ``torch.Tensor`` would change the
    class's C slots for good."""

    READS = ("_local_scalar_dense", "nonzero", "_unique", "unique_", "masked_select")

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.count = 0
        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                bool_index = name.startswith("aten.index.") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 else ()) if i is not None)
                if bool_index or any(r in name for r in reads.READS):
                    reads.count += 1
                return func(*args, **(kwargs or {}))

        original = torch.Tensor.tolist

        def tolist(t, *a, **k):
            self.count += 1
            return original(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _cpu_batch():
    adv, ent, mask = ragged_batch([3, 7, 12, 12, 1, 9], 12, holes=True, seed=4)
    return (adv, ent, mask, torch.tensor([True, False, True, False, True, False]),
            torch.tensor([5, 5, 2, 2, 9, 9]))


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_strategies_read_nothing_on_the_host_without_validation(key, monkeypatch):
    """Catches any host read in a strategy's path: a flag read with ``.tolist()``, a count with
    ``int()``, ``torch.unique``, boolean indexing (all raise on meta tensors, and each is
    counted on CPU tensors)."""
    s = _strategy(key)
    if META:
        adv, ent, mask, positive, groups = _meta_batch()
        out = s(adv, ent, mask, positive=positive, groups=groups, validate=False)
        assert out.shape == mask.shape and out.dtype == torch.float32
        assert out.device.type == "meta"
    adv, ent, mask, positive, groups = _cpu_batch()
    with _HostReads(monkeypatch) as reads:
        s(adv, ent, mask, positive=positive, groups=groups, validate=False)
    assert reads.count == 0


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_validation_reads_on_the_host_so_meta_tensors_refuse_it(key):
    """The other side: with ``validate=True`` the call does read values (its one sync), so the
    meta test above would catch a ``validate`` flag that is ignored. (On torch 1.x a missing meta
    kernel raises first; the read counter's test below holds the claim there.)"""
    adv, ent, mask, positive, groups = _meta_batch()
    with pytest.raises((RuntimeError, NotImplementedError)):
        _strategy(key)(adv, ent, mask, positive=positive, groups=groups, validate=True)


def test_statistics_group_advantages_and_loss_read_nothing_on_the_host(monkeypatch):
    """The public statistics, ``group_advantages`` and ``clipped_policy_loss`` with
    ``validate=False``. Catches ``group_advantages``' finite checks (``int()``, ``bool()``)
    left in the unvalidated path."""
    _, ent, mask, _, _ = _cpu_batch()
    lp = torch.randn(3, 7, requires_grad=True)
    m = torch.rand(3, 7) > 0.3
    rewards, old, a, w = torch.rand(8), torch.randn(3, 7), torch.randn(3, 7), torch.rand(3, 7)
    with _HostReads(monkeypatch) as reads:
        pw.proximal_entropy(ent, mask, window=5, validate=False)
        pw.window_average_entropy(ent, mask, window=5, validate=False)
        group_advantages(rewards, 4, validate=False)
        clipped_policy_loss(lp, old, a, m, validate=False, num_tokens=m.sum(), is_weights=w)
    assert reads.count == 0
    with _HostReads(monkeypatch) as reads:
        group_advantages(rewards, 4)  # validating reads the counts, once
    assert reads.count == 1
    with _HostReads(monkeypatch) as reads:  # the loss reads nothing even when validating, and
        clipped_policy_loss(lp, old, a, m)  # counts its own tokens on the device (the recipe's
        clipped_policy_loss(lp, old, a, m, is_weights=w)  # call)
    assert reads.count == 0
    monkeypatch.undo()
    if not META:
        return
    _, ent, mask, _, _ = _meta_batch()
    assert pw.proximal_entropy(ent, mask, window=5, validate=False).device.type == "meta"
    assert pw.window_average_entropy(ent, mask, window=5, validate=False).device.type == "meta"
    rewards = torch.empty(8, device="meta")
    assert group_advantages(rewards, 4, validate=False).shape == (8,)
    with pytest.raises((RuntimeError, NotImplementedError)):
        group_advantages(rewards, 4)  # validating reads the counts
    lp = torch.empty(3, 7, device="meta", requires_grad=True)
    old, a = torch.empty(3, 7, device="meta"), torch.empty(3, 7, device="meta")
    m = torch.empty(3, 7, dtype=torch.bool, device="meta")
    loss = clipped_policy_loss(lp, old, a, m, num_tokens=torch.empty((), device="meta"),
                               is_weights=torch.empty(3, 7, device="meta"), validate=False)
    assert loss.shape == ()
    assert clipped_policy_loss(lp, old, a, m).shape == ()  # validated, its own token count


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_validation_is_one_host_read(key, monkeypatch):
    """With ``validate=True`` exactly one read (inputs and output checked together); catches a
    second sync (a scan before the kernels, a separate output check)."""
    adv, ent, mask, positive, groups = _cpu_batch()
    s = _strategy(key)
    with _HostReads(monkeypatch) as reads:
        s(adv, ent, mask, positive=positive, groups=groups, validate=True)
    assert reads.count == 1


@pytest.mark.parametrize("key", list(STRATEGIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_unvalidated_output_is_the_validated_one(key, seed):
    """Same values with and without validation, on rows with holes, a one-token row and an
    empty row; catches a sync-free path that computes something else (a count read from the
    wrong rank of a sort, groups renumbered differently)."""
    adv, ent, mask = ragged_batch([0, 1, 5, 17, 30, 30, 8, 2], 30, holes=bool(seed), seed=seed)
    positive = torch.tensor([True, False, True, True, False, True, False, False])
    groups = torch.tensor([40, 40, 7, 7, 7, -3, -3, 40])
    s = _strategy(key)
    checked = s(adv, ent, mask, positive=positive, groups=groups)
    unchecked = s(adv, ent, mask, positive=positive, groups=groups, validate=False)
    assert torch.equal(checked, unchecked)


@pytest.mark.parametrize("temperature", [1.0, 0.1])
def test_rows_wider_than_the_shifted_exp_are_exact_validated_and_nan_unvalidated(temperature):
    """Entropies spanning 0..100 nats (no vocabulary has them) at τ = 1 overflow the shifted
    exp's range. Validated: the call is redone on the log-domain path and matches the float64
    formula; unvalidated: that row is NaN, never a finite wrong value, and the other row is
    exact. At τ = 0.1 the log-domain path is taken from the temperature alone. Catches a
    sync-free path that returns the underflowed windows (0/0, or 0 for a true ~1e-40)."""
    h = torch.tensor([[0.0, 100.0, 0.5, 90.0, 0.0, 3.0, 99.0],
                      [0.1, 0.7, 0.3, 1.9, 0.0, 1.2, 0.4]])
    mask = torch.ones_like(h, dtype=torch.bool)
    want = torch.tensor(np.stack([ref.proximal_entropy_row(row.double().numpy(), 3, temperature)
                                  for row in h]))
    got = pw.proximal_entropy(h, mask, window=3, temperature=temperature)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-30)
    raw = pw.proximal_entropy(h, mask, window=3, temperature=temperature, validate=False)
    if temperature == 1.0:
        assert torch.isnan(raw[0]).all()
    else:
        torch.testing.assert_close(raw[0].double(), want[0], rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(raw[1].double(), want[1], rtol=1e-5, atol=1e-30)
    adv = torch.tensor([1.0, 1.0])
    s = pw.get_strategy("proximal_softmax", window=3, temperature=temperature, apply_to="all")
    c = want / want.sum(1, keepdim=True) * 7
    torch.testing.assert_close(s(adv, h, mask).double(), c, rtol=1e-5, atol=1e-30)


def test_a_redo_in_one_thread_leaves_other_threads_on_their_own_path():
    """The exact path that a validated call's redo takes is per thread. Two threads' redos
    overlapping (A in, B in, A out, B out) left a module-wide flag set for good (B restored
    A's True), and while one thread redid, another thread's unvalidated call on rows too wide
    for the shifted exp came back finite instead of NaN. Catches a flag shared by threads."""
    import threading

    from pepo import _windows as _w

    h = torch.tensor([[0.0, 100.0, 0.5, 90.0, 0.0, 3.0, 99.0]])  # too wide at τ = 1: NaN
    mask = torch.ones_like(h, dtype=torch.bool)
    steps = [threading.Event() for _ in range(4)]
    seen = []

    def thread_a():
        with _w.exact_windows():
            steps[0].set()  # A in
            steps[1].wait(10)  # B in, and B's check made
        steps[2].set()  # A out

    def thread_b():
        steps[0].wait(10)
        with _w.exact_windows():
            seen.append(torch.isfinite(pw.proximal_entropy(h, mask, window=3,
                                                           validate=False)).all())
            steps[1].set()
            steps[2].wait(10)
        steps[3].set()  # B out

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    steps[1].wait(10)
    mine = pw.proximal_entropy(h, mask, window=3, validate=False)  # B inside (A maybe out)
    for t in threads:
        t.join(10)
    assert all(e.is_set() for e in steps) and seen == [True]  # B itself was on the exact path
    assert torch.isnan(mine).all()
    assert torch.isnan(pw.proximal_entropy(h, mask, window=3, validate=False)).all()  # after


@pytest.mark.parametrize("fraction", [0.2, 0.5, 1.0, 1e-6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_topk_selects_what_torch_quantile_selects(fraction, seed):
    """The device-side count and threshold against ``torch.quantile`` of the valid scores (the
    loop reference of tests/reference.py), with ties (scores rounded to 1/8) and ``-0.0``
    beside ``0.0``. Catches an off-by-one in ``k``, a threshold read at the wrong rank of the
    ``topk``, masked scores counted, or ties split."""
    adv, ent, mask = ragged_batch([0, 3, 11, 20, 20, 6], 20, holes=True, seed=seed)
    ent = torch.round(ent * 8) / 8
    ent[1, :] = torch.where(mask[1], -0.0, ent[1])
    s = pw.get_strategy("global_topk", fraction=fraction)
    got = s(adv, ent, mask, validate=False)
    want = ref.global_topk(adv.numpy(), torch.where(mask, ent, 0).numpy(), mask.numpy(),
                           fraction)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))
    thr = torch.quantile(ent[mask].double(), 1 - fraction)
    assert torch.equal(got != 0, mask & (ent >= thr) & (adv[:, None] != 0))


def test_global_topk_on_an_all_masked_batch_and_the_selected_tokens_scale():
    """No valid token: all zeros (no threshold exists). ``selected_tokens``: the selected
    advantages scaled by N_valid / N_selected, computed on the device."""
    adv, ent, mask = ragged_batch([0, 0], 5)
    for normalize in ("all_tokens", "selected_tokens"):
        out = pw.get_strategy("global_topk", normalize=normalize)(adv, ent, mask, validate=False)
        assert torch.equal(out, torch.zeros(2, 5))
    adv, ent, mask = ragged_batch([10, 7, 3], 10, seed=3)
    out = pw.get_strategy("global_topk", fraction=0.25, normalize="selected_tokens")(
        adv, ent, mask, validate=False)
    plain = pw.get_strategy("global_topk", fraction=0.25)(adv, ent, mask)
    n_sel = int((plain != 0).sum())
    torch.testing.assert_close(out, plain * (20 / n_sel))


def test_gtpo_group_ids_need_not_be_contiguous_or_sorted():
    """GTPO renumbers groups on the device (a sort, no ``torch.unique``): ids 900 / -5 / 3 in
    any order give what ids 0 / 1 / 2 give. Catches a renumbering that depends on the ids'
    order or leaks one group's statistics into another."""
    adv, ent, mask = ragged_batch([4, 9, 2, 7, 7, 3], 9, holes=True, seed=8)
    positive = torch.tensor([True, False, True, False, False, True])
    s = pw.get_strategy("gtpo")
    a = s(adv, ent, mask, positive=positive, groups=torch.tensor([900, -5, 900, 3, -5, 3]),
          validate=False)
    b = s(adv, ent, mask, positive=positive, groups=torch.tensor([0, 1, 0, 2, 1, 2]))
    assert torch.equal(a, b)
    want = ref.gtpo(ent.numpy(), mask.numpy(), positive.numpy(),
                    np.array([0, 1, 0, 2, 1, 2]), 1.0, 0.1, 1e-8, "group")
    np.testing.assert_allclose(a.numpy(), want, rtol=1e-5, atol=1e-6)


def test_group_advantages_unvalidated_gives_nan_for_a_bad_group_only():
    """Without validation a non-finite reward makes its own group NaN (never a finite guess:
    an all-inf group would otherwise count as degenerate and get 0) and leaves the others."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, math.inf, math.inf, 0.0, 1.0])
    out = group_advantages(r, 2, validate=False)
    assert torch.isnan(out[4:6]).all()
    want = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2)
    assert torch.equal(out[[0, 1, 2, 3, 6, 7]], want)
    with pytest.raises(ValueError, match="rewards holds 2 NaN/inf"):
        group_advantages(r, 2)


def test_check_finite_is_the_deprecated_name_of_validate():
    """The old keyword still works, warns, and means the same switch."""
    adv, ent, mask = ragged_batch([3, 2], 3)
    ent[0, 0] = math.nan
    s = pw.get_strategy("entropy_bonus")
    with pytest.warns(FutureWarning, match="use validate="):
        assert torch.isnan(s(adv, ent, mask, check_finite=False)[0, 0])
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="NaN/inf"):
        s(adv, ent, mask, check_finite=True)


@pytest.mark.parametrize("sort", [True, False])
def test_global_topk_both_threshold_paths_select_the_same_and_read_nothing(sort, monkeypatch):
    """The full sort (CUDA's path) and the ``topk`` of the shape's bound (the CPU's) each give
    ``torch.quantile``'s selection and make no host read (meta tensors); the device decides
    which runs, so this forces each. Catches a sort path read at the wrong rank, untested on a
    CPU otherwise."""
    from pepo import _topk

    monkeypatch.setattr(_topk, "full_sort", lambda scores: sort)
    for seed, fraction in [(0, 0.2), (1, 0.5), (2, 1.0), (3, 1e-6)]:
        adv, ent, mask = ragged_batch([0, 3, 11, 20, 20, 6], 20, holes=True, seed=seed)
        ent = torch.round(ent * 8) / 8
        got = pw.get_strategy("global_topk", fraction=fraction)(adv, ent, mask, validate=False)
        thr = torch.quantile(ent[mask].double(), 1 - fraction)
        assert torch.equal(got != 0, mask & (ent >= thr) & (adv[:, None] != 0))
    adv, ent, mask, _, _ = _cpu_batch()
    with _HostReads(monkeypatch) as reads:
        pw.get_strategy("global_topk")(adv, ent, mask, validate=False)
    assert reads.count == 0
    if META:
        adv, ent, mask, _, _ = _meta_batch()
        out = pw.get_strategy("global_topk")(adv, ent, mask, validate=False)
        assert out.device.type == "meta"


def test_the_wide_row_rule_scales_with_the_temperature():
    """A row spanning 39.5 nats at τ = 0.4 (98.75 in units of τ) is beyond the shifted exp's
    range: validated it is redone in the log domain and exact; unvalidated it is NaN. Catches
    the width judged in nats rather than in units of τ (the shifted exp's denormals then gave
    values 4e-3 off, validated or not)."""
    h = torch.tensor([[0.0, 0.3, 0.6, 0.0, 0.45, 39.5]])
    mask = torch.ones_like(h, dtype=torch.bool)
    want = torch.tensor(ref.proximal_entropy_row(h[0].double().numpy(), 3, 0.4))[None]
    got = pw.proximal_entropy(h, mask, window=3, temperature=0.4)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-30)
    assert torch.isnan(pw.proximal_entropy(h, mask, window=3, temperature=0.4,
                                           validate=False)).all()


def test_a_constant_row_of_large_entropies_is_uniform_unvalidated():
    """Eq. (6)'s softmax is shift-invariant: a row of H = 100 everywhere is 1/W at every token,
    also on the unvalidated path (exp(100) overflows fp32 unless each row is shifted by its
    largest value first). Catches the shift dropped."""
    h = torch.full((1, 5), 100.0)
    got = pw.proximal_entropy(h, torch.ones_like(h, dtype=torch.bool), window=3, validate=False)
    torch.testing.assert_close(got, torch.full((1, 5), 1 / 3))


def test_gtpo_rewards_and_the_building_blocks_read_nothing_unvalidated(monkeypatch):
    """``gtpo_rewards(validate=False)`` and the public building blocks read no value on the
    host (a user strategy calls them on the sync-free path), and ``gtpo_rewards`` validated
    reads once. Catches a value check added to ``normalize_to_length`` (a sync in every user
    strategy) and a ``validate`` flag of ``gtpo_rewards`` that is ignored."""
    adv, ent, mask, positive, groups = _cpu_batch()
    with _HostReads(monkeypatch) as reads:
        pw.gtpo_rewards(ent, mask, positive, groups, validate=False)
        c = pw.normalize_to_length(torch.where(mask, ent, 0.0), mask)
        pw.weight_rows(adv, c, positive)
    assert reads.count == 0
    with _HostReads(monkeypatch) as reads:
        pw.gtpo_rewards(ent, mask, positive, groups)
    assert reads.count == 1
