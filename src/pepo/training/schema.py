"""The recipe's and the evaluation's config as one typed schema.

Each section is a dataclass (as TRL's ``GRPOConfig`` and verl's ``ActorConfig``) with one field
per key; each field carries its default (:data:`REQUIRED` where the config must set it), its rule
(type and range, :class:`Int`, :class:`Number`, ...), its help (the meaning column of
``docs/recipe.md``'s key table, which a test holds to this schema) and its role:

* ``EXPERIMENT`` — defines the experiment; a resume may not change it;
* ``RUN`` — where things go, how often, memory settings that change the numbers at most by
  float reduction order: a resume may change it, and the offline prior ignores it;
* ``INITIAL`` — the initial model's paths, superseded by a checkpoint: a resume may change it.

:data:`RESUME_MAY_CHANGE` and :data:`PRIOR_IGNORES` are derived from the roles.

:func:`parse` is the first of the three validation phases (:func:`pepo.training.config.
validate_config` runs them in order): unknown keys (with the closest valid one), required keys,
types and ranges, the estimator and strategy sections against their registries, and every
``_component_`` section bound against its callable's signature (as torchtune's
``config.validate``), so an optimizer typo fails before any model is loaded. It returns the
typed config the recipes read, so every default lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from pepo import estimators, weighting
from pepo.loss import check_clip_range
from pepo.training.config_rules import (
    Betas,
    Bool,
    Component,
    Device,
    Int,
    Number,
    OneOf,
    Raw,
    StrictInt,
    Text,
    Texts,
    bind_names,
    resolve_component,
)
from pepo.training.key_aliases import foreign_key_hint, other_estimators_key

__all__ = [
    "EXPERIMENT",
    "INITIAL",
    "PRIOR_IGNORES",
    "REQUIRED",
    "RESUME_MAY_CHANGE",
    "RUN",
    "EvalConfig",
    "RecipeConfig",
    "canonical",
    "defaults",
    "fields_of",
    "parse",
    "unknown_key",
]

EXPERIMENT, RUN, INITIAL = "experiment", "run", "initial"
ENGINE_NAMES = ("inprocess", "vllm")  # pepo.training.engines.ENGINES (a test holds them equal)
# old names of config values, still accepted with a one-line notice: (key, old) -> new
ALIASES = {("generation.engine", "torchtune"): "inprocess"}
SEEDS = (0, 2**32 - 1)  # what torchtune's set_seed (NumPy's seeding) takes
# the vLLM engine's options that set its memory and speed, not its numbers: a resume may
# change them (a run that ran out of memory resumes with a smaller KV cache)
VLLM_MEMORY_OPTIONS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs",
                       "enforce_eager", "sleep_level")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a key every config must set


def key(default: Any = REQUIRED, help: str = "", *, rule: Any = None, role: str = EXPERIMENT,
        factory: Optional[Callable[[], Any]] = None,
        sub_roles: tuple[tuple[str, str], ...] = ()) -> Any:
    """One config key: its default, rule, help and role (see the module docstring);
    ``sub_roles``: other roles of some keys of a mapping value (``generation.vllm``)."""
    meta = {"help": help, "rule": rule if rule is not None else Raw(), "role": role,
            "sub_roles": sub_roles}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str = "", role: str = EXPERIMENT) -> Any:
    """A sub-section of keys (its own dataclass)."""
    return field(default_factory=cls, metadata={"help": help, "section": cls, "role": role})


# --------------------------------------------------------------------------- sections
@dataclass
class SamplingConfig:
    """``generation``: how responses are sampled (shared by training and evaluation)."""

    max_new_tokens: int = key(help="response length limit", rule=Int(1))
    temperature: float = key(help="sampling temperature (the paper trains at 0.6)",
                             rule=Number(0.0, finite=True))
    top_k: Optional[int] = key(None, "top-k sampling (null: off)", rule=Int(1, nullable=True))
    top_p: float = key(help="nucleus sampling (the paper trains at 0.6)",
                       rule=Number(0.0, 1.0))
    stop_tokens: Optional[list] = key(None, "extra stop tokens besides the tokenizer's eos "
                                      "(strings in the vocabulary)",
                                      rule=Texts("tokens (strings in the vocabulary)"))
    engine: str = key("inprocess", "where rollouts come from: `inprocess` (pepo's own "
                      "KV-cached decoder on the training model; `torchtune`, its old name, still "
                      "works) or `vllm` (a colocated vLLM engine; see below)",
                      rule=OneOf(ENGINE_NAMES, f"one of {list(ENGINE_NAMES)}"))
    vllm: Any = key(None, "the vLLM engine's options (below), with `engine: vllm`",
                    sub_roles=tuple((k, RUN) for k in VLLM_MEMORY_OPTIONS))

    @property
    def engine_options(self) -> dict[str, Any]:
        """The vLLM engine's keyword arguments (``vllm``; empty when unset)."""
        return dict(self.vllm or {})


