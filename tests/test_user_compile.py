"""The core inside a user's ``torch.compile`` on a CPU (inductor, its C++ backend), as users
of the field compile their training step around it. Collected where torch has
``torch.compile`` (not 1.13) and a C++ compiler is installed (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import pepo.weighting as pw
from tests.conftest import ragged_batch


@pytest.mark.slow  # inductor compiles six graphs: 20-40 s on 2 cores
def test_compiled_proximal_strategies_follow_the_batch_shape(tmp_path, monkeypatch):
    """A compiled step over batches of three shapes, at a temperature other than 1, gives the
    eager values at each. Catches the padded buffer filled by ``torch.mul(out=view)``: the graph
    broke there and inductor fixed the buffer's size to an earlier shape ("expected size
    808==1818" at the third shape, or at the first with a warm cache)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, as in a fresh venv
    torch._dynamo.reset()
    strategies = [pw.get_strategy("proximal_softmax", window=3, temperature=0.5),
                  pw.get_strategy("global_topk", score="proximal", window=3, temperature=2.0)]
    for s in strategies:
        step = torch.compile(lambda a, e, m, s=s: s(a, e, m, validate=False))
        for seed, (lengths, t) in enumerate([([6, 9, 2, 9, 5, 1], 9),
                                             ([13, 4, 0, 13, 7, 11, 3, 12, 9], 13),
                                             ([7, 2, 5, 6], 7)]):
            adv, ent, mask = ragged_batch(lengths, t, holes=True, seed=seed)
            ent = ent * 3
            torch.testing.assert_close(step(adv, ent, mask), s(adv, ent, mask),
                                       rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
