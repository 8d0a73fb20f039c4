"""global_topk with a process group: 2 gloo ranks select what their concatenation selects."""

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


def _worker(rank, world, init_file, out_dir, score):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        shard = _shards()[rank]
        strategy = pw.get_strategy(
            "global_topk", fraction=0.3, score=score, window=5, process_group=dist.group.WORLD,
            normalize="selected_tokens",
        )
        torch.save(strategy(*shard), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("score", ["entropy", "proximal"])
def test_two_ranks_equal_concatenation(score):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(2, init_file, tmp, score), nprocs=2, join=True)
        outs = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    (a0, e0, m0), (a1, e1, m1) = _shards()
    whole = pw.get_strategy("global_topk", fraction=0.3, score=score, window=5, normalize="selected_tokens")(
        torch.cat([a0, a1]), torch.cat([e0, e1]), torch.cat([m0, m1])
    )
    assert torch.equal(torch.cat(outs), whole)
    assert (whole != 0).any()
