"""Batch-global quantities with a process group: 2 gloo ranks holding uneven shards give what one
process holding their concatenation gives (global_topk's selection, the loss normaliser)."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pepo.weighting as pw
from tests.conftest import ragged_batch


def _shards():
    # Unequal shards (different B and T), ragged, with holes and ties across ranks.
    adv, ent, mask = ragged_batch([3, 17, 40, 1, 25], 40, holes=True, seed=31)
    ent = torch.where(mask, (ent * 4).round() / 4, ent)  # coarse values: many ties
    return (adv[:2], ent[:2, :40], mask[:2, :40]), (adv[2:], ent[2:, :40], mask[2:, :40])


def _leave():
    """Ends a worker whose output is saved, without destroying its process group. torch 2.2-2.4
    (the core's oldest supported releases, which CI tests) can deadlock freeing a gloo group:
    the destructor joins the group's worker thread while holding the GIL, and that thread waits
    for the GIL to free a finished collective's tensor (seen in about half the runs)."""
    os._exit(0)


def _save_and_leave(rank, out_dir, body):
    """Saves ``body()`` as this rank's output once every rank has one, then leaves."""
    try:
        torch.save(body(), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


def _worker(rank, world, init_file, out_dir, score, given):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def body():
        group = {"process_group": dist.group.WORLD}
        strategy = pw.get_strategy(
            "global_topk", fraction=0.3, score=score, window=5, normalize="selected_tokens",
            **(group if given == "built" else {}),
        )
        return strategy(*_shards()[rank], **(group if given == "called" else {}))

    _save_and_leave(rank, out_dir, body)


@pytest.mark.parametrize("score, given", [("entropy", "built"), ("proximal", "built"),
                                          ("proximal", "called")])
def test_two_ranks_equal_concatenation(score, given):
    """``given="called"``: the process group passed at the call, as ``groups`` is (what the
    recipe does); catches a Strategy that drops it there (each rank's own threshold)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(2, init_file, tmp, score, given), nprocs=2, join=True)
        outs = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    (a0, e0, m0), (a1, e1, m1) = _shards()
    whole = pw.get_strategy(
        "global_topk", fraction=0.3, score=score, window=5, normalize="selected_tokens"
    )(torch.cat([a0, a1]), torch.cat([e0, e1]), torch.cat([m0, m1]))
    assert torch.equal(torch.cat(outs), whole)
    assert (whole != 0).any()


def _all_sum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _loss_worker(rank, world, init_file, out_dir):
    from pepo.loss import clipped_policy_loss

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        lp, old, adv, mask = _loss_shards()[rank]
        lp = lp.clone().requires_grad_(True)
        loss = clipped_policy_loss(lp, old, adv, mask, num_tokens=_all_sum(mask.sum()))
        loss.backward()
        torch.save((_all_sum(loss.detach()), lp.grad), os.path.join(out_dir, f"loss{rank}.pt"))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


def _loss_shards():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(7, 12, generator=g) * 3
    lp = old + torch.randn(7, 12, generator=g) * 0.4
    adv = torch.randn(7, 12, generator=g)
    mask = torch.rand(7, 12, generator=g) > torch.linspace(0.1, 0.9, 7)[:, None]  # uneven rows
    cut = 2  # rank 0: 2 rows, rank 1: 5 rows, with different token counts
    return (
        (lp[:cut], old[:cut], adv[:cut], mask[:cut]),
        (lp[cut:], old[cut:], adv[cut:], mask[cut:]),
    )


def test_loss_normaliser_over_ranks_equals_one_process():
    """Each rank divides by the token count of the whole batch (summed over ranks): the
    ranks' losses add up to the one-process loss and each rank's gradient is its rows' part of
    the one-process gradient. Catches a rank dividing by its own count (the shards have
    different counts, so that would differ)."""
    from pepo.loss import clipped_policy_loss

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_loss_worker, args=(2, init_file, tmp), nprocs=2, join=True)
        outs = [torch.load(os.path.join(tmp, f"loss{r}.pt")) for r in range(2)]
    (l0, o0, a0, m0), (l1, o1, a1, m1) = _loss_shards()
    assert int(m0.sum()) != int(m1.sum())
    lp = torch.cat([l0, l1]).clone().requires_grad_(True)
    whole = clipped_policy_loss(lp, torch.cat([o0, o1]), torch.cat([a0, a1]), torch.cat([m0, m1]))
    whole.backward()
    for total, _ in outs:
        torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat([outs[0][1], outs[1][1]]), lp.grad, rtol=1e-6, atol=1e-8)


def _broken_worker(rank, world, init_file, out_dir, case):
    import datetime

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))

    def body():
        adv, ent, mask = _shards()[rank]
        strategy = pw.get_strategy("global_topk", fraction=0.3, score="proximal", window=5,
                                   normalize="selected_tokens", process_group=dist.group.WORLD)
        if case.startswith("nan") and rank == 0:
            ent = ent.clone()
            ent[tuple(mask.nonzero()[0])] = float("nan")  # a valid token's, on one rank only
        if case == "overflow" and rank == 0:  # finite inputs; the selected-token scale (1/0.3)
            adv = adv.sign() * 3e38  # takes the weighted output beyond float32
        try:
            return strategy(adv, ent, mask, validate=case in ("overflow", "nan_validated"))
        except ValueError as e:
            return str(e)

    _save_and_leave(rank, out_dir, body)


def _broken(case):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_broken_worker, args=(2, init_file, tmp, case), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


def test_a_nan_score_on_one_rank_makes_every_rank_nan():
    """As one process over the concatenation gives NaN everywhere (the threshold is the whole
    batch's). Catches a finiteness check per rank: the other rank returned finite weights
    from a threshold the NaN had moved."""
    outs = _broken("nan")
    for out, (_, _, mask) in zip(outs, _shards()):
        assert torch.isnan(out[mask]).all() and (out[~mask] == 0).all()


def test_a_validated_redo_on_one_rank_is_every_rank_s():
    """An overflow on rank 0 only (advantages of ±3e38 scaled): the validating call redoes the
    strategy, whose threshold takes 33 collectives. Catches a redo on that rank alone: gloo
    reported a collective mismatch and aborted. Now both redo; rank 0 refuses the overflow,
    rank 1 returns its redo's finite weights."""
    outs = _broken("overflow")
    assert isinstance(outs[0], str) and "overflow float32" in outs[0]
    assert isinstance(outs[1], torch.Tensor) and torch.isfinite(outs[1]).all()


def test_an_input_refused_on_one_rank_is_refused_on_every_rank():
    """A NaN entropy on rank 0 with validation: rank 0 raised, while rank 1 (whose output the
    NaN made NaN) asked for a redo and waited in its collectives for rank 0. Now every rank
    raises: rank 0 naming the NaN, rank 1 saying another rank's inputs were refused."""
    outs = _broken("nan_validated")
    assert outs[0].startswith("entropies holds 1 NaN/inf value(s) at valid"), outs[0]
    assert outs[1] == ("strategy 'global_topk': another rank's inputs were refused (its error "
                       "names them); the batch-wide result needs them all")


def test_the_bisections_integer_keys_order_as_the_scores_do():
    """Across ranks the threshold is bisected on integer keys of the fp32 scores: a negative
    score's bits order backwards, and -0.0 is +0.0. Catches negatives not reversed (with
    validate=False any score passes, and entropies down to -1e-4 pass the checks): the keys of
    sorted scores must be sorted, equal scores equal."""
    from pepo._topk import order_keys

    s = torch.tensor([-math.inf, -3.5, -1e-5, -2e-45, -0.0, 0.0, 1e-45, 1e-5, 2.5, math.inf])
    keys = order_keys(s)
    assert keys[4] == keys[5]  # -0.0 and +0.0
    assert (keys[1:] >= keys[:-1]).all() and (keys[1:] > keys[:-1]).sum() == len(s) - 2
    assert (keys >= 0).all() and (keys < 2**32).all()
