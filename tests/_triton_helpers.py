"""What the Triton kernels' test files share: the device they run on and a call counter."""

from __future__ import annotations

import os

import pytest
import torch

from pepo import _triton

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None,
                                reason="needs a GPU, or TRITON_INTERPRET=1 on a CPU")


def count_calls(monkeypatch, name):
    """Wraps ``pepo._triton.<name>`` to record its calls: the list the calls append to."""
    calls = []
    real = getattr(_triton, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_triton, name, counted)
    return calls
