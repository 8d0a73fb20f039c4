"""Finding, resolving and validating the recipe's configs.

* Bundled configs (``recipes/configs/*.yaml``, installed as ``pepo.configs``) are found by name:
  ``tune run pepo_recipe --config tiny``; a path to a YAML file works too.
* ``${pepo_asset:tiny}`` in a config resolves to the packaged asset directory ``tiny`` (the
  embedded task's tokenizer and warm-start checkpoint); ``${pepo_pretrained:smollm2}`` to a real
  pretrained model's HF checkpoint, converted from its package into the cache on first use.
* :func:`validate_config` checks everything that can be checked without building a model and
  raises ``ValueError`` naming the key and value, so a bad config fails in a second, not after
  the model is loaded. It runs three phases in a fixed order, each once: the schema
  (:mod:`pepo.training.schema`: a key the recipe does not know, such as ``num_stepz`` or
  ``strategy.proximal_sofmax``, is an error naming the closest valid key; types, ranges, and
  every ``_component_`` section's keys bound to its callable's signature), the rules between
  keys (:func:`check_rules`), then the machine (:func:`check_machine`: paths, device, packages).
  It returns the typed config (:class:`pepo.training.schema.RecipeConfig`) that the recipe
  reads. A top-level key that the config uses as ``${key}`` is a variable, not a typo.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig, OmegaConf

from pepo import weighting
from pepo.tasks.datasets import missing_path_hint
from pepo.training import schema
from pepo.training.paths import check_file_target, check_output_dir
from pepo.training.schema import PRIOR_IGNORES, RESUME_MAY_CHANGE, EvalConfig, RecipeConfig

__all__ = [
    "RESUME_MAY_CHANGE",
    "VAL_BEFORE_IGNORES",
    "asset_dir",
    "build",
    "check_checkpoint_dir",
    "check_device",
    "check_machine",
    "check_metric_logger",
    "check_kind",
    "check_output_dir",
    "check_rules",
    "check_tokenizer_dir",
    "check_world_size",
    "config_error_exit",
    "experiment_changes",
    "experiment_config",
    "find_config",
    "flatten_config",
    "list_configs",
    "prior_fingerprint",
    "recipe_changes",
    "register_resolvers",
    "resolve_config_arg",
    "setting_warnings",
    "validate_config",
    "validate_eval_config",
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
    import difflib

    close = difflib.get_close_matches(str(name_or_path), list_configs(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"--config {name_or_path!r} is neither a file nor a bundled config; {hint}"
        f"bundled configs: {list_configs()}"
    )


def config_error_exit(error: Exception) -> None:
    """Exits with one ``config error:`` line, printed once: under torchrun every process
    checks the same config and finds the same error, so only rank 0 prints it (the others exit
    with status 1 in silence; torchrun then adds its own summary of the failed processes)."""
    import sys

    if os.environ.get("RANK", "0") != "0":
        sys.exit(1)
    # a resolver's own message (${pepo_pretrained:...}), without OmegaConf's wrapping of it
    wrapped = re.match(r"ValueError raised while resolving interpolation: (.*?)(\n\s+full_key:"
                       r".*)?$", str(error), re.S)
    sys.exit(f"config error: {wrapped.group(1) if wrapped else error}")


def resolve_config_arg(argv: list[str]) -> list[str]:
    """``argv`` with the value after ``--config`` replaced by the bundled config's path when it
    is a name (what ``tune run pepo_recipe|pepo_eval --config tiny`` needs); exits with one line
    when it is neither a file nor a bundled name."""
    import sys

    argv = list(argv)
    for j, arg in enumerate(argv):  # argparse's --config=NAME form, as two arguments
        if arg.startswith("--config="):
            argv[j:j + 1] = ["--config", arg[len("--config="):]]
            break
    if "--config" in argv:
        i = argv.index("--config") + 1
        if i == len(argv):
            sys.exit("error: --config needs a config: a bundled name (`python -m pepo.configs "
                     "ls` lists them) or a YAML file")
        try:
            argv[i] = find_config(argv[i])
        except ValueError as e:
            sys.exit(f"error: {e}")
        try:
            loaded = OmegaConf.load(argv[i])
        except Exception as e:  # yaml's own errors, bytes that are not UTF-8: not a YAML file
            sys.exit(f"error: {argv[i]} is not a YAML config: " + " ".join(str(e).split()))
        if not isinstance(loaded, DictConfig):
            sys.exit(f"error: {argv[i]}: a config is a YAML mapping of keys, not a list")
        for arg in argv[i + 1:]:  # torchtune raises a traceback for these
            if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
                sys.exit(f"error: {arg!r}: after --config, each override is key=value (such "
                         f"as num_steps=5; a nested key as generation.temperature=0.6)")
            if not arg.startswith("~") and arg.count("=") > 1:
                sys.exit(f"error: {arg!r}: torchtune's overrides take one '=' (key=value), so "
                         f"a value holding '=' is set in a copy of the config file instead")
    return argv


def check_checkpoint_dir(ckpt: Any, key: str = "checkpoint_dir") -> None:
    """Raises ``ValueError`` unless ``ckpt`` holds ``model.safetensors`` or a sharded index."""
    if ckpt is None:
        raise ValueError(f"config key {key!r} is required")
    if not Path(str(ckpt)).exists():
        raise ValueError(f"{key}={str(ckpt)!r} does not exist (a relative path is read from "
                         f"the directory you run in; a training run writes its checkpoints to "
                         f"<output_dir>/checkpoints, best and latest among them)")
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
    config section; a ``dataset`` or ``val_dataset`` as a list checked by
    :func:`pepo.tasks.problems.check_problems`."""
    from torchtune import config as tune_config

    try:
        built = tune_config.instantiate(cfg[key], *args, **kwargs)
    except TypeError as e:
        raise ValueError(f"{key}: {cfg[key].get('_component_')} {e}") from None
    if key in ("dataset", "val_dataset"):  # problems, at least one; distinct ids where the
        from pepo.tasks.problems import check_problems  # estimator keys its state by them

        return check_problems(list(built), key, unique_ids=key == "dataset" and str(
            cfg.get("estimator", {}).get("name")) != "group")
    return built


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


