"""Finding, resolving and validating the recipe's configs.

* Bundled configs (``recipes/configs/*.yaml``, installed as ``pepo.configs``) are found by name:
  ``tune run pepo_recipe --config tiny``; a path to a YAML file works too.
* ``${pepo_asset:tiny}`` in a config resolves to the packaged asset directory ``tiny`` (the
  embedded task's tokenizer and warm-start checkpoint).
* :func:`validate_config` checks everything that can be checked without building a model and
  raises ``ValueError`` naming the key and value, so a bad config fails in a second, not after
  the model is loaded.
"""

from __future__ import annotations

import importlib
import importlib.resources
import inspect
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from pepo import weighting

__all__ = [
    "asset_dir",
    "check_checkpoint_dir",
    "find_config",
    "list_configs",
    "register_resolvers",
    "resolve_config_arg",
    "strategy_params",
    "tracker_kwargs",
    "validate_config",
]

ESTIMATORS = ("group", "single_stream")


def asset_dir(name: str) -> str:
    """Path of the packaged asset directory ``name`` (e.g. ``"tiny"``)."""
    path = Path(str(importlib.resources.files("pepo") / "assets" / name))
    if not path.is_dir():
        raise ValueError(f"no packaged asset {name!r} (looked in {path.parent})")
    return str(path)


