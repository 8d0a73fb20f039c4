"""What only a GPU run meets, checked on a CPU: the process group's backends and the device the
rollout engine reads (a device mix shows only where there are two devices)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pepo.training import distributed
from pepo.training.distributed import Dist


@pytest.mark.parametrize("device_type,cpu_offload,backend", [
    ("cuda", False, "nccl"),
    ("cuda", True, "cuda:nccl,cpu:gloo"),
    ("cpu", False, "gloo"),
])
def test_the_group_reduces_cpu_tensors_under_cpu_offload(monkeypatch, device_type,
                                                         cpu_offload, backend):
    """FSDP2's CPU offload keeps the gradients on the CPU, and the gradient clip and the full
    state dict reduce them: an nccl-only group fails there ("no backend type associated with
    device type cpu"). Catches ``cpu_offload`` ignored, and gloo added where nothing needs it
    (it can fail to connect where only nccl is set up)."""
    started = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, timeout: started.update(backend=backend))
    monkeypatch.setattr(distributed.dist, "group", type("G", (), {"WORLD": "world"}))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: started.update(cuda=i))
    d = Dist(device_type, timeout_s=60.0, cpu_offload=cpu_offload)
    assert started["backend"] == backend
    assert started.get("cuda") == (1 if device_type == "cuda" else None)
    assert (d.world_size, d.rank, d.group) == (2, 1, "world")


def test_the_inprocess_engine_reads_the_device_of_the_gathered_model(monkeypatch):
    """Under CPU offload the shards sit on the CPU and :func:`unsharded` gathers them on the GPU:
    the autocast and an empty share's rollouts must take the gathered parameters' device.
    The gather is simulated here by moving the parameters to the meta device inside
    ``unsharded``. Catches the device read before the gather (CPU autocast around a GPU decode:
    a bf16 trainer's rollouts sampled at another precision, seen only in the log-prob gap)."""
    from pepo.training import precision
    from pepo.training.engines import InProcessEngine

    model = torch.nn.Linear(2, 2)
    seen = []

    @contextlib.contextmanager
    def gathered(m):
        cpu = m.weight
        m.weight = torch.nn.Parameter(torch.empty_like(cpu, device="meta"))
        try:
            yield
        finally:
            m.weight = cpu

    def autocast(device, dtype):
        seen.append((device, dtype))
        return contextlib.nullcontext()

    monkeypatch.setattr(distributed, "unsharded", gathered)
    monkeypatch.setattr(precision, "autocast", autocast)
    ro = InProcessEngine(model, compute_dtype=torch.bfloat16).generate([])
    assert seen == [(torch.device("meta"), torch.bfloat16)]
    assert ro.tokens.device.type == "meta" and ro.tokens.shape[0] == 0
    assert model.weight.device.type == "cpu"