def check_world_size(cfg: Union[RecipeConfig, DictConfig], world_size: int) -> None:
    """Raises ``ValueError`` unless the step's batch splits evenly over ``world_size``
    processes: whole prompt groups per process, and every process's share of each mini-batch
    a whole number of micro-batches (with the same number of forwards on every process, which
    FSDP2's collectives need), that FSDP2's own settings are not asked of one process
    (where they would not apply), and that a vLLM engine would run beside its trainer."""
    from pepo.training.distributed import tile_rows
    from pepo.training.engines import check_vllm_device

    if not isinstance(cfg, RecipeConfig):
        cfg = schema.parse(cfg)
    check_vllm_device(cfg.generation.engine, cfg.device, world_size)
    if world_size == 1:
        d = cfg.distributed
        if d.mixed_precision is not None or d.cpu_offload:
            bad = (f"distributed.mixed_precision={d.mixed_precision}" if d.mixed_precision
                   else "distributed.cpu_offload=true")
            raise ValueError(f"{bad} is FSDP2's, for runs of several processes (torchrun), and "
                             f"this run has one: unset it (compute_dtype=bf16 runs one "
                             f"process's matmuls in bf16)")
        return
    per_prompt = cfg.estimator.build().rollouts_per_prompt
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
        if torch.version.cuda:  # a CUDA build: no GPU visible, or a driver too old for it
            fix = (f"this torch is built for CUDA {torch.version.cuda}: check that a GPU is "
                   f"visible and its driver supports that CUDA (nvidia-smi)")
        else:
            fix = "use device=cpu, or a CUDA build of torch on a machine with a GPU"
        raise ValueError(f"device={device!r} but CUDA is not available here "
                         f"(torch {torch.__version__}); {fix}")


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


def flatten_config(node: Any, leave_out: tuple[str, ...] = (),
                   resolve: bool = True) -> dict[str, Any]:
    """``node`` (a config or a section of one) resolved (unless not ``resolve``) and flattened
    to ``a.b.c`` keys, but for the keys under ``leave_out``."""
    flat = _flatten(OmegaConf.to_container(node, resolve=resolve))
    return {k: v for k, v in flat.items() if not _under(k, leave_out)}