@dataclass
class GenerationConfig(SamplingConfig):
    """``generation`` of the training recipe."""

    batch_size: Optional[int] = key(None, "rows decoded together (in-process engine; null: all "
                                    "of a step's rollouts at once, and a validation's 256 at a "
                                    "time); the KV cache grows with it",
                                    rule=Int(1, nullable=True), role=RUN)
    compile: bool = key(False, "`torch.compile` the in-process decoder's step (torchtune "
                        "engine): faster decoding after a one-off compilation of tens of "
                        "seconds, so it pays off on long runs only (docs/performance.md)",
                        rule=Bool(), role=RUN)


@dataclass
class LossConfig:
    _component_: str = key("pepo.loss.ClippedPolicyLoss", "the loss, built with `eps_low` and "
                           "`eps_high` (another aggregation is another component: see "
                           "`pepo.loss.ClippedPolicyLoss`)", rule=Text("an import path", False))
    eps_low: float = key(help="lower clip range ε_low", rule=Raw())
    eps_high: float = key(help="upper clip range ε_high (DAPO's clip-higher)", rule=Raw())
    tis_cap: Optional[float] = key(None, "cap `C` of truncated importance sampling: each "
                                   "token's loss is weighted by `min(π_old / μ, C)`, the "
                                   "trainer's over the engine's probability (null: off)",
                                   rule=Number(0.0, nullable=True, finite=True))


@dataclass
class ValidationConfig:
    every: int = key(help="steps between validations (0 = never); also before step 1 and "
                     "after the last", rule=Int(0), role=RUN)
    samples: int = key(help="k of avg@k", rule=Int(1), role=RUN)
    before_cache: Optional[str] = key(
        None, "a JSON file keeping the validation before training: read when it was made under "
        "the same settings (model, checkpoint and validation data, by content too, reward, "
        "sampling, seed, precision, samples; another is an error naming it), else computed and "
        "written. Runs that differ only in how they train share it: a study's methods of one "
        "seed", rule=Text("a file path"), role=RUN)
    dump: bool = key(False, "write each validation's responses, answers and rewards to "
                     "`val_rollouts/step_NNNNNN.jsonl` (step 0: the validation before training, "
                     "when it is computed, not read from `before_cache`), so that they can be "
                     "scored again another way", rule=Bool(), role=RUN)


@dataclass
class DistributedConfig:
    timeout_s: float = key(1800.0, "how long a collective waits for the other processes before "
                           "it fails", rule=Number(0, finite=True), role=RUN)
    cpu_offload: bool = key(False, "FSDP2 keeps parameters and optimizer state on the CPU "
                            "(needs device=cuda and several processes)", rule=Bool(), role=RUN)
    mixed_precision: Optional[str] = key(None, "FSDP2 compute dtype (`bf16`; null: the "
                                         "model's); several processes only (one process: "
                                         "`compute_dtype`)",
                                         rule=OneOf((None, "bf16"), "null or 'bf16' (fp16 "
                                                    "needs loss scaling, which pepo does not do)"))


@dataclass
class EstimatorConfig:
    """``estimator``: ``name`` and the named estimator's keyword arguments."""

    name: str
    params: dict[str, Any]

    def build(self) -> Any:
        """The estimator (:func:`pepo.estimators.build_estimator`)."""
        return estimators.build_estimator(self.name, **self.params)


@dataclass
class StrategyConfig:
    """``strategy``: ``name`` and one parameter section per strategy (only the named one is
    used; every one is checked)."""

    name: str
    sections: dict[str, Optional[dict[str, Any]]]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.sections.get(self.name) or {})


