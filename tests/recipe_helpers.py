"""Tiny models, checkpoints and rewards for in-process recipe tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from pepo.training.config import find_config, register_resolvers
from pepo.training.models import tiny_qwen3

MODEL_OVERRIDES = {"embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                   "intermediate_dim": 64, "head_dim": 16}


class DigitReward:
    """A reward that varies across random responses: the share of digits among the chars."""

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]


class ConstantReward:
    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [1.0] * len(responses)


class BadReward:
    """Returns ``value`` for the last response (a user's bug: None, a string, 1e300, NaN)."""

    def __init__(self, value: Any):
        self.value = value

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list:
        return [0.5] * (len(responses) - 1) + [self.value]


def random_checkpoint(path: Path, seed: int = 0, **model_overrides) -> Path:
    torch.manual_seed(seed)
    model = tiny_qwen3(**{**MODEL_OVERRIDES, **model_overrides})
    with torch.no_grad():  # small init, as Hugging Face's: a near-uniform, diverse policy
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    return path


def tiny_cfg(tmp_path: Path, name: str = "tiny", **overrides):
    """The bundled config ``name`` shrunk to a random 1-layer model and a few rollouts."""
    register_resolvers()
    cfg = OmegaConf.load(find_config(name))
    shape = {k: v for k, v in (overrides.get("model") or {}).items() if k != "_component_"}
    ckpt = random_checkpoint(tmp_path / "init", **shape)
    base = {
        "output_dir": str(tmp_path / "run"),
        "checkpoint_dir": str(ckpt),
        "model": {"_component_": "pepo.training.models.tiny_qwen3", **MODEL_OVERRIDES},
        "dataset": {"size": 64},
        "val_dataset": {"size": 4},
        "reward": {"_component_": "tests.recipe_helpers.DigitReward"},
        "generation": {"max_new_tokens": 12},
        "num_steps": 2,
        "prompts_per_step": 2,
        "micro_batch_size": 4,
        "validation": {"every": 0, "samples": 2},
        "save_every": 1,
        "dump_rollouts_every": 1,
        "plot": False,
        "optimizer": {"lr": 1e-2},
    }
    if name == "tiny":
        base["estimator"] = {"group_size": 4}
    else:
        base["prompts_per_step"] = 8
        base["estimator"] = {"prior_samples": 1, "candidate_pool": 2}
        base["dataset"] = {"size": 16}
    cfg = OmegaConf.merge(cfg, base, overrides)
    return cfg


class VerifiedDigitReward:
    """A varying reward that also runs math-verify in MathVerify's worker processes: half the
    share of digits, half the verifier's score. The workers' PIDs are appended to the file named
    by ``PEPO_TEST_WORKER_PIDS`` (if set), so fault tests can check none outlives its trainer."""

    def __init__(self):
        import os

        from pepo.tasks.rewards import MathVerify

        self._verify = MathVerify(timeout=2, workers=1)
        self._pid_file = os.environ.get("PEPO_TEST_WORKER_PIDS")

    def __call__(self, responses, answers):
        verified = self._verify(responses, answers)
        if self._pid_file:
            with open(self._pid_file, "a") as f:
                f.write("".join(f"{pid}\n" for pid in self._verify.pids))
        digits = DigitReward()(responses, answers)
        return [0.5 * d + 0.5 * v for d, v in zip(digits, verified)]

    def close(self):
        self._verify.close()