def experiment_config(cfg: DictConfig) -> dict[str, Any]:
    """The keys that define the experiment (resolved, flattened ``a.b.c``), saved in each
    checkpoint so that a resume cannot silently change them."""
    return flatten_config(cfg, RESUME_MAY_CHANGE)


def experiment_changes(saved: dict[str, Any], current: dict[str, Any],
                       defaults: Optional[dict[str, Any]] = None) -> list[str]:
    """``key (saved -> current)`` for every experiment key that differs; a key one side leaves
    out reads as its value in ``defaults`` (:func:`schema.defaults`), so that spelling out a
    default changes nothing."""
    saved = {k: schema.canonical(k, v) for k, v in saved.items()}  # a value's old name
    unset = dict(defaults or {})

    def value(side: dict[str, Any], k: str) -> Any:
        return side[k] if k in side else unset.get(k, "<unset>")

    return [f"{k} ({value(saved, k)!r} -> {value(current, k)!r})"
            for k in sorted(set(saved) | set(current)) if value(saved, k) != value(current, k)]


def recipe_changes(saved: dict[str, Any], current: dict[str, Any],
                   leave_out: tuple[str, ...] = ()) -> list[str]:
    """:func:`experiment_changes` with the recipe's defaults: a checkpoint's experiment, a prior
    cache's or a validation cache's fingerprint against this run's. ``leave_out``: keys the
    current side leaves out (``RESUME_MAY_CHANGE``, ``PRIOR_IGNORES``), left out of ``saved``
    too, which an earlier pepo may have recorded before they had that role."""
    saved = {k: v for k, v in saved.items() if not _under(k, leave_out)}
    return experiment_changes(saved, current, schema.defaults(schema.RecipeConfig))