_OPTIMIZER = Component(positional=1, args=(
    ("lr", Number(0, finite=True)), ("betas", Betas()),
    # torch checks these two only once the model is built and loaded
    ("weight_decay", Number(0, finite=True, closed=True)),
    ("eps", Number(0, finite=True, closed=True))))


@dataclass
class RecipeConfig:
    """The training recipe's config (``recipes/configs/*.yaml``)."""

    name: str = key("pepo", "run name (plot title)", role=RUN)
    output_dir: str = key(help="everything the run writes goes here", role=RUN)
    seed: int = key(help="seeds the model init, the prompt shuffle and the sampler",
                    rule=StrictInt(" (exact resume replays the seeded shuffle)", SEEDS))
    device: str = key("cpu", "`cpu`, `cuda`", rule=Device())
    dtype: str = key("fp32", "`fp32`, or `bf16` on GPUs", rule=OneOf(("fp32", "bf16"),
                                                                  "'fp32' or 'bf16'"))
    compute_dtype: str = key("fp32", "the matmuls' precision: `bf16` runs every forward (rollouts "
                             "and training) under torch.autocast to bf16 over `dtype` "
                             "parameters; `auto`: bf16 on a CPU with bf16 matrix units (AMX, "
                             "AVX512-BF16), else fp32", rule=OneOf(("auto", "fp32", "bf16"),
                                                                  "'auto', 'fp32' or 'bf16'"))
    resume_from_checkpoint: bool = key(False, "continue from `output_dir/checkpoints/latest`",
                                       rule=Bool(), role=RUN)
    imports: list = key(help="modules imported first (custom strategies, rewards registering "
                        "themselves)", factory=list, role=RUN, rule=Texts("module names"))
    tokenizer: Any = key(help="a directory with `tokenizer.json` and `tokenizer_config.json`",
                         rule=Component(roles=(("path", INITIAL),)))
    model: Any = key(help="any builder returning a torchtune `TransformerDecoder`",
                     rule=Component(roles=(("model_dir", INITIAL),)))
    checkpoint_dir: str = key(help="initial weights: `model.safetensors` in torchtune's key "
                              "names, or a Hugging Face checkpoint directory", role=INITIAL)
    dataset: Any = key(help="any component returning a list of objects with `id`, `prompt`, "
                       "`answer`", rule=Component())
    val_dataset: Any = key(None, "held-out prompts for validation (null: none)",
                           rule=Component(nullable=True), role=RUN)
    reward: Any = key(help="the verifier", rule=Component(roles=(("workers", RUN),)))
    estimator: Any = key(help="`group` or `single_stream` and its keyword arguments")
    strategy: Any = key(help="any name in `pepo.weighting.list_strategies()` and one parameter "
                        "section per strategy")
    prior_cache: Optional[str] = key(None, "a file keeping the offline prior (single-stream): "
                                     "read when it exists and matches, else computed and "
                                     "written", rule=Text("a file path"), role=RUN)
    generation: GenerationConfig = section(GenerationConfig)
    num_steps: int = key(help="training steps", rule=Int(1), role=RUN)
    prompts_per_step: int = key(help="prompts per step", rule=Int(1))
    ppo_epochs: int = key(help="passes over a step's rollouts", rule=Int(1))
    ppo_mini_batches: int = key(help="optimizer steps per pass; the step's rollouts must form "
                                "whole tiles of lcm(rollouts per prompt, ppo_mini_batches), "
                                "each mini-batch taking an equal share of every tile (of "
                                "every prompt group where ppo_mini_batches divides its size)",
                                rule=Int(1))
    micro_batch_size: int = key(help="rows per forward/backward; must divide the mini-batch",
                                rule=Int(1), role=RUN)
    logprob_chunk_size: int = key(1024, "positions per chunk (pepo.entropy)", rule=Int(1), role=RUN)
    logprobs_from_hidden: bool = key(False, "apply the output projection chunk by chunk "
                                     "(`logprobs_and_entropy_from_hidden`), so the `[b, S, V]` "
                                     "logits are never held; same numbers to rounding", rule=Bool(),
                                     role=RUN)
    save_logits_mib: int = key(0, "with `logprobs_from_hidden`: keep a micro-batch's fp32 "
                               "logits from its forward to its backward when they take at most "
                               "this many MiB, instead of making them again there (one of the "
                               "output head's four products fewer); 0: always make them again",
                               rule=Int(0), role=RUN)
    recompute_old_logprobs: bool = key(False, "always run the old-policy pass; false: skip it "
                                       "where the update's own forward gives the same numbers "
                                       "(one epoch, one mini-batch, a strategy that weighs each "
                                       "row on its own)", rule=Bool(), role=RUN)
    enable_activation_checkpointing: bool = key(False, "recompute each transformer layer in "
                                                "backward", rule=Bool(), role=RUN)
    loss: LossConfig = section(LossConfig)
    optimizer: Any = key(help="any `torch.optim` component", rule=_OPTIMIZER)
    lr_scheduler: Any = key(None, "e.g. `torchtune.training.lr_schedulers.get_cosine_schedule_"
                            "with_warmup`; the recipe passes `num_training_steps`",
                            rule=Component(nullable=True, positional=1,
                                           given=("num_training_steps",), given_note=(
                                               " (num_steps x ppo_epochs x ppo_mini_batches)"),
                                           args=(("num_warmup_steps", Int(0)),)))
    clip_grad_norm: Optional[float] = key(None, "null = no clipping (the norm is still computed "
                                          "and logged)", rule=Number(0.0, nullable=True))
    max_nonfinite_steps: int = key(help="stop after this many optimizer steps in a row with a "
                                   "non-finite loss or gradient (each is skipped and counted)",
                                   rule=Int(1), role=RUN)
    validation: ValidationConfig = section(ValidationConfig, role=RUN)
    save_every: int = key(help="checkpoint period (and always at the end; 0: only at the end)",
                          rule=Int(0), role=RUN)
    keep_checkpoints: int = key(2, "how many checkpoints to keep (the newest)", rule=Int(1),
                                role=RUN)
    keep_best: bool = key(True, "also keep the checkpoint of the best validation accuracy "
                          "(`checkpoints/best`); needs `validation.every >= 1`", rule=Bool(),
                          role=RUN)
    dump_rollouts_every: int = key(help="rollout dump period (0 = never)", rule=Int(0),
                                   role=RUN)
    plot: bool = key(True, "write `training_curves.png` at the end", rule=Bool(), role=RUN)
    metric_logger: Any = key(help="a torchtune metric logger", rule=Component(), role=RUN)
    distributed: DistributedConfig = section(DistributedConfig)