def register_resolvers() -> None:
    """Registers ``${pepo_asset:NAME}`` with OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver("pepo_asset"):
        # omegaconf 2.4 renamed register_new_resolver (deprecated there) to register_resolver
        register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
        register("pepo_asset", asset_dir)


def _configs_dir() -> Path:
    return Path(str(importlib.resources.files("pepo.configs")))


def list_configs() -> list[str]:
    """Names of the bundled configs."""
    return sorted(p.stem for p in _configs_dir().glob("*.yaml"))


def find_config(name_or_path: str) -> str:
    """Path of a bundled config by name, or ``name_or_path`` itself when it is a file.

    Raises:
        ValueError: neither a file nor a bundled config name (the message lists the names).
    """
    if Path(name_or_path).is_file():
        return name_or_path
    bundled = _configs_dir() / f"{name_or_path}.yaml"
    if bundled.is_file():
        return str(bundled)
    raise ValueError(
        f"--config {name_or_path!r} is neither a file nor a bundled config; "
        f"bundled configs: {list_configs()}"
    )


def resolve_config_arg(argv: list[str]) -> list[str]:
    """``argv`` with the value after ``--config`` replaced by the bundled config's path when it
    is a name (what ``tune run pepo_recipe|pepo_eval --config tiny`` needs); exits with one line
    when it is neither a file nor a bundled name."""
    import sys

    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config") + 1
        if i < len(argv):
            try:
                argv[i] = find_config(argv[i])
            except ValueError as e:
                sys.exit(f"error: {e}")
    return argv


def tracker_kwargs(estimator: Any) -> dict[str, Any]:
    """The ``SingleStreamEstimator`` arguments among the ``estimator`` config's keys
    (``prior_samples: 0`` means no offline prior: the tracker's default)."""
    from pepo.estimators import SingleStreamEstimator

    accepted = set(inspect.signature(SingleStreamEstimator).parameters) - {"prior_pass_rates"}
    kwargs = {k: v for k, v in estimator.items() if k in accepted}
    if not kwargs.get("prior_samples"):
        kwargs.pop("prior_samples", None)
    return kwargs


def check_checkpoint_dir(ckpt: Any, key: str = "checkpoint_dir") -> None:
    """Raises ``ValueError`` unless ``ckpt`` holds ``model.safetensors`` or a sharded index."""
    if ckpt is None or not any(
        (Path(str(ckpt)) / f).is_file()
        for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise ValueError(
            f"{key}={ckpt!r} has no model.safetensors (nor model.safetensors.index.json)"
        )


def strategy_params(cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """The strategy name and its parameters: ``cfg.strategy.<name>`` (may be absent)."""
    name = cfg.strategy.name
    params = cfg.strategy.get(name)
    params = {} if params is None else OmegaConf.to_container(params, resolve=True)
    return name, params


def _require(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        raise ValueError(f"config key {key!r} is required")
    return value


def _int(cfg: DictConfig, key: str, minimum: int) -> int:
    value = _require(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an int >= {minimum}, got {value!r}")
    return value


def _float(cfg: DictConfig, key: str, low: float, high: Optional[float] = None) -> float:
    value = _require(cfg, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        low < value and (high is None or value <= high)
    ):
        bound = f"in ({low}, {high}]" if high is not None else f"> {low}"
        raise ValueError(f"{key} must be a number {bound}, got {value!r}")
    return float(value)


_RECIPE_ESTIMATOR_KEYS = {
    "group": {"name", "group_size", "normalize_std"},
    "single_stream": {"name", "candidate_pool", "prior_samples", "adaptive_forgetting"},
}


def _check_estimator_keys(cfg: DictConfig, est: str) -> None:
    """Unknown ``estimator.*`` keys are typos; single-stream tracker values are checked by
    building the tracker."""
    from pepo.estimators import SingleStreamEstimator

    tracker_keys = set(inspect.signature(SingleStreamEstimator).parameters) - {"prior_pass_rates"}
    allowed = _RECIPE_ESTIMATOR_KEYS[est] | (tracker_keys if est == "single_stream" else set())
    unknown = sorted(set(cfg.estimator) - allowed)
    if unknown:
        raise ValueError(
            f"unknown estimator key(s) {unknown} for estimator.name={est!r}; valid: {sorted(allowed)}"
        )
    if est == "single_stream":
        try:
            SingleStreamEstimator(**tracker_kwargs(cfg.estimator))
        except ValueError as e:
            raise ValueError(f"estimator: {e}") from None


def validate_config(cfg: DictConfig) -> None:
    """Checks the recipe config before anything is built.

    Raises:
        ValueError: naming the first bad key and its value.
    """
    for module in cfg.get("imports") or []:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"imports: cannot import {module!r}: {e}") from None
    name, params = strategy_params(cfg)
    try:
        weighting.get_strategy(name, **params)
    except ValueError as e:
        raise ValueError(f"strategy.name={name!r}: {e}") from None

    est = _require(cfg, "estimator.name")
    if est not in ESTIMATORS:
        raise ValueError(f"estimator.name must be one of {list(ESTIMATORS)}, got {est!r}")
    if est == "group":
        g = _require(cfg, "estimator.group_size")
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise ValueError(
                f"estimator.group_size must be an int >= 2 in group mode (advantages are "
                f"relative to the group), got {g!r}; use estimator.name=single_stream for one "
                f"rollout per prompt"
            )
        rollouts = g * _int(cfg, "prompts_per_step", 1)
    else:
        rollouts = _int(cfg, "prompts_per_step", 1)
        pool = cfg.estimator.get("candidate_pool", 1)
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"estimator.candidate_pool must be an int >= 1, got {pool!r}")
        prior = cfg.estimator.get("prior_samples", 0)
        if isinstance(prior, bool) or not isinstance(prior, int) or prior < 0:
            raise ValueError(f"estimator.prior_samples must be an int >= 0, got {prior!r}")
    _check_estimator_keys(cfg, est)

    minis = _int(cfg, "ppo_mini_batches", 1)
    micro = _int(cfg, "micro_batch_size", 1)
    if rollouts % minis:
        raise ValueError(
            f"ppo_mini_batches={minis} does not divide the {rollouts} rollouts of a step"
        )
    if (rollouts // minis) % micro:
        raise ValueError(
            f"micro_batch_size={micro} does not divide the mini-batch of {rollouts // minis} "
            f"rollouts ({rollouts} rollouts per step / ppo_mini_batches={minis})"
        )
    _int(cfg, "ppo_epochs", 1)
    _int(cfg, "num_steps", 1)
    _int(cfg, "generation.max_new_tokens", 1)
    _float(cfg, "generation.temperature", 0.0)
    _float(cfg, "generation.top_p", 0.0, 1.0)
    gen_bs = cfg.generation.get("batch_size")
    if gen_bs is not None and (isinstance(gen_bs, bool) or not isinstance(gen_bs, int) or gen_bs < 1):
        raise ValueError(f"generation.batch_size must be an int >= 1 or null, got {gen_bs!r}")
    top_k = cfg.generation.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generation.top_k must be an int >= 1 or null, got {top_k!r}")
    _float(cfg, "loss.eps_low", 0.0, 1.0)
    _float(cfg, "loss.eps_high", 0.0)
    _int(cfg, "max_nonfinite_steps", 1)
    _int(cfg, "validation.samples", 1)
    for key in ("validation.every", "save_every", "dump_rollouts_every"):
        _int(cfg, key, 0)
    if cfg.get("clip_grad_norm") is not None:
        _float(cfg, "clip_grad_norm", 0.0)

    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int (exact resume replays the seeded shuffle), got {seed!r}")
    for key in ("keep_checkpoints", "logprob_chunk_size"):
        if cfg.get(key) is not None:
            _int(cfg, key, 1)

    check_checkpoint_dir(_require(cfg, "checkpoint_dir"))
    tok = _require(cfg, "tokenizer.path")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (Path(tok) / f).is_file():
            raise ValueError(f"tokenizer.path={tok!r} has no {f}")
    if cfg.get("dtype", "fp32") not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {cfg.get('dtype')!r}")