def resumable_checkpoint(checkpointer: Any, experiment: dict[str, Any], num_steps: int,
                         warn: Any, closed: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest intact checkpoint of ``checkpointer`` (a
    :class:`pepo.training.checkpointing.Checkpointer`) and its state, for a resume.

    ``warn`` (a callable taking one message) hears about a checkpoint with no saved experiment.
    ``closed``: whether the run wrote its ``summary.json``; a checkpoint at ``num_steps`` of a
    run that did not (stopped after its last step's checkpoint) resumes to close the run.

    Raises:
        ValueError: no intact checkpoint, one whose experiment keys differ from
            ``experiment`` (naming each change), one beyond ``num_steps``, or one at
            ``num_steps`` of a closed run.
    """
    found = checkpointer.load_latest()  # the newest intact one (warns about others)
    if found is None:
        raise ValueError(f"resume_from_checkpoint=True but {checkpointer.root} holds no intact "
                         f"checkpoint (see the warnings above)")
    path, state = found
    saved = state.get("experiment")
    if saved is None:
        warn(f"{path} records no experiment config; the resume cannot check it")
    elif changes := recipe_changes(saved, experiment, RESUME_MAY_CHANGE):
        raise ValueError(f"resuming {path} would change the experiment: {', '.join(changes)}; "
                         f"keep these values, or start a new run in another output_dir")
    if state["step"] > num_steps or (state["step"] == num_steps and closed):
        raise ValueError(f"{path} is at step {state['step']}, and num_steps={num_steps} asks for "
                         f"no more; raise num_steps to train further")
    return path, state


# What an offline prior (SPO's ``prior_samples`` rollouts of every training prompt by the initial
# policy) depends on: a ``prior_cache`` file made under other values is refused.
PRIOR_KEYS = ("seed", "dtype", "compute_dtype", "tokenizer", "model", "checkpoint_dir", "dataset",
              "reward", "generation", "estimator.name", "estimator.prior_samples")


# what decides the validation before training (validation.before_cache)
VAL_BEFORE_KEYS = ("seed", "device", "dtype", "compute_dtype", "tokenizer", "model",
                   "checkpoint_dir", "val_dataset", "reward", "generation", "validation.samples")
# ... but for the RUN keys of the sampling and the reward (batch size, vLLM's memory, compiling,
# reward workers); validation.samples and val_dataset, RUN keys of training, decide it
VAL_BEFORE_IGNORES = tuple(k for k in PRIOR_IGNORES if k.split(".")[0] in ("generation", "reward"))


def _resolved_precision(cfg: DictConfig, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """``fingerprint`` with, under ``compute_dtype: auto``, the precision it chose on this
    machine (``compute_dtype_resolved``): ``auto`` samples in bf16 on a CPU with bf16 units and
    in fp32 on another, so a cache made on one is not the other's."""
    if fingerprint.get("compute_dtype") == "auto":
        import torch

        from pepo.training.precision import resolve_compute_dtype

        dtype = resolve_compute_dtype("auto", torch.device(str(cfg.get("device", "cpu"))))
        fingerprint["compute_dtype_resolved"] = "bf16" if dtype is not None else "fp32"
    return fingerprint


def val_before_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """The resolved, flattened config keys that determine the validation before training
    (``VAL_BEFORE_KEYS``, less ``VAL_BEFORE_IGNORES``, and the precision ``auto`` chose),
    stored in a ``validation.before_cache`` file and compared when read."""
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    return _resolved_precision(cfg, {k: v for k, v in flat.items() if _under(
        k, VAL_BEFORE_KEYS) and not _under(k, VAL_BEFORE_IGNORES)})


def prior_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """The resolved, flattened config keys that determine the offline prior (``PRIOR_KEYS``,
    less the schema's ``RUN`` keys, ``PRIOR_IGNORES``, and the precision ``auto`` chose), stored
    in a ``prior_cache`` file and compared when it is read."""
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    return _resolved_precision(cfg, {k: v for k, v in flat.items()
                                     if _under(k, PRIOR_KEYS) and not _under(k, PRIOR_IGNORES)})


def check_rules(rc: RecipeConfig) -> None:
    """Phase 2: the rules between keys of a config that passed :func:`schema.parse`."""
    est = rc.estimator.name
    strategy = weighting.get_strategy(rc.strategy.name, **rc.strategy.params)
    estimator = rc.estimator.build()
    if strategy.needs_groups and estimator.rollouts_per_prompt < 2:  # a registered group
        raise ValueError(  # estimator (rollouts_per_prompt >= 2) has groups too
            f"strategy.name={rc.strategy.name!r} compares the rollouts of each prompt's group, "
            f"so it needs estimator.name=group (or an estimator of several rollouts per prompt), "
            f"got estimator.name={est!r}")
    if rc.prior_cache is not None and estimator.prior_samples < 1:
        raise ValueError(
            f"prior_cache={rc.prior_cache!r} is set but estimator.name={est!r} draws no offline "
            f"prior (it needs estimator.name=single_stream with prior_samples >= 1)"
        )
    rollouts = estimator.rollouts_per_prompt * rc.prompts_per_step
    if rollouts == 1 and getattr(estimator, "normalize", False):
        raise ValueError(
            f"prompts_per_step=1 with estimator.name={est!r} gives one rollout a step, whose "
            f"batch-normalised advantage is always 0: set prompts_per_step >= 2, or "
            f"estimator.normalize=false"
        )
    minis, micro = rc.ppo_mini_batches, rc.micro_batch_size
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
            f"takes the same share of every tile)"
        )
    if rc.distributed.cpu_offload and not str(rc.device).startswith("cuda"):
        raise ValueError("distributed.cpu_offload=true offloads from a GPU: it needs device=cuda")
    from pepo.training.engines import check_compile

    check_compile(rc.generation.engine, rc.generation.compile)


# estimator -> (flag, a value of it, the keys that value leaves unused); each flag is True by
# default (GroupEstimator, SingleStreamEstimator)
_ESTIMATOR_UNUSED = {
    "group": (("normalize_std", False, ("eps", "unbiased")),),
    "single_stream": (("normalize", False, ("eps",)),
                      ("adaptive_forgetting", True, ("rho",)),
                      ("adaptive_forgetting", False, ("rho_max", "d_half")))}


def setting_warnings(rc: RecipeConfig) -> list[str]:
    """What a run's settings do to other keys that nothing else would say: validation asked
    for with no ``val_dataset`` (none is run), validation settings or ``save_logits_mib`` that
    the run will not use, estimator keys that its flags turn off (``estimator.eps`` with
    ``normalize_std=false``), and ``loss.tis_cap`` under a top-p or top-k filter (the ratio it caps
    is then the filter's kept mass, not only the engines' numerics).
    """
    out = []
    if rc.validation.every and rc.val_dataset is None:
        best = " (and no best checkpoint kept)" if rc.keep_best else ""
        out.append(f"validation.every={rc.validation.every} with val_dataset=null: no validation "
                   f"is run{best}; set val_dataset to validate")
    unused = [f"validation.{k}" for k in ("dump", "before_cache")
              if getattr(rc.validation, k) and not rc.validation.every]
    if rc.save_logits_mib and not rc.logprobs_from_hidden:
        unused.append(f"save_logits_mib={rc.save_logits_mib} (it works with "
                      f"logprobs_from_hidden=true)")
    if unused:
        out.append(f"{', '.join(unused)}: not used by this run" + (
            " (validation.every=0: no validation)" if not rc.validation.every and any(
                u.startswith("validation.") for u in unused) else ""))
    for flag, when, keys in _ESTIMATOR_UNUSED.get(rc.estimator.name, ()):
        if rc.estimator.params.get(flag, True) == when and (
                given := [f"estimator.{k}" for k in keys if k in rc.estimator.params]):
            out.append(f"{', '.join(given)}: not used with estimator.{flag}="
                       f"{str(when).lower()}")
    g = rc.generation
    filters = ([f"generation.top_p={g.top_p:g}"] if g.top_p < 1 else []) + (
        [f"generation.top_k={g.top_k}"] if g.top_k is not None else [])
    if rc.loss.tis_cap is not None and filters:
        out.append(f"loss.tis_cap={rc.loss.tis_cap:g} with {' and '.join(filters)}: the engine's "
                   f"log-prob is the filtered, renormalised distribution's and the trainer's the "
                   f"full one's, so each weight min(pi_old / mu, C) is about the sampled token's "
                   f"kept mass (< 1, least where entropy is high): it scales the loss by the "
                   f"filter, not only by the engines' numerics (top_p=1 and top_k=null leave "
                   f"only those)")
    return out


def check_tokenizer_dir(cfg: DictConfig) -> None:
    """Raises ``ValueError`` unless ``tokenizer.path`` holds the tokenizer's two files."""
    tok = cfg.tokenizer.get("path")
    if tok is None:
        raise ValueError("config key 'tokenizer.path' is required")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (Path(tok) / f).is_file():
            raise ValueError(f"tokenizer.path={tok!r} has no {f}")


def check_machine(rc: RecipeConfig, cfg: DictConfig) -> None:
    """Phase 3: what this machine must have for the config: the initial checkpoint, a writable
    output directory, the device, the tokenizer's files, the logger's and the engine's
    packages."""
    check_checkpoint_dir(rc.checkpoint_dir)
    check_output_dir(rc.output_dir)
    log_dir = rc.metric_logger.get("log_dir")  # a required section
    if log_dir is not None:  # its logger would fail after the model is built, with two tracebacks
        check_output_dir(log_dir, "metric_logger.log_dir")
    for key, cache in (("prior_cache", rc.prior_cache),
                       ("validation.before_cache", rc.validation.before_cache)):
        check_file_target(cache, key)  # written after minutes of rollouts
    if rc.lr_scheduler is not None:
        check_lr_schedule(cfg, rc.num_steps * rc.ppo_epochs * rc.ppo_mini_batches)
    check_device(rc.device)
    check_tokenizer_dir(cfg)
    check_metric_logger(rc.metric_logger)
    from pepo.training.engines import check_engine_available

    check_engine_available(rc.generation.engine)


def check_lr_schedule(cfg: DictConfig, steps: int) -> None:
    """Raises ``ValueError`` unless ``lr_scheduler`` builds and gives a finite learning rate
    >= 0 at each of the run's ``steps`` optimizer steps, stepped here on a throwaway parameter
    (a bad argument, ``num_cycles: abc``, fails once the warm-up is over: after a checkpoint,
    which a resume with the value corrected refuses as another experiment). An optimizer that
    does not build here is left to the recipe, which reports it."""
    import math
    import warnings

    import torch

    try:
        optimizer = build(cfg, "optimizer", [torch.nn.Parameter(torch.zeros(1))])
    except Exception:  # e.g. one for CUDA parameters only
        return
    component, step, lr, scheduler = cfg.lr_scheduler.get("_component_"), 0, None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            scheduler = build(cfg, "lr_scheduler", optimizer, num_training_steps=steps)
            for step in range(steps + 1):  # the learning rate of optimizer step `step`
                if step:
                    optimizer.step()  # no gradient: changes nothing
                    scheduler.step()
                lr = optimizer.param_groups[0]["lr"]
                lr = float(lr) if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
                if not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
                    break
            else:
                return
            what = f"gives the learning rate {lr!r}"
        except Exception as e:
            if scheduler is None and isinstance(e, ValueError):  # build's line, naming the key
                raise ValueError(str(e)) from None
            what = f"fails: {type(e).__name__}: {e}"
    raise ValueError(f"lr_scheduler: {component} {what} at optimizer step {step} of {steps} "
                     f"(num_steps x ppo_epochs x ppo_mini_batches); check its arguments")


def validate_config(cfg: DictConfig) -> RecipeConfig:
    """Checks the recipe config before anything is built, in three phases, each once: the
    schema (:func:`pepo.training.schema.parse`: unknown keys, types, ranges, every
    ``_component_`` bound to its callable), the rules between keys (:func:`check_rules`), then
    the machine (:func:`check_machine`).

    Returns:
        The typed config (every default filled in), which the recipe reads.

    Raises:
        ValueError: naming the first bad key and its value.
    """
    check_kind(cfg, "pepo_recipe")
    rc = schema.parse(cfg)
    check_rules(rc)
    check_machine(rc, cfg)
    return rc


def check_kind(cfg: Any, recipe: str) -> None:
    """Refuses a config of the other recipe (an eval config given to ``pepo_recipe``: it has
    ``benchmarks`` and neither ``strategy`` nor ``estimator``; a training config given to
    ``pepo_eval``: the reverse) and one that is empty, in one line saying so: the schema's
    first complaint (``estimator.name ... got None``) would not."""
    keys = set(cfg.keys()) if isinstance(cfg, DictConfig) else set()
    training = bool(keys & {"strategy", "estimator"})
    if not keys - {"imports"}:
        raise ValueError(f"the config is empty: `tune run {recipe}` needs one of its configs "
                         f"(`python -m pepo.configs ls` lists them)")
    if recipe == "pepo_recipe" and not training:
        raise ValueError("this is an evaluation config (it has benchmarks, no strategy or "
                         "estimator): run it with `tune run pepo_eval`" if "benchmarks" in keys
                         else f"this is not a training config: it has no strategy or estimator "
                         f"section (its keys: {', '.join(sorted(map(str, keys))[:8])})")
    if recipe == "pepo_eval" and training and "benchmarks" not in keys:
        raise ValueError("this is a training config (it has a strategy or an estimator, no "
                         "benchmarks): run it with `tune run pepo_recipe`")


def validate_eval_config(cfg: DictConfig) -> EvalConfig:
    """Checks an eval config before any model is built (the same three phases)."""
    check_kind(cfg, "pepo_eval")
    ec = schema.parse_eval(cfg)
    for name, b in ec.benchmarks.items():
        path = b.dataset.get("path")
        if path is not None and not Path(path).exists():
            raise ValueError(f"benchmarks.{name}.dataset.path={path!r} does not exist"
                             f"{missing_path_hint(path)} (point the key at the file, or at "
                             f"a directory of data files)")
    check_checkpoint_dir(ec.checkpoint_dir)
    check_device(ec.device)
    from pepo.training.engines import check_engine_available, check_vllm_device

    check_vllm_device(ec.generation.engine, ec.device)
    check_engine_available(ec.generation.engine)
    return ec