@dataclass
class BenchmarkConfig:
    k: int = key(help="k of avg@k", rule=Int(1))
    dataset: Any = key(help="the benchmark's dataset component", rule=Component())


@dataclass
class EvalConfig:
    """The evaluation recipe's config (``recipes/configs/eval_*.yaml``)."""

    output_dir: str = key(help="results go to `output_dir/<label>/`")
    model_name: Optional[str] = key(None, "the label of the evaluated model (null: from "
                                    "`checkpoint_dir`)", rule=Text("a string"))
    seed: int = key(help="the sampling seed", rule=StrictInt("", SEEDS))
    device: str = key("cpu", "`cpu`, `cuda`", rule=Device())
    dtype: str = key("fp32", "`fp32`, or `bf16` on GPUs", rule=OneOf(("fp32", "bf16"),
                                                                  "'fp32' or 'bf16'"))
    compute_dtype: str = key("fp32", "the matmuls' precision: `bf16` samples under "
                             "torch.autocast to bf16; `auto`: bf16 on a CPU with bf16 matrix "
                             "units (AMX, AVX512-BF16), else fp32", rule=OneOf(
                                 ("auto", "fp32", "bf16"), "'auto', 'fp32' or 'bf16'"))
    batch_size: int = key(256, "rows sampled together", rule=Int(1))
    tokenizer: Any = key(help="the tokenizer component", rule=Component())
    model: Any = key(help="the model builder", rule=Component())
    checkpoint_dir: str = key(help="the evaluated weights")
    reward: Any = key(help="the verifier", rule=Component())
    generation: SamplingConfig = section(SamplingConfig)
    benchmarks: dict[str, BenchmarkConfig] = key(help="name -> {dataset, k}")


