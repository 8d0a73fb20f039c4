"""Data parallelism for the recipe: the process group, its collectives, and FSDP2 sharding.

The recipe runs as one process (``tune run pepo_recipe``) or as N under torchrun
(``tune run --nproc_per_node N pepo_recipe``). :class:`Dist` hides the difference: with one
process its collectives are identities, so the step is one code path.

What makes a run independent of N (the same rollouts, rewards, losses and weights with 1 or N
processes, up to float reduction order):

* every rank holds the whole step's bookkeeping (prompt choice, estimator, RNG states) and the
  same generators, so it draws the same prompts and the same per-rollout sampling seeds;
* rank ``r`` generates, scores and trains on the contiguous slice ``r`` of the step's rollouts
  (whole prompt groups), and the rewards are gathered so that advantages and the estimator's
  update see the whole batch;
* mini-batches are drawn on the whole batch in tiles that never straddle two ranks
  (:func:`minibatch_indices`), and each loss is divided by the whole mini-batch's token count,
  with gradients summed (not averaged) across ranks.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
from typing import Any, NoReturn, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Dist", "exit_without_teardown", "minibatch_indices", "shard_model", "tile_rows",
           "unsharded"]


class Dist:
    """The data-parallel group this process belongs to (world size 1 without torchrun).

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl, one GPU per process).
        timeout_s: how long a collective may wait for the other ranks before it fails, so a rank
            that dies never leaves the others hanging (the recipe's
            ``distributed.timeout_s``, whose default the config schema holds).
        cpu_offload: with ``"cuda"``, the group also reduces CPU tensors (gloo beside nccl):
            FSDP2's CPU offload keeps the gradients there, and the gradient clip and the full
            state dict reduce them (nccl alone fails: no backend for the device type cpu).
    """

    def __init__(self, device_type: str = "cpu", *, timeout_s: float,
                 cpu_offload: bool = False) -> None:
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.timeout_s = float(timeout_s)
        self.group: Optional[Any] = None
        self._owns_group = False
        if dist.is_available() and dist.is_initialized():  # a group the caller set up
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        else:  # torchrun's environment, or one process
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
            self.rank = int(os.environ.get("RANK", "0"))
            if self.world_size > 1:
                backend = "gloo" if device_type != "cuda" else (
                    "cuda:nccl,cpu:gloo" if cpu_offload else "nccl")
                if device_type == "cuda":
                    torch.cuda.set_device(self.local_rank)
                dist.init_process_group(backend=backend,
                                        timeout=datetime.timedelta(seconds=timeout_s))
                self._owns_group = True
        if self.world_size > 1:
            self.group = dist.group.WORLD

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def grad_scale(self) -> float:
        """What a rank's loss is multiplied by before backward, so that FSDP's averaging over
        ranks gives the sum of their gradients."""
        return float(self.world_size)

    def device(self, device_type: str) -> torch.device:
        """This rank's device (``cuda:<local rank>`` for CUDA)."""
        if device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(device_type)

    def shard(self, n: int) -> slice:
        """Rank ``r``'s contiguous part of ``n`` items; parts differ in size by at most 1."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks (a new tensor)."""
        t = t.clone()
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors concatenated along dim 0, in rank order (sizes may differ)."""
        if not self.enabled:
            return t
        n = torch.tensor([t.shape[0]], device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on some rank."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0])
        if dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        return bool(self.max(t).item() > 0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def exit_without_teardown(code: Union[int, str] = 0) -> NoReturn:
    """Ends a process of a multi-process run that has closed what it opened: Python's output and
    logging flushed, then ``os._exit``, without the interpreter's teardown. ``code``: the exit
    status, or a message for standard error and status 1 (as ``sys.exit`` takes them).

    A process group's worker threads (gloo's) may still be releasing a finished collective's
    work when the interpreter finalizes; that work holds tensors Python saw, whose release takes
    the GIL, and a thread taking it during finalization is ended inside C++: ``terminate called
    without an active exception``, SIGABRT, a failed run for torchrun after the run finished
    (a two-process FSDP2 run here, torch 2.13: about 1 exit in 60; the core file shows
    ``ProcessGroupGloo::runLoop`` destroying an all-gather's work in ``take_gil`` while the main
    thread is in ``Py_FinalizeEx``). ``destroy_process_group`` does not prevent it: the group's
    threads live on while FSDP's state still refers to it."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader left
            pass
    os._exit(code if isinstance(code, int) else 1)


def tile_rows(rollouts_per_prompt: int, num_minibatches: int) -> int:
    """Rows per tile of :func:`minibatch_indices`: whole prompt groups, splittable into
    ``num_minibatches`` equal parts."""
    return math.lcm(rollouts_per_prompt, num_minibatches)


def minibatch_indices(n_rows: int, tile: int, num_minibatches: int,
                      generator: torch.Generator) -> list[torch.Tensor]:
    """The rows of each mini-batch: every tile of ``tile`` consecutive rows is shuffled and
    split into ``num_minibatches`` equal parts, part ``m`` of every tile going to mini-batch
    ``m``. Mini-batches are therefore balanced across the prompt groups, and across ranks that
    hold whole tiles, whatever their number. With one mini-batch: all rows in order.

    Shape: returns ``num_minibatches`` int64 tensors of ``n_rows / num_minibatches`` indices.
    """
    if num_minibatches == 1:
        return [torch.arange(n_rows)]
    if n_rows % tile or tile % num_minibatches:
        raise ValueError(f"{n_rows} rows do not split into tiles of {tile} rows and "
                         f"{num_minibatches} mini-batches")
    tiles = n_rows // tile
    perm = torch.argsort(torch.rand(tiles, tile, generator=generator), dim=1)  # [tiles, tile]
    rows = perm + torch.arange(tiles)[:, None] * tile
    part = tile // num_minibatches
    return [rows[:, m * part : (m + 1) * part].reshape(-1) for m in range(num_minibatches)]


def shard_model(model: nn.Module, layer_types: tuple[type, ...], *, cpu_offload: bool = False,
                mixed_precision: Optional[torch.dtype] = None) -> None:
    """FSDP2: ``fully_shard`` every module of ``layer_types`` (the decoder layers), then the
    root. FSDP averages gradients over ranks; the recipe multiplies each rank's loss by the
    world size (:attr:`Dist.grad_scale`), so the result is their sum, the gradient of the whole
    batch's loss (already normalised by the whole batch's token count). A divide factor of 1
    would say the same, but gloo has no pre-multiplied reduction to carry it.

    Args:
        cpu_offload: keep parameters, gradients and optimizer state on the CPU.
        mixed_precision: compute dtype (e.g. ``torch.bfloat16``) over fp32 parameters, with
            gradients reduced in fp32; None keeps the parameters' dtype.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision,
                                                   reduce_dtype=torch.float32)
    for module in reversed(list(model.modules())):
        if isinstance(module, layer_types):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


class unsharded:
    """Context in which an FSDP2 model's parameters stay gathered across forwards (decoding:
    one all-gather per rollout phase, not per token, and ranks may then decode different
    numbers of tokens). A no-op for a model that is not sharded."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules: Sequence[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self) -> "unsharded":
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in self.modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
