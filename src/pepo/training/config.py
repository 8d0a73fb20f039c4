"""Finding, resolving and validating the recipe's configs.

* Bundled configs (``recipes/configs/*.yaml``, installed as ``pepo.configs``) are found by name:
  ``tune run pepo_recipe --config tiny``; a path to a YAML file works too.
* ``${pepo_asset:tiny}`` in a config resolves to the packaged asset directory ``tiny`` (the
  embedded task's tokenizer and warm-start checkpoint); ``${pepo_pretrained:smollm2}`` to a real
  pretrained model's HF checkpoint, converted from its package into the cache on first use.
* :func:`validate_config` checks everything that can be checked without building a model and
  raises ``ValueError`` naming the key and value, so a bad config fails in a second, not after
  the model is loaded. The config is a schema: a key the recipe does not know (a typo such as
  ``num_stepz`` or ``strategy.proximal_sofmax``) is an error naming it and the closest valid
  key. ``_component_`` sections are exempt: their arguments are checked by the callables they
  name. A top-level key that the config uses as ``${key}`` is a variable, not a typo.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import inspect
import os
import importlib.resources
import importlib.util
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from pepo import estimators, weighting
from pepo.loss import check_clip_range

__all__ = [
    "asset_dir",
    "build",
    "check_checkpoint_dir",
    "check_device",
    "check_engine",
    "check_keys",
    "check_metric_logger",
    "check_output_dir",
    "config_error_exit",
    "check_world_size",
    "engine_options",
    "estimator_kwargs",
    "experiment_config",
    "experiment_changes",
    "find_config",
    "list_configs",
    "prior_fingerprint",
    "register_resolvers",
    "resolve_config_arg",
    "strategy_params",
    "validate_config",
]


def asset_dir(name: str) -> str:
    """Path of the packaged asset directory ``name`` (e.g. ``"tiny"``)."""
    path = Path(str(importlib.resources.files("pepo") / "assets" / name))
    if not path.is_dir():
        raise ValueError(f"no packaged asset {name!r} (looked in {path.parent})")
    return str(path)


def pretrained(name: str) -> str:
    """``${pepo_pretrained:NAME}``: the HF checkpoint directory of a pretrained model that ships
    in a package (:mod:`pepo.training.pretrained`), converted into the cache on first use."""
    from pepo.training.pretrained import pretrained_dir

    return pretrained_dir(name)


def register_resolvers() -> None:
    """Registers ``${pepo_asset:NAME}`` and ``${pepo_pretrained:NAME}`` with OmegaConf
    (idempotent)."""
    # omegaconf 2.4 renamed register_new_resolver (deprecated there) to register_resolver
    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    if not OmegaConf.has_resolver("pepo_asset"):
        register("pepo_asset", asset_dir)
    if not OmegaConf.has_resolver("pepo_pretrained"):
        # cached by OmegaConf per config (use_cache): the directory is checked once per run
        register("pepo_pretrained", pretrained, use_cache=True)


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


def config_error_exit(error: Exception) -> None:
    """Exits with one ``config error:`` line, printed once: under torchrun every process
    checks the same config and finds the same error, so only rank 0 prints it (the others exit
    with status 1 in silence; torchrun then adds its own summary of the failed processes)."""
    import sys

    if os.environ.get("RANK", "0") != "0":
        sys.exit(1)
    sys.exit(f"config error: {error}")


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


def estimator_kwargs(cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """The estimator name and its keyword arguments: the ``estimator`` section without ``name``."""
    section = OmegaConf.to_container(cfg.estimator, resolve=True)
    name = section.pop("name", None)
    return name, section


def check_checkpoint_dir(ckpt: Any, key: str = "checkpoint_dir") -> None:
    """Raises ``ValueError`` unless ``ckpt`` holds ``model.safetensors`` or a sharded index."""
    if ckpt is None:
        raise ValueError(f"config key {key!r} is required")
    if not Path(str(ckpt)).exists():
        raise ValueError(f"{key}={str(ckpt)!r} does not exist")
    if not Path(str(ckpt)).is_dir():
        raise ValueError(f"{key}={str(ckpt)!r} is a file, not a checkpoint directory")
    if not any(
        (Path(str(ckpt)) / f).is_file()
        for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise ValueError(
            f"{key}={ckpt!r} has no model.safetensors (nor model.safetensors.index.json)"
        )


def build(cfg: DictConfig, key: str, *args: Any, **kwargs: Any) -> Any:
    """``config.instantiate(cfg[key], *args, **kwargs)``, with the arguments a component does
    not take (a ``TypeError`` from its constructor) reported as a ``ValueError`` naming the
    config section."""
    from torchtune import config as tune_config

    try:
        return tune_config.instantiate(cfg[key], *args, **kwargs)
    except TypeError as e:
        raise ValueError(f"{key}: {cfg[key].get('_component_')} {e}") from None


# torchtune's metric loggers and the package each imports when it is built (they fail with a
# traceback, and a second one from their __del__, when it is missing)
METRIC_LOGGER_PACKAGES = {
    "TensorBoardLogger": ("tensorboard", "tensorboard"),
    "WandBLogger": ("wandb", "wandb"),
    "CometLogger": ("comet_ml", "comet_ml"),
    "MLFlowLogger": ("mlflow", "mlflow"),
}


def check_metric_logger(section: Any) -> None:
    """Raises ``ValueError`` naming the package to install when ``metric_logger`` is one of
    torchtune's loggers whose package is not installed (checked before anything is built)."""
    if section is None:
        return
    component = str(section.get("_component_", ""))
    need = METRIC_LOGGER_PACKAGES.get(component.rsplit(".", 1)[-1])
    if need is None:
        return
    module, package = need
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"metric_logger: {component} needs the {package!r} package, which is not "
                         f"installed: pip install {package}")