# ------------------------------------------------------------------------- derived sets
def fields_of(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every key of ``cls`` flattened (``generation.top_p``), in declaration order."""
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        if sub is not None:
            out.extend(fields_of(sub, f"{prefix}{f.name}."))
        else:
            out.append((prefix + f.name, f))
    return out


def defaults(cls: type) -> dict[str, Any]:
    """Every key of ``cls`` that has a default, flattened (``generation.top_k``), with it: what
    a config that leaves the key out means."""
    out: dict[str, Any] = {}
    for name, f in fields_of(cls):
        if f.default_factory is not dataclasses.MISSING:
            out[name] = f.default_factory()
        elif f.default is not dataclasses.MISSING and f.default is not REQUIRED:
            out[name] = f.default
    return out


def _role_keys(cls: type, roles: tuple[str, ...]) -> tuple[str, ...]:
    """The keys of ``cls`` (whole sections where the section has the role) in ``roles``."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        sub, rule = f.metadata.get("section"), f.metadata.get("rule")
        if f.metadata.get("role") in roles:
            out.append(f.name)
        elif sub is not None:
            out.extend(f"{f.name}.{k}" for k in _role_keys(sub, roles))
        elif isinstance(rule, Component):
            out.extend(f"{f.name}.{a}" for a, role in rule.roles if role in roles)
        else:
            out.extend(f"{f.name}.{a}" for a, role in f.metadata.get("sub_roles", ())
                       if role in roles)
    return tuple(out)


# Keys a resume may change: where things go and how often, memory settings that do not change
# the numbers beyond float reduction order, and the paths of the initial model (superseded by
# the checkpoint). Everything else defines the experiment. `num_steps` is checked on its own.
RESUME_MAY_CHANGE: tuple[str, ...] = _role_keys(RecipeConfig, (RUN, INITIAL))
# What the offline prior ignores inside the sections it depends on: the RUN keys.
PRIOR_IGNORES: tuple[str, ...] = _role_keys(RecipeConfig, (RUN,))


# ------------------------------------------------------------------------------- phase 1
def _hint(name: str, valid: Any, where: str) -> str:
    close = difflib.get_close_matches(name, [str(v) for v in valid], n=1, cutoff=0.5)
    return foreign_key_hint(name, where, {str(v) for v in valid}) or (
        f"did you mean {where + close[0]!r}?" if close else f"valid keys: {sorted(valid)}")


def unknown_key(name: str, valid: Any, where: str) -> ValueError:
    """``unknown config key 'loss.eps_hgh'; did you mean 'loss.eps_high'?``"""
    return ValueError(f"unknown config key {where + name!r}; {_hint(name, valid, where)}")


def _variables(cfg: DictConfig) -> set[str]:
    """Top-level keys the config reads as ``${key}`` (interpolation variables)."""
    text = OmegaConf.to_yaml(cfg, resolve=False)
    return {k for k in cfg if re.search(r"\$\{\s*" + re.escape(str(k)) + r"\s*[}.\[]", text)}


def _check_keys(node: Any, cls: type, where: str, variables: set[str] = frozenset()) -> None:
    """The first key of ``node`` that section ``cls`` does not know is an error (its
    sub-sections too)."""
    if not isinstance(node, DictConfig):
        return
    known = {f.name: f for f in dataclasses.fields(cls)}
    for k in node:
        f = known.get(str(k))
        if f is None:
            if where == "" and k in variables:
                continue
            raise unknown_key(str(k), known, where)
        sub = f.metadata.get("section")
        if sub is not None:
            if node.get(k) is not None and not isinstance(node.get(k), DictConfig):
                raise ValueError(f"{where}{k} must be a section (a mapping of its keys), got "
                                 f"{node.get(k)!r}")
            _check_keys(node.get(k), sub, f"{where}{k}.")


def _read(node: Any, cls: type, where: str, skip: tuple[str, ...] = ()) -> Any:
    """The typed section ``cls`` of ``node``: each key's rule applied, defaults filled in
    (``skip``: keys read elsewhere, left None)."""
    values: dict[str, Any] = {k: None for k in skip}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        full = where + f.name
        sub = f.metadata.get("section")
        present = isinstance(node, DictConfig) and f.name in node
        if sub is not None:
            values[f.name] = _read(node.get(f.name) if present else None, sub, full + ".")
            continue
        rule = f.metadata["rule"]
        if not present:
            if f.default is not dataclasses.MISSING and f.default is not REQUIRED:
                values[f.name] = f.default
                continue
            if f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
                continue
            value = None
        elif isinstance(rule, Component):
            value = node.get(f.name)  # the section itself, built later
        else:
            value = node.get(f.name)
            if isinstance(value, DictConfig) or OmegaConf.is_list(value):
                value = OmegaConf.to_container(value, resolve=True)
        if value is None and f.default is REQUIRED and not isinstance(rule, (StrictInt,
                                                                             Component)):
            raise ValueError(f"config key {full!r} is required (on the command line: {full}=...)")
        values[f.name] = rule.check(full, value)
    return cls(**values)


def _named_section(cfg: DictConfig, key: str) -> None:
    """``estimator`` and ``strategy`` are sections naming their choice: a bare value (``strategy=
    proximal_softmax``) is refused with the override that was meant."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, DictConfig):
        hint = f" (did you mean {key}.name={value}?)" if isinstance(value, str) else ""
        raise ValueError(f"{key} must be a section with a name and its parameters, got "
                         f"{value!r}{hint}")


def _estimator(cfg: DictConfig) -> EstimatorConfig:
    _named_section(cfg, "estimator")
    section = cfg.get("estimator")
    params = (OmegaConf.to_container(section, resolve=True)
              if isinstance(section, DictConfig) else {})
    name = params.pop("name", None)
    if name not in estimators.ESTIMATORS:
        try:  # the core's message, with what the paper calls an estimator
            estimators.estimator_parameters(name)
        except ValueError as e:
            raise ValueError(f"estimator.{e}".replace("estimator name", "name", 1)) from None
    valid = {"name", *estimators.estimator_parameters(name)}
    for sub in section:
        if sub not in valid:
            raise ValueError(f"unknown estimator key(s) {[str(sub)]} for estimator.name="
                             f"{name!r}; {_hint(str(sub), valid, 'estimator.')}"
                             f"{other_estimators_key(str(sub), name)}")
    try:
        estimators.build_estimator(name, **params)
    except ValueError as e:  # "estimator.group_size must be ..." or "estimator: need ..."
        sep = "." if str(e).split(" ")[0] in params else ": "
        raise ValueError(f"estimator{sep}{e}") from None
    return EstimatorConfig(name, params)


def _strategy_name(cfg: DictConfig) -> str:
    _named_section(cfg, "strategy")
    if not isinstance(cfg.get("strategy"), DictConfig) or cfg.strategy.get("name") is None:
        raise ValueError("config key 'strategy.name' is required")
    name = cfg.strategy.name
    if name not in weighting.list_strategies():
        try:  # the core's message: a close name, or what the paper calls a method
            weighting.strategy_parameters(str(name))
        except ValueError as e:
            raise ValueError(f"strategy.name={name!r}: {e}") from None
    return str(name)


_RUNTIME_PARAMETERS = ("process_group",)  # a strategy's parameters that are the run's objects


def _strategy(cfg: DictConfig, name: str) -> StrategyConfig:
    section = cfg.strategy
    valid = {"name", *weighting.list_strategies()}
    sections: dict[str, Optional[dict[str, Any]]] = {}
    for sub in section:
        if sub not in valid:
            raise unknown_key(str(sub), valid, "strategy.")
        if sub == "name" or section[sub] is None:
            continue
        if not isinstance(section[sub], DictConfig):
            raise ValueError(f"strategy.{sub} must be a mapping of its parameters, got "
                             f"{section[sub]!r}")
        params = weighting.strategy_parameters(str(sub))
        for p in section[sub]:
            if p in _RUNTIME_PARAMETERS:
                raise ValueError(f"strategy.{sub}.{p} is not a config key: the recipe passes "
                                 f"its {p} itself")
            if params is not None and p not in params:
                raise unknown_key(str(p), params, f"strategy.{sub}.")
        sections[str(sub)] = OmegaConf.to_container(section[sub], resolve=True)
    for sub, params in sections.items():  # every section, not only the chosen one
        try:
            weighting.get_strategy(sub, **params)
        except ValueError as e:
            raise ValueError(f"strategy.{sub}: {e}") from None
    return StrategyConfig(name, sections)


def _import_modules(cfg: DictConfig) -> None:
    imports = cfg.get("imports")
    if OmegaConf.is_list(imports):
        imports = OmegaConf.to_container(imports, resolve=True)
    for module in Texts("module names").check("imports", imports) or []:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"imports: cannot import {module!r}: {e}") from None


def _check_vllm(generation: SamplingConfig, where: str = "generation") -> None:
    """An unknown ``generation.vllm`` key is an error naming the closest one."""
    if generation.vllm is None:
        return
    if not isinstance(generation.vllm, dict):
        raise ValueError(f"{where}.vllm must be a mapping of the engine's options, got "
                         f"{generation.vllm!r}")
    from pepo.training.engines import VLLMEngine

    # the recipe passes these itself
    valid = set(inspect.signature(VLLMEngine).parameters) - {"model", "hf_dir", "seed",
                                                             "state_dict"}
    for k in generation.vllm:
        if k not in valid:
            raise unknown_key(str(k), valid, f"{where}.vllm.")


def renamed(cfg: DictConfig) -> None:
    """Replaces, in place, each config value that has a new name (``ALIASES``) by that name,
    with a one-line notice on the ``pepo`` logger."""
    for (dotted, old), new in ALIASES.items():
        section, leaf = dotted.rsplit(".", 1)
        node = OmegaConf.select(cfg, section)
        if isinstance(node, DictConfig) and node.get(leaf) == old:
            logging.getLogger("pepo").warning(
                f"{dotted}={old} is now called {new}; the old name still works")
            node[leaf] = new


def canonical(key: str, value: Any) -> Any:
    """``value`` of config key ``key`` under its current name (``ALIASES``): what a checkpoint
    or a prior cache saved under an old name is compared as."""
    return ALIASES.get((key, value), value) if isinstance(value, str) else value


def parse(cfg: DictConfig) -> RecipeConfig:
    """Phase 1 of the recipe's validation: the schema (see the module docstring). Runs the
    config's ``imports`` first (they register strategies and estimators).

    Raises:
        ValueError: naming the first bad key and its value.
    """
    _import_modules(cfg)
    renamed(cfg)
    estimator = _estimator(cfg)
    strategy_name = _strategy_name(cfg)
    _check_keys(cfg, RecipeConfig, "", _variables(cfg))
    _check_keys(cfg.get("generation"), GenerationConfig, "generation.")
    strategy = _strategy(cfg, strategy_name)
    typed = _read(cfg, RecipeConfig, "")
    typed.estimator, typed.strategy = estimator, strategy
    try:
        check_clip_range(typed.loss.eps_low, typed.loss.eps_high)
    except ValueError as e:
        raise ValueError(f"loss.{e}") from None
    path = typed.loss._component_
    bind_names("loss", path, resolve_component("loss", path), ("eps_low", "eps_high"))
    _check_vllm(typed.generation)
    return typed


def parse_eval(cfg: DictConfig) -> EvalConfig:
    """Phase 1 of the evaluation's validation (``benchmarks``: name -> {dataset, k})."""
    renamed(cfg)
    _check_keys(cfg, EvalConfig, "", _variables(cfg))
    _check_keys(cfg.get("generation"), SamplingConfig, "generation.")
    if not cfg.get("benchmarks"):
        raise ValueError("config key 'benchmarks' is required (name -> {dataset, k})")
    if not isinstance(cfg.benchmarks, DictConfig):
        raise ValueError(f"benchmarks must be a mapping name -> {{dataset, k}}, got "
                         f"{cfg.benchmarks!r}")
    dropped = sorted(str(n) for n, b in cfg.benchmarks.items() if b is None)
    for name in dropped:  # benchmarks.NAME=null drops a benchmark (from the config itself)
        cfg.benchmarks.pop(name)
    if not cfg.benchmarks:
        raise ValueError(f"every benchmark is dropped (null): {dropped}; keep at least one")
    benchmarks = {}
    for name, b in cfg.benchmarks.items():
        if not isinstance(b, DictConfig):
            raise ValueError(f"benchmarks.{name} must be a section with dataset and k (or null "
                             f"to drop it), got {b!r}")
        for k in b:
            if k not in ("k", "dataset"):
                raise ValueError(f"unknown config key 'benchmarks.{name}.{k}'; valid keys: "
                                 f"['dataset', 'k']")
        Int(1).check(f"benchmarks.{name}.k", b.get("k"))
        if b.get("dataset") is None:
            raise ValueError(f"benchmarks.{name}.dataset is required")
        benchmarks[str(name)] = _read(b, BenchmarkConfig, f"benchmarks.{name}.")
    typed = _read(cfg, EvalConfig, "", skip=("benchmarks",))
    typed.benchmarks = benchmarks
    _check_vllm(typed.generation)
    return typed
