"""The data-parallel pieces of ``pepo.training.distributed`` on their own: each rank's share of
a list, the mini-batches' rows, and the group's collectives on two gloo ranks holding shares
of unequal size. The whole-run tests (tests/recipes/test_distributed.py) compare two processes
with one, which both call these same functions: a wrong share or mini-batch split made the
same way in both passes there."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pepo.training.distributed import Dist, minibatch_indices, tile_rows


def _rank(rank: int, world: int) -> Dist:
    """A Dist of ``world`` ranks seen from ``rank``, without a process group (``shard`` reads
    only the two numbers)."""
    d = Dist.__new__(Dist)
    d.world_size, d.rank = world, rank
    return d


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_the_ranks_shares_split_a_list_in_order_and_differ_by_at_most_one(world):
    """Catches a remainder given to the last rank (shares of 1, 1, 3 for 5 items over 3 ranks),
    a share skipped or counted twice (``min(rank, extra)`` as ``extra``), and a share one item
    off (``rank <= extra``). For every length 0-20: the shares, in rank order, are the list."""
    for n in range(21):
        shares = [list(range(n))[_rank(r, world).shard(n)] for r in range(world)]
        assert [i for s in shares for i in s] == list(range(n))
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_tile_holds_whole_groups_and_splits_into_the_mini_batches():
    """Catches the product (or either number alone) for the least common multiple."""
    for g in range(1, 13):
        for m in range(1, 9):
            t = tile_rows(g, m)
            assert t % g == 0 and t % m == 0 and t == g * m // math.gcd(g, m)


def _reference_minibatches(n_rows, tile, num_minibatches, seed):
    """The docstring written out row by row: tile ``k``'s rows shuffled by the argsort of its
    own row of ``torch.rand(tiles, tile)``, then cut into ``num_minibatches`` parts in order,
    part ``m`` of every tile (tiles in order) making mini-batch ``m``."""
    draws = torch.rand(n_rows // tile, tile, generator=torch.Generator().manual_seed(seed))
    out = [[] for _ in range(num_minibatches)]
    part = tile // num_minibatches
    for k in range(n_rows // tile):
        order = sorted(range(tile), key=lambda j: draws[k, j].item())
        shuffled = [k * tile + j for j in order]
        for m in range(num_minibatches):
            out[m] += shuffled[m * part:(m + 1) * part]
    return out


@pytest.mark.parametrize("n_rows, group, minis", [(24, 4, 2), (36, 6, 4), (30, 5, 3),
                                                  (16, 8, 8), (12, 3, 1)])
def test_mini_batches_take_an_equal_part_of_every_tile(n_rows, group, minis):
    """Catches a tile's rows offset by the part size instead of the tile size (rows of one tile
    in two), the parts cut from the whole batch's shuffle (a mini-batch of one prompt group's
    rows only), another generator's draws, and one mini-batch not the rows in order."""
    tile = tile_rows(group, minis)
    got = minibatch_indices(n_rows, tile, minis, torch.Generator().manual_seed(5))
    if minis == 1:
        assert [x.tolist() for x in got] == [list(range(n_rows))]
        return
    assert [x.tolist() for x in got] == _reference_minibatches(n_rows, tile, minis, 5)
    assert all(x.dtype == torch.int64 for x in got)
    assert sorted(torch.cat(got).tolist()) == list(range(n_rows))  # each row once
    for x in got:  # tile // minis rows of every tile
        assert torch.bincount(x // tile, minlength=n_rows // tile).tolist() == (
            [tile // minis] * (n_rows // tile))
    again = minibatch_indices(n_rows, tile, minis, torch.Generator().manual_seed(6))
    assert any(not torch.equal(a, b) for a, b in zip(got, again))  # the generator is read
    with pytest.raises(ValueError, match=f"{n_rows + 1} rows do not split into tiles"):
        minibatch_indices(n_rows + 1, tile, minis, torch.Generator())


def _collectives(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        d = Dist("cpu", timeout_s=60)  # the caller's group
        rows = torch.arange(3 * (rank + 2), dtype=torch.float32).reshape(rank + 2, 3) + 100 * rank
        out = {"world": (d.world_size, d.rank, d.enabled, d.is_main, d.grad_scale),
               "gather": d.gather(rows), "empty": d.gather(rows[:0] if rank == 0 else rows),
               "objects": d.gather_objects({"rank": rank}),
               "any": (d.any(rank == 1), d.any(False)),
               "sum": d.sum(torch.tensor([1.0, rank])), "max": d.max(torch.tensor([rank, 5.0]))}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # as tests/test_weighting_distributed.py leaves: a gloo group's teardown can hang


def test_the_groups_collectives_on_two_ranks_of_unequal_shares():
    """Rank 0 holds 2 rows, rank 1 holds 3: catches ``gather`` returning the padded rows (or
    rank 0's size for both), losing an empty share, a rank's order swapped; ``any`` true only
    where the flag is set; ``sum`` / ``max`` not reduced; the loss scale not the world size."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_collectives, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        outs = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    shares = [torch.arange(3 * (r + 2), dtype=torch.float32).reshape(r + 2, 3) + 100 * r
              for r in range(2)]
    for r, out in enumerate(outs):
        assert out["world"] == (2, r, True, r == 0, 2.0)
        assert torch.equal(out["gather"], torch.cat(shares))
        assert torch.equal(out["empty"], shares[1])
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert out["any"] == (True, False)
        assert torch.equal(out["sum"], torch.tensor([2.0, 1.0]))
        assert torch.equal(out["max"], torch.tensor([1.0, 5.0]))