def engine_options(generation: Any) -> tuple[str, dict[str, Any]]:
    """The rollout engine's name and options: ``generation.engine`` (default ``torchtune``) and
    the ``generation.vllm`` section (the vLLM engine's keyword arguments)."""
    name = generation.get("engine") or "torchtune"
    options = generation.get("vllm")
    options = {} if options is None else OmegaConf.to_container(options, resolve=True)
    return name, options


def check_engine(generation: Any, where: str = "generation") -> None:
    """Raises ``ValueError`` for an unknown engine, vLLM not installed (naming the extra to
    install), or an unknown ``generation.vllm`` key."""
    from pepo.training.engines import VLLMEngine, check_engine_available

    name, options = engine_options(generation)
    check_engine_available(name)
    valid = set(inspect.signature(VLLMEngine).parameters) - {"model", "hf_dir", "seed"}
    for key in options:
        if key not in valid:
            raise _unknown(str(key), valid, f"{where}.vllm.")


def check_world_size(cfg: DictConfig, world_size: int) -> None:
    """Raises ``ValueError`` unless the step's batch splits evenly over ``world_size``
    processes: whole prompt groups per process, and every process's share of each mini-batch
    a whole number of micro-batches (with the same number of forwards on every process, which
    FSDP2's collectives need)."""
    from pepo.training.distributed import tile_rows

    if world_size == 1:
        return
    est, kwargs = estimator_kwargs(cfg)
    per_prompt = estimators.build_estimator(est, **kwargs).rollouts_per_prompt
    prompts, minis, micro = cfg.prompts_per_step, cfg.ppo_mini_batches, cfg.micro_batch_size
    rows = prompts * per_prompt
    tile = tile_rows(per_prompt, minis)
    if prompts % world_size or (rows // world_size) % tile:
        raise ValueError(
            f"prompts_per_step={prompts} does not split over {world_size} processes in whole "
            f"tiles of {tile} rollouts (prompt groups split into ppo_mini_batches={minis} parts)"
        )
    if (rows // world_size // minis) % micro:
        raise ValueError(
            f"micro_batch_size={micro} does not divide a process's share of a mini-batch "
            f"({rows // world_size // minis} rollouts with {world_size} processes)"
        )


def check_device(device: Any) -> None:
    """Raises ``ValueError`` for a CUDA device on a machine without one (torch would otherwise
    run on the CPU without a word)."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but CUDA is not available here (torch {torch.__version__}); "
            f"use device=cpu, or a CUDA build of torch on a machine with a GPU"
        )


def check_output_dir(path: Any, key: str = "output_dir") -> None:
    """Raises ``ValueError`` unless ``path`` is, or can be created as, a writable directory.

    The check creates what is missing and writes a probe file (then removes both), so that what
    only the attempt reveals, such as a symbolic link to a scratch mount that is not mounted, a
    link loop, a read-only file system or a place nothing can be created (``/proc``), is one line
    here instead of a traceback once the run has started."""
    if path is None:
        raise ValueError(f"config key {key!r} is required")
    p = Path(os.path.abspath(str(path)))
    for a in (p, *p.parents):
        if a.is_symlink():
            try:
                a.resolve(strict=True)
            except (OSError, RuntimeError) as e:  # 3.11 raises RuntimeError for a loop
                loop = isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP
                raise ValueError(
                    f"{key}={str(path)!r}: {a} is a symbolic link to {os.readlink(a)}, which "
                    + ("loops back on itself" if loop else "does not exist (not mounted yet?)")
                ) from None
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ValueError(f"{key}={str(path)!r} cannot be a directory: {existing} is a file")
    missing = [a for a in (p, *p.parents) if not a.exists()]
    try:
        for attempt in range(3):
            p.mkdir(parents=True, exist_ok=True)
            try:
                fd, probe = tempfile.mkstemp(prefix=".pepo_probe_", dir=p)
                break
            except FileNotFoundError:
                # the processes of one torchrun launch check the same path at once, and one's
                # clean-up below can remove the directory between another's mkdir and its probe
                if attempt == 2 or p.exists():
                    raise
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = e.filename or existing
        raise ValueError(f"{key}={str(path)!r} is not a writable directory: {where}: "
                         f"{e.strerror or e}") from None
    finally:
        for a in missing:  # deepest first: leave nothing behind (the run creates it later)
            try:
                a.rmdir()
            except OSError:
                break


# Keys a resume may change: where things go and how often, memory settings that do not change
# the numbers beyond float reduction order, and the paths of the initial model (superseded by
# the checkpoint). Everything else defines the experiment. `num_steps` is checked on its own.
RESUME_MAY_CHANGE = (
    "name", "output_dir", "resume_from_checkpoint", "imports", "checkpoint_dir",
    "tokenizer.path", "model.model_dir", "num_steps", "validation", "val_dataset",
    "save_every", "keep_checkpoints", "keep_best", "dump_rollouts_every", "plot", "metric_logger",
    "generation.batch_size", "generation.compile", "micro_batch_size", "prior_cache",
    "logprob_chunk_size", "logprobs_from_hidden", "enable_activation_checkpointing", "max_nonfinite_steps",
    "reward.workers",
)


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether flattened ``key`` is one of ``prefixes`` or inside one of their sections."""
    return any(key == m or key.startswith(m + ".") for m in prefixes)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def experiment_config(cfg: DictConfig) -> dict[str, Any]:
    """The keys that define the experiment (resolved, flattened ``a.b.c``), saved in each
    checkpoint so that a resume cannot silently change them."""
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if not _under(k, RESUME_MAY_CHANGE)}


def experiment_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key (saved -> current)`` for every experiment key that differs."""
    return [f"{k} ({saved.get(k, '<unset>')!r} -> {current.get(k, '<unset>')!r})"
            for k in sorted(set(saved) | set(current)) if saved.get(k, "<unset>") != current.get(k, "<unset>")]


# What an offline prior (SPO's ``prior_samples`` rollouts of every training prompt by the initial
# policy) depends on: a ``prior_cache`` file made under other values is refused.
PRIOR_KEYS = ("seed", "dtype", "tokenizer", "model", "checkpoint_dir", "dataset", "reward",
              "generation", "estimator.name", "estimator.prior_samples")
PRIOR_IGNORES = ("generation.batch_size", "generation.compile", "reward.workers")


def prior_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """The resolved, flattened config keys that determine the offline prior (``PRIOR_KEYS``,
    less ``PRIOR_IGNORES``), stored in a ``prior_cache`` file and compared when it is read."""
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if _under(k, PRIOR_KEYS) and not _under(k, PRIOR_IGNORES)}


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


# The recipe's schema. Sections map to their keys; None marks a `_component_` section (or
# null), whose arguments the named callable checks; "estimator" and "strategy" are checked
# against the estimator's signature and the strategy registry.
RECIPE_SCHEMA: dict[str, Any] = {
    "name": "value", "output_dir": "value", "seed": "value", "device": "value",
    "dtype": "value", "resume_from_checkpoint": "value", "imports": "value",
    "tokenizer": None, "model": None, "checkpoint_dir": "value", "dataset": None,
    "val_dataset": None, "reward": None, "estimator": "estimator", "strategy": "strategy",
    "generation": {"max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens", "batch_size",
                   "engine", "vllm", "compile"},
    "num_steps": "value", "prompts_per_step": "value", "ppo_epochs": "value",
    "ppo_mini_batches": "value", "micro_batch_size": "value",
    "logprobs_from_hidden": "value", "logprob_chunk_size": "value",
    "enable_activation_checkpointing": "value",
    "loss": {"eps_low", "eps_high", "tis_cap"},
    "optimizer": None, "lr_scheduler": None, "clip_grad_norm": "value",
    "max_nonfinite_steps": "value",
    "validation": {"every", "samples"},
    "save_every": "value", "keep_checkpoints": "value", "keep_best": "value",
    "dump_rollouts_every": "value", "plot": "value", "metric_logger": None, "prior_cache": "value",
    "distributed": {"timeout_s", "cpu_offload", "mixed_precision"},
}


def _hint(key: str, valid: Any, where: str) -> str:
    close = difflib.get_close_matches(key, [str(v) for v in valid], n=1, cutoff=0.5)
    return f"did you mean {where + close[0]!r}?" if close else f"valid keys: {sorted(valid)}"


def _unknown(key: str, valid: Any, where: str) -> ValueError:
    """``unknown config key 'loss.eps_hgh'; did you mean 'loss.eps_high'?``"""
    return ValueError(f"unknown config key {where + key!r}; {_hint(key, valid, where)}")


def _variables(cfg: DictConfig) -> set[str]:
    """Top-level keys the config reads as ``${key}`` (interpolation variables)."""
    text = OmegaConf.to_yaml(cfg, resolve=False)
    return {k for k in cfg if re.search(r"\$\{\s*" + re.escape(str(k)) + r"\s*[}.\[]", text)}


def check_keys(cfg: DictConfig, schema: dict[str, Any]) -> None:
    """Raises ``ValueError`` on the first key of ``cfg`` that ``schema`` does not know.

    ``schema`` maps top-level keys to ``"value"``, ``None`` (a ``_component_`` section, not
    checked), a set of sub-keys, or ``"estimator"`` / ``"strategy"`` (checked against the
    estimator's signature and the strategy registry; needs the config's ``imports`` done).
    """
    variables = _variables(cfg)
    for key in cfg:
        if key not in schema:
            if key in variables:
                continue
            raise _unknown(str(key), schema, "")
        kind = schema[key]
        section = cfg.get(key)
        if isinstance(kind, set) and isinstance(section, DictConfig):
            for sub in section:
                if sub not in kind:
                    raise _unknown(str(sub), kind, f"{key}.")
        elif kind == "estimator" and isinstance(section, DictConfig):
            name = section.get("name")
            valid = {"name", *estimators.estimator_parameters(name)}
            for sub in section:
                if sub not in valid:
                    raise ValueError(
                        f"unknown estimator key(s) {[str(sub)]} for estimator.name={name!r}; "
                        f"{_hint(str(sub), valid, 'estimator.')}"
                    )
        elif kind == "strategy" and isinstance(section, DictConfig):
            valid = {"name", *weighting.list_strategies()}
            for sub in section:
                if sub not in valid:
                    raise _unknown(str(sub), valid, "strategy.")
                if sub == "name" or section[sub] is None:
                    continue
                if not isinstance(section[sub], DictConfig):
                    raise ValueError(f"strategy.{sub} must be a mapping of its parameters, got {section[sub]!r}")
                params = weighting.strategy_parameters(str(sub))
                for p in section[sub]:
                    if params is not None and p not in params:
                        raise _unknown(str(p), params, f"strategy.{sub}.")


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
    est, est_kwargs = estimator_kwargs(cfg) if cfg.get("estimator") is not None else (None, {})
    if est not in estimators.ESTIMATORS:
        raise ValueError(
            f"estimator.name must be one of {sorted(estimators.ESTIMATORS)}, got {est!r}"
        )
    if not isinstance(cfg.get("strategy"), DictConfig) or cfg.strategy.get("name") is None:
        raise ValueError("config key 'strategy.name' is required")
    if cfg.strategy.name not in weighting.list_strategies():
        names = weighting.list_strategies()
        close = difflib.get_close_matches(str(cfg.strategy.name), names, n=1)
        raise ValueError(
            f"strategy.name={cfg.strategy.name!r}: unknown strategy {cfg.strategy.name!r}; "
            + (f"did you mean {close[0]!r}? " if close else "")
            + f"registered strategies: {names}"
        )
    check_keys(cfg, RECIPE_SCHEMA)
    for section in cfg.strategy:  # every section, not only the chosen one: a typo is a typo
        if section != "name" and cfg.strategy[section] is not None:
            params = OmegaConf.to_container(cfg.strategy[section], resolve=True)
            try:
                weighting.get_strategy(str(section), **params)
            except ValueError as e:
                raise ValueError(f"strategy.{section}: {e}") from None
    name, params = strategy_params(cfg)
    if weighting.get_strategy(str(name), **params).needs_groups and est != "group":
        raise ValueError(
            f"strategy.name={name!r} compares the rollouts of each prompt's group, "
            f"so it needs estimator.name=group, got estimator.name={est!r}"
        )
    try:
        estimator = estimators.build_estimator(est, **est_kwargs)
    except ValueError as e:  # "estimator.group_size must be ..." or "estimator: need ..."
        sep = "." if str(e).split(" ")[0] in est_kwargs else ": "
        raise ValueError(f"estimator{sep}{e}") from None

    cache = cfg.get("prior_cache")
    if cache is not None:
        if not isinstance(cache, str) or not cache:
            raise ValueError(f"prior_cache must be a file path or null, got {cache!r}")
        if getattr(estimator, "prior_samples", 0) < 1:
            raise ValueError(
                f"prior_cache={cache!r} is set but estimator.name={est!r} draws no offline prior "
                f"(it needs estimator.name=single_stream with prior_samples >= 1)"
            )
    rollouts = estimator.rollouts_per_prompt * _int(cfg, "prompts_per_step", 1)
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
    from pepo.training.distributed import tile_rows

    tile = tile_rows(estimator.rollouts_per_prompt, minis)
    if rollouts % tile:
        raise ValueError(
            f"ppo_mini_batches={minis} does not split the step's prompt groups evenly: "
            f"{rollouts} rollouts are not a whole number of tiles of {tile} (each mini-batch "
            f"takes the same share of every group)"
        )
    dcfg = cfg.get("distributed") or {}
    timeout = dcfg.get("timeout_s", 1800)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"distributed.timeout_s must be a number > 0, got {timeout!r}")
    if dcfg.get("cpu_offload") and not str(cfg.get("device", "cpu")).startswith("cuda"):
        raise ValueError("distributed.cpu_offload=true offloads from a GPU: it needs device=cuda")
    if dcfg.get("mixed_precision") not in (None, "bf16", "fp16"):
        raise ValueError(f"distributed.mixed_precision must be null, 'bf16' or 'fp16', got "
                         f"{dcfg.get('mixed_precision')!r}")
    _int(cfg, "ppo_epochs", 1)
    _int(cfg, "num_steps", 1)
    _int(cfg, "generation.max_new_tokens", 1)
    _float(cfg, "generation.temperature", 0.0)
    _float(cfg, "generation.top_p", 0.0, 1.0)
    gen_bs = cfg.generation.get("batch_size")
    if gen_bs is not None and (isinstance(gen_bs, bool) or not isinstance(gen_bs, int) or gen_bs < 1):
        raise ValueError(f"generation.batch_size must be an int >= 1 or null, got {gen_bs!r}")
    from pepo.training.engines import check_compile

    check_compile(engine_options(cfg.generation)[0], cfg.generation.get("compile", False))
    top_k = cfg.generation.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generation.top_k must be an int >= 1 or null, got {top_k!r}")
    try:
        check_clip_range(_require(cfg, "loss.eps_low"), _require(cfg, "loss.eps_high"))
    except ValueError as e:
        raise ValueError(f"loss.{e}") from None
    check_engine(cfg.generation)
    check_metric_logger(cfg.get("metric_logger"))
    if cfg.loss.get("tis_cap") is not None:
        _float(cfg, "loss.tis_cap", 0.0)
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
    if not isinstance(cfg.get("keep_best", True), bool):
        raise ValueError(f"keep_best must be true or false, got {cfg.get('keep_best')!r}")

    check_checkpoint_dir(_require(cfg, "checkpoint_dir"))
    check_output_dir(cfg.get("output_dir"))
    check_device(cfg.get("device", "cpu"))
    lr = OmegaConf.select(cfg, "optimizer.lr", default=None)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                           or not (0 < lr < float("inf"))):
        raise ValueError(f"optimizer.lr must be a finite number > 0, got {lr!r}")
    tok = _require(cfg, "tokenizer.path")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (Path(tok) / f).is_file():
            raise ValueError(f"tokenizer.path={tok!r} has no {f}")
    if cfg.get("dtype", "fp32") not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {cfg.get('dtype')!r}")
