"""The typed config schema (``pepo.training.schema``) and the three validation phases of
``pepo.training.config.validate_config``: schema, then rules between keys, then the machine."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pepo import estimators
from pepo.training import schema
from pepo.training.config import (
    RESUME_MAY_CHANGE,
    find_config,
    prior_fingerprint,
    register_resolvers,
    setting_warnings,
    val_before_fingerprint,
    validate_config,
    validate_eval_config,
)
from tests.recipe_helpers import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]


def plain_reward(responses, answers):
    """A reward as TRL takes one: a function, which a ``_component_`` is not."""
    return [float(a in r) for r, a in zip(responses, answers)]


def make_reward(threshold):
    """A reward factory: a function that is a component (it returns the reward)."""
    return lambda responses, answers: [float(len(r) > threshold) for r in responses]


def _fmt(v) -> str:
    """How docs/recipe.md writes a default."""
    if v is schema.REQUIRED:
        return "required"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return f"`{v}`"
    return str(v)


def _key_table() -> dict[str, list[str]]:
    """docs/recipe.md's key table: the first cell's key -> the default cell of each row."""
    text = (ROOT / "docs" / "recipe.md").read_text(encoding="utf-8")
    section = text[text.index("## Every key"):]
    section = section[: section.index("\n## ", 5)]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        key = re.match(r"`([^`]+)`", cells[0]).group(1)
        rows.setdefault(key, []).append(cells[1])
    return rows


def test_the_docs_key_table_names_every_field_and_its_default():
    """Catches a key added to the schema (or a default changed) without its row in the docs:
    every field of RecipeConfig, and every estimator's keyword argument, has a row whose
    default is the schema's (the signature's for estimators)."""
    rows = _key_table()
    for key, f in schema.fields_of(schema.RecipeConfig):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        assert key in rows, f"docs/recipe.md has no row for {key!r}"
        assert _fmt(default) in rows[key], (key, rows[key])
    for name in ("group", "single_stream"):
        for p, param in inspect.signature(estimators.ESTIMATORS[name]).parameters.items():
            if p == "prior_pass_rates":
                continue
            assert _fmt(param.default) in rows.get(f"estimator.{p}", []), (name, p)


# RESUME_MAY_CHANGE as it was listed by hand before the schema's roles derived it
LISTED_BY_HAND = {
    "name", "output_dir", "resume_from_checkpoint", "imports", "checkpoint_dir",
    "tokenizer.path", "model.model_dir", "num_steps", "validation", "val_dataset",
    "save_every", "keep_checkpoints", "keep_best", "dump_rollouts_every", "plot", "metric_logger",
    "generation.batch_size", "generation.compile", "micro_batch_size", "prior_cache",
    "logprob_chunk_size", "logprobs_from_hidden", "save_logits_mib",
    "enable_activation_checkpointing",
    "max_nonfinite_steps", "reward.workers", "distributed.timeout_s", "recompute_old_logprobs",
    # memory settings given the RUN role since (a resume after running out of memory)
    "distributed.cpu_offload", *(f"generation.vllm.{k}" for k in (
        "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs", "enforce_eager",
        "sleep_level")),
}


def test_the_resume_and_prior_sets_come_from_the_roles():
    """Catches a role flag set wrong (a run setting that a resume would refuse, or an
    experiment key a resume could silently change): the derived sets are the hand-kept ones,
    and the prior ignores exactly the run settings inside the sections it depends on."""
    assert set(RESUME_MAY_CHANGE) == LISTED_BY_HAND
    assert len(RESUME_MAY_CHANGE) == len(LISTED_BY_HAND)
    assert set(schema.PRIOR_IGNORES) == LISTED_BY_HAND - {
        "checkpoint_dir", "tokenizer.path", "model.model_dir"}


def _named_in(paragraph_start: str, stop: str) -> set[str]:
    """The backticked names of docs/recipe.md's text from ``paragraph_start`` to ``stop``."""
    text = (ROOT / "docs" / "recipe.md").read_text(encoding="utf-8")
    part = text[text.index(paragraph_start):]
    return set(re.findall(r"`([^`]+)`", part[: part.index(stop)]))


def test_the_docs_say_every_key_a_resume_may_change_and_what_the_prior_records():
    """Catches a key given the RUN role (or a new one) that docs/recipe.md's resume paragraph
    does not name, so that a reader believes a resume would refuse it (the paragraph missed
    eight such keys), and a prior key the prior cache's paragraph leaves out."""
    named = _named_in("What may change", "**Stopping.**")
    assert set(RESUME_MAY_CHANGE) <= named, sorted(set(RESUME_MAY_CHANGE) - named)
    from pepo.training.config import PRIOR_KEYS

    recorded = _named_in("The file\nrecords what the prior depends on", ")")
    by_word = {"seed", "tokenizer", "model", "dataset", "reward", "generation"}  # as words
    assert set(PRIOR_KEYS) - by_word <= recorded, sorted(set(PRIOR_KEYS) - by_word - recorded)


def test_the_prior_fingerprint_ignores_run_settings_only(tmp_path):
    """A run setting inside the prior's sections (generation.batch_size) leaves the fingerprint
    alone; an experiment setting beside it (generation.top_p) changes it."""
    register_resolvers()
    base = prior_fingerprint(tiny_cfg(tmp_path, "tiny_spo"))
    assert prior_fingerprint(tiny_cfg(tmp_path, "tiny_spo", generation={"batch_size": 3})) == base
    assert prior_fingerprint(tiny_cfg(tmp_path, "tiny_spo", generation={"top_p": 0.5})) != base


@pytest.mark.parametrize("units, chosen", [((), "fp32"), (("amx_bf16",), "bf16")])
def test_the_cache_fingerprints_record_the_precision_auto_chose(tmp_path, monkeypatch, units,
                                                                 chosen):
    """``compute_dtype: auto`` samples in bf16 on a CPU with bf16 units and in fp32 elsewhere:
    catches a prior or validation cache made on one kind of machine read on the other (the
    fingerprint held only the word ``auto``). An explicit setting adds nothing."""
    from pepo.training import precision

    register_resolvers()
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: units)
    for fingerprint in (prior_fingerprint, val_before_fingerprint):
        fp = fingerprint(tiny_cfg(tmp_path, "tiny_spo", compute_dtype="auto"))
        assert fp["compute_dtype"] == "auto" and fp["compute_dtype_resolved"] == chosen
        fixed = fingerprint(tiny_cfg(tmp_path, "tiny_spo", compute_dtype="fp32"))
        assert "compute_dtype_resolved" not in fixed


@pytest.mark.parametrize("override, message", [
    ({"optimizer": {"lrr": 1e-3}},
     "optimizer: torch.optim.AdamW got an unexpected keyword argument 'lrr'; did you mean "
     "'optimizer.lr'?"),
    ({"lr_scheduler": {"_component_":
                       "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup"}},
     "lr_scheduler: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup missing a "
     "required argument: 'num_warmup_steps'"),
    ({"model": {"_component_": "pepo.training.models.tiny_qwen4"}},
     "model: cannot import 'pepo.training.models.tiny_qwen4': pepo.training.models has no "
     "'tiny_qwen4'; did you mean 'tiny_qwen3'?"),
    ({"val_dataset": {"splt": "val"}}, "val_dataset: pepo.tasks.problems.modsum_dataset got an "
                                       "unexpected keyword argument 'splt'; did you mean "
                                       "'val_dataset.split'?"),
    # a TRL-style reward function: built (called) with the section's keys, no responses
    ({"reward": {"_component_": "tests.training.test_config_schema.plain_reward"}},
     "reward: tests.training.test_config_schema.plain_reward missing a required argument: "
     "'responses' (reward._component_ is built with its keys, then called on (responses, "
     "answers): name a class whose instances are, not a function)"),
    # a factory function is a component: its missing key is named, with no word of classes
    ({"reward": {"_component_": "tests.training.test_config_schema.make_reward"}},
     "reward: tests.training.test_config_schema.make_reward missing a required argument: "
     "'threshold'"),
])
def test_a_component_typo_fails_at_validation_before_anything_is_built(tmp_path, override,
                                                                        message):
    """Catches components checked only when built (after the tokenizer, data and model): the
    error comes from validate_config, with no recipe object set up."""
    with pytest.raises(ValueError) as e:
        validate_config(tiny_cfg(tmp_path, **override))
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)
    assert ("name a class" in str(e.value)) == ("name a class" in message)  # only for those


def test_phases_run_in_order_schema_then_rules_then_machine(tmp_path):
    """Catches checks interleaved across phases: a type error is reported before a batch that
    does not split, and that before a missing checkpoint directory."""
    missing = str(tmp_path / "no_such_ckpt")
    with pytest.raises(ValueError, match="^dtype must be 'fp32' or 'bf16', got 'fp16'"):
        validate_config(tiny_cfg(tmp_path, dtype="fp16", checkpoint_dir=missing))
    with pytest.raises(ValueError, match="^plot must be true or false, got 'yes'"):
        validate_config(tiny_cfg(tmp_path, plot="yes", micro_batch_size=3))
    with pytest.raises(ValueError, match="^micro_batch_size=3 does not divide"):
        validate_config(tiny_cfg(tmp_path, micro_batch_size=3, checkpoint_dir=missing))
    with pytest.raises(ValueError, match="^checkpoint_dir=.* does not exist"):
        validate_config(tiny_cfg(tmp_path, checkpoint_dir=missing))


@pytest.mark.parametrize("override, message", [
    ({"plot": "yes"}, "plot must be true or false, got 'yes'"),
    ({"logprobs_from_hidden": 1}, "logprobs_from_hidden must be true or false, got 1"),
    ({"logprob_chunk_size": None}, "logprob_chunk_size must be an int >= 1, got None"),
    ({"resume_from_checkpoint": "no"}, "resume_from_checkpoint must be true or false"),
    ({"distributed": {"cpu_offload": "false"}}, "distributed.cpu_offload must be true or false"),
])
def test_every_key_is_typed(tmp_path, override, message):
    """Catches keys read with ``bool(cfg.get(...))`` (``plot: "yes"``, or ``"false"`` that is
    True) or passed on unchecked (a null chunk size failing at the first forward)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(tiny_cfg(tmp_path, **override))


@pytest.mark.parametrize("override, message", [
    # one string iterated as a list: each character a stop token (every run scored 0), or a
    # module per character
    ({"generation": {"stop_tokens": "box"}},
     "generation.stop_tokens must be a list of tokens (strings in the vocabulary) "
     "(generation.stop_tokens=[box]), got 'box'"),
    ({"imports": "my_strategies"},
     "imports must be a list of module names (imports=[my_strategies]), got 'my_strategies'"),
    # a quoted "false" is True; 0 switched GRPO to Dr. GRPO in silence
    ({"estimator": {"normalize_std": "false"}},
     "estimator.normalize_std must be True or False, got 'false'"),
    ({"estimator": {"unbiased": 0}}, "estimator.unbiased must be True or False, got 0"),
    # a value where a section belongs: a traceback, a silent pass, a misleading key
    ({"generation": 5}, "generation must be a section (a mapping of its keys), got 5"),
    ({"distributed": 5}, "distributed must be a section (a mapping of its keys), got 5"),
    ({"strategy": "proximal_softmax"}, "strategy must be a section with a name and its "
     "parameters, got 'proximal_softmax' (did you mean strategy.name=proximal_softmax?)"),
    ({"estimator": "group"}, "estimator must be a section with a name and its parameters, "
     "got 'group' (did you mean estimator.name=group?)"),
    # what the recipe passes the engine itself
    ({"generation": {"vllm": {"seed": 1}}}, "unknown config key 'generation.vllm.seed'; valid "
     "keys: ['device', 'dtype', 'enforce_eager', 'gpu_memory_utilization', "
     "'kv_cache_memory_bytes', 'max_model_len', 'max_num_seqs', 'sleep_level']"),
    # the rules between keys: compiling is the in-process decoder's
    ({"generation": {"engine": "vllm", "compile": True}},
     "generation.compile applies to the in-process decoder (generation.engine=inprocess); vLLM "
     "compiles its own model"),
    ({"tokenizer": {"path": None}}, "config key 'tokenizer.path' is required"),
    ({"generation": {"vllm": 5}},
     "generation.vllm must be a mapping of the engine's options, got 5"),
    ({"loss": {"eps_low": 1.0}}, "loss.eps_low must be < 1 (the ratio floor 1 - eps_low must "
     "be > 0), got 1.0"),
    # a loss that takes no clip range: a TypeError at the first update
    ({"loss": {"_component_": "torch.nn.functional.mse_loss"}},
     "loss: torch.nn.functional.mse_loss got an unexpected keyword argument 'eps_low'"),
    # the core's message, read as the config key (not "estimator name must be ...")
    ({"estimator": {"name": "grpo"}}, "estimator.name must be one of ['group', "
     "'single_stream'], got 'grpo' (the paper's GRPO is 'group')"),
    ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    # torch checked these once the model was built: an IndexError traceback for [0.9]
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas must be two numbers in [0, 1), got [0.9]"),
    ({"optimizer": {"betas": [0.9, 1.5]}},
     "optimizer.betas must be two numbers in [0, 1), got [0.9, 1.5]"),
    # torch's own 'Invalid weight_decay value' came only after the model was loaded
    ({"optimizer": {"weight_decay": -0.1}},
     "optimizer.weight_decay must be a finite number >= 0, got -0.1"),
    ({"optimizer": {"eps": -1e-8}}, "optimizer.eps must be a finite number >= 0, got -1e-08"),
    # infinity passed: an eval sampled uniformly and reported 0.00; training failed after its
    # first generation, in pepo.entropy, naming no config key
    ({"generation": {"temperature": float("inf")}},
     "generation.temperature must be a finite number > 0.0, got inf"),
    ({"generation": {"temperature": 0}},  # an open bound: 0 divides the logits by zero
     "generation.temperature must be a finite number > 0.0, got 0"),
    ({"generation": {"temperature": True}},  # True is an int to isinstance: 1.0
     "generation.temperature must be a finite number > 0.0, got True"),
    ({"distributed": {"timeout_s": float("inf")}},  # an OverflowError on every rank
     "distributed.timeout_s must be a finite number > 0, got inf"),
    # a TypeError from the cache's file handling, after the model was built
    ({"validation": {"before_cache": True}},
     "validation.before_cache must be a file path or null, got True"),
    # a run's object, not a setting: an AttributeError after the first generation
    ({"strategy": {"name": "global_topk", "global_topk": {"process_group": "abc"}}},
     "strategy.global_topk.process_group is not a config key: the recipe passes its "
     "process_group itself"),
    ({"lr_scheduler": {"_component_": "torchtune.training.lr_schedulers."
                                      "get_cosine_schedule_with_warmup",
                       "num_warmup_steps": -5}},  # it started already decayed
     "lr_scheduler.num_warmup_steps must be an int >= 0, got -5"),
    # True is an int to isinstance: num_steps: true trained one step
    ({"logprob_chunk_size": True}, "logprob_chunk_size must be an int >= 1, got True"),
    # an empty stop token ("" is in every response)
    ({"generation": {"stop_tokens": ["<|im_end|>", ""]}},
     "generation.stop_tokens must be a list of tokens (strings in the vocabulary), got "
     "['<|im_end|>', '']"),
    # beta 1 (torch's own check refuses it once the model is built)
    ({"optimizer": {"betas": [0.9, 1.0]}},
     "optimizer.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
    # a bool is an int to isinstance: false read as beta 0
    ({"optimizer": {"betas": [0.9, False]}},
     "optimizer.betas must be two numbers in [0, 1), got [0.9, False]"),
    # three betas
    ({"optimizer": {"betas": [0.9, 0.95, 0.99]}},
     "optimizer.betas must be two numbers in [0, 1), got [0.9, 0.95, 0.99]"),
    # a device string with a valid start
    ({"device": "cuda:0x"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:0x'"),
    ({"device": "cpus"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'cpus'"),
    # an empty path (a cache never read nor written, in silence)
    ({"validation": {"before_cache": ""}},
     "validation.before_cache must be a file path or null, got ''"),
])
def test_a_value_of_the_wrong_shape_is_refused_naming_it(tmp_path, override, message):
    """Each was accepted (and trained something else), or failed far from its cause. Among
    them the rules' edges: catches a bool taken for an int, an empty string in a list of
    strings, a beta of 1 or a third beta let through, a device matched on its start only, and
    an empty file path taken for one."""
    cfg = tiny_cfg(tmp_path)
    for k, v in override.items():  # a whole section replaced, as a command line override does
        if isinstance(v, dict) and k in cfg and OmegaConf.is_dict(cfg[k]):
            cfg[k] = OmegaConf.merge(cfg[k], v)
        else:
            cfg[k] = v
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        validate_config(cfg)


def test_valid_betas_pass(tmp_path):
    cfg = tiny_cfg(tmp_path)
    cfg.optimizer.betas = [0.9, 0.99]
    validate_config(cfg)


def test_zero_weight_decay_and_eps_pass(tmp_path):
    """Catches the optimizer's bounds made open (``> 0``): torch accepts 0 for both."""
    cfg = tiny_cfg(tmp_path)
    cfg.optimizer.weight_decay = 0.0
    cfg.optimizer.eps = 0
    validate_config(cfg)


def test_imports_resolve_their_interpolations(tmp_path):
    """Catches the module list read without resolving ``${...}``: 'cannot import '${m}''."""
    cfg = tiny_cfg(tmp_path)
    cfg.m = "json"
    cfg.imports = ["${m}"]
    validate_config(cfg)


def test_defaults_are_the_schemas_and_the_recipes_read_none_of_their_own(tmp_path):
    """Catches a default written a second time (``cfg.get("logprob_chunk_size", 1024)`` in the
    recipe, ``timeout_s`` 1800 in three places): a config without these keys gets the
    schema's values, and the recipe scripts call ``.get(key, default)`` nowhere."""
    cfg = tiny_cfg(tmp_path)
    for key in ("logprob_chunk_size", "keep_best", "distributed"):
        cfg.pop(key, None)
    cfg.generation.pop("engine")
    typed = validate_config(cfg)
    fields = {k: f for k, f in schema.fields_of(schema.RecipeConfig)}
    assert typed.logprob_chunk_size == fields["logprob_chunk_size"].default == 1024
    assert typed.keep_best is fields["keep_best"].default is True
    assert typed.distributed.timeout_s == fields["distributed.timeout_s"].default == 1800.0
    assert typed.generation.engine == "inprocess"
    for script in ("pepo_recipe.py", "pepo_eval.py"):
        tree = ast.parse((ROOT / "recipes" / script).read_text(encoding="utf-8"))
        with_default = [ast.unparse(n) for n in ast.walk(tree)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr == "get" and len(n.args) == 2]
        assert with_default == [], (script, with_default)


def test_the_eval_recipe_shares_the_schema(tmp_path):
    """Catches pepo_eval keeping a schema of its own that checks no values: its sampling keys
    are the training recipe's (one dataclass, the same rules)."""
    register_resolvers()
    assert issubclass(schema.GenerationConfig, schema.SamplingConfig)
    assert dataclasses.fields(schema.EvalConfig)[
        [f.name for f in dataclasses.fields(schema.EvalConfig)].index("generation")
    ].metadata["section"] is schema.SamplingConfig
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.output_dir = str(tmp_path / "out")
    typed = validate_eval_config(cfg)
    assert typed.batch_size == 256 and typed.generation.engine == "inprocess"
    cfg.generation.top_k = 0
    with pytest.raises(ValueError, match=r"^generation.top_k must be an int >= 1 or null, got 0"):
        validate_eval_config(cfg)


def test_the_schema_knows_the_engines():
    from pepo.training.engines import ENGINES, OLD_NAMES

    assert tuple(ENGINES) == schema.ENGINE_NAMES
    assert {("generation.engine", old): new for old, new in OLD_NAMES.items()} == {
        k: v for k, v in schema.ALIASES.items() if k[0] == "generation.engine"}


def test_the_engines_old_name_still_works_with_a_one_line_notice(tmp_path, caplog):
    """``generation.engine=torchtune`` (the in-process engine's name before it was called
    ``inprocess``): the config is validated under the new name with one notice, a checkpoint or
    prior cache saved under the old name is not a change of experiment, and ``build_engine``
    takes it. Catches an alias that is refused, silently kept (two names for one engine in the
    experiment record), or that makes old checkpoints unresumable."""
    import logging

    from pepo.training.config import experiment_changes, experiment_config
    from pepo.training.engines import InProcessEngine, build_engine
    from pepo.training.models import tiny_qwen3

    cfg = tiny_cfg(tmp_path)
    cfg.generation.engine = "torchtune"
    with caplog.at_level(logging.WARNING, logger="pepo"):
        typed = validate_config(cfg)
    assert typed.generation.engine == "inprocess" and cfg.generation.engine == "inprocess"
    notices = [r.getMessage() for r in caplog.records if "torchtune" in r.getMessage()]
    assert notices == ["generation.engine=torchtune is now called inprocess; the old name still "
                       "works"]
    now = experiment_config(cfg)
    saved = {**now, "generation.engine": "torchtune"}
    assert experiment_changes(saved, now) == []
    assert experiment_changes({**now, "generation.engine": "vllm"}, now) == [
        "generation.engine ('vllm' -> 'inprocess')"]
    assert isinstance(build_engine("torchtune", tiny_qwen3()), InProcessEngine)


def test_a_resume_may_change_how_long_ranks_wait(tmp_path):
    """``distributed.timeout_s`` changes no number of the run (a resumed run on a slower cluster
    needs a longer one); ``distributed.mixed_precision`` does. Catches the timeout recorded as
    part of the experiment, which refused such a resume."""
    from pepo.training.config import experiment_config

    keys = experiment_config(tiny_cfg(tmp_path))
    assert "distributed.timeout_s" not in keys and "distributed.timeout_s" in \
        schema.RESUME_MAY_CHANGE
    assert "distributed.mixed_precision" not in schema.RESUME_MAY_CHANGE


@pytest.mark.parametrize("generation, tis_cap, filters", [
    ({"top_p": 0.6}, 2.0, "generation.top_p=0.6"),
    ({"top_k": 20}, 1.5, "generation.top_k=20"),
    ({"top_p": 0.9, "top_k": 20}, 2.0, "generation.top_p=0.9 and generation.top_k=20"),
    ({"top_p": 1.0}, 2.0, None), ({"top_p": 0.6}, None, None)])
def test_tis_under_a_sampling_filter_is_warned_of(tmp_path, generation, tis_cap, filters):
    """Catches the warning missing where the capped ratio is the filter's kept mass (every
    token's loss scaled below 1), or given where there is no filter or no TIS."""
    cfg = tiny_cfg(tmp_path, generation=generation, loss={"tis_cap": tis_cap})
    got = setting_warnings(validate_config(cfg))
    if filters is None:
        assert got == []
    else:
        (line,) = got
        assert line.startswith(f"loss.tis_cap={tis_cap:g} with {filters}: the engine's log-prob "
                               "is the filtered, renormalised distribution's"), line


def test_validation_without_a_val_dataset_is_warned_of(tmp_path):
    """Catches the paper configs' validation.every=50 with val_dataset=null passing in silence
    (every validation printed nan, and summary.json held a NaN)."""
    got = setting_warnings(validate_config(tiny_cfg(tmp_path, val_dataset=None,
                                                    validation={"every": 5})))
    assert got == ["validation.every=5 with val_dataset=null: no validation is run (and no "
                   "best checkpoint kept); set val_dataset to validate"]
    assert setting_warnings(validate_config(tiny_cfg(tmp_path, val_dataset=None))) == []
    assert setting_warnings(validate_config(tiny_cfg(
        tmp_path, val_dataset=None, validation={"every": 5}, keep_best=False))) == [
        "validation.every=5 with val_dataset=null: no validation is run; set val_dataset to "
        "validate"]


def test_settings_the_run_will_not_use_are_warned_of(tmp_path):
    """Catches validation.dump / before_cache with validation.every=0 and save_logits_mib
    without logprobs_from_hidden accepted in silence (nothing is dumped, cached or kept), and a
    warning where they are used."""
    got = setting_warnings(validate_config(tiny_cfg(
        tmp_path, validation={"every": 0, "dump": True, "before_cache": str(tmp_path / "v.json")},
        save_logits_mib=64)))
    assert got == ["validation.dump, validation.before_cache, save_logits_mib=64 (it works with "
                   "logprobs_from_hidden=true): not used by this run (validation.every=0: no "
                   "validation)"]
    assert setting_warnings(validate_config(tiny_cfg(
        tmp_path, validation={"every": 1, "dump": True}, save_logits_mib=64,
        logprobs_from_hidden=True))) == []


def test_a_resume_may_change_the_vllm_engines_memory_but_not_its_dtype(tmp_path):
    """Catches ``generation.vllm`` kept whole in the experiment record: a run that ran out of
    memory could not resume with a smaller KV cache (and an in-process run, which never reads
    these options, could not change them either), while the engine's dtype, which changes the
    rollouts, must still be refused."""
    from pepo.training.config import experiment_config, recipe_changes

    def experiment(**vllm):
        return experiment_config(tiny_cfg(tmp_path, generation={"vllm": {
            "max_num_seqs": 128, "kv_cache_memory_bytes": 2**28, "dtype": "float32", **vllm}}))

    saved = experiment()
    assert recipe_changes(saved, experiment(
        max_num_seqs=64, kv_cache_memory_bytes=2**27, gpu_memory_utilization=0.3,
        enforce_eager=True, sleep_level=1)) == []
    assert recipe_changes(saved, experiment(dtype="bfloat16")) == [
        "generation.vllm.dtype ('float32' -> 'bfloat16')"]
    assert recipe_changes(saved, experiment(max_model_len=64)) == [
        "generation.vllm.max_model_len ('<unset>' -> 64)"]


def test_a_checkpoint_or_prior_saved_before_a_key_became_a_run_setting_still_matches(tmp_path):
    """An earlier pepo recorded the vLLM engine's memory options and distributed.cpu_offload
    in each checkpoint's experiment and each prior cache's fingerprint; they are run settings
    now, which the current side leaves out. Catches them compared as changes (every bundled
    config sets some: tiny's resume was refused, 'max_num_seqs (128 -> <unset>)')."""
    from pepo.training import config as config_module
    from pepo.training import prior_cache
    from pepo.training.config import experiment_config, recipe_changes

    cfg = tiny_cfg(tmp_path, "tiny_spo", generation={"vllm": {"max_num_seqs": 128}})
    old = {"generation.vllm.max_num_seqs": 128, "generation.vllm.kv_cache_memory_bytes": 2**28,
           "distributed.cpu_offload": True}
    now = experiment_config(cfg)
    assert recipe_changes({**now, **old}, now, schema.RESUME_MAY_CHANGE) == []
    assert recipe_changes({**now, "seed": 5}, now, schema.RESUME_MAY_CHANGE) != []

    class Saved:  # a checkpointer holding an earlier pepo's checkpoint
        root = tmp_path

        def load_latest(self):
            return tmp_path / "step_1", {"step": 1, "experiment": {**now, **old}}

    assert config_module.resumable_checkpoint(Saved(), now, 2, print)[0].name == "step_1"
    prior = prior_fingerprint(cfg)
    path = tmp_path / "prior.json"
    prior_cache.write_prior(path, {**prior, **old}, {"p0": 0.5})
    assert prior_cache.read_prior(path, prior, ["p0"]) == {"p0": 0.5}


def test_a_default_spelled_out_is_no_change_of_experiment_or_cache(tmp_path):
    """Catches the comparison of the raw configs: ``compute_dtype=fp32`` (the default) given on
    a resume refused it as ``compute_dtype ('<unset>' -> 'fp32')``, and a checkpoint or cache
    written before a key existed must still match a config that leaves it at its default.
    A real change is still named."""
    from pepo.training.config import experiment_config, recipe_changes

    plain = tiny_cfg(tmp_path, "tiny_spo")
    spelled = tiny_cfg(tmp_path, "tiny_spo", compute_dtype="fp32",
                       loss={"_component_": "pepo.loss.ClippedPolicyLoss", "tis_cap": None},
                       generation={"top_k": None})
    for made in (experiment_config, prior_fingerprint, val_before_fingerprint):
        assert recipe_changes(made(plain), made(spelled)) == [], made.__name__
        assert recipe_changes(made(spelled), made(plain)) == [], made.__name__
    assert "compute_dtype ('fp32' -> 'bf16')" in recipe_changes(
        experiment_config(spelled), experiment_config(tiny_cfg(tmp_path, "tiny_spo",
                                                               compute_dtype="bf16")))


def test_val_dataset_null_on_the_command_line_means_none(tmp_path):
    """torchtune turns ``val_dataset=null`` into ``val_dataset._component_=null`` and keeps the
    section's other keys; catches a nullable component that takes only a literal null (the
    override failed: "val_dataset must be a section with a _component_"). A required component
    set to null is still refused."""
    from argparse import Namespace

    from torchtune.config._utils import _merge_yaml_and_cli_args

    def merged(*overrides):
        base = OmegaConf.to_container(tiny_cfg(tmp_path), resolve=False)
        return _merge_yaml_and_cli_args(Namespace(**base), list(overrides))

    cfg = merged("val_dataset=null")
    assert cfg.val_dataset._component_ is None and cfg.val_dataset.size == 4
    assert validate_config(cfg).val_dataset is None
    assert validate_config(merged()).val_dataset is not None
    with pytest.raises(ValueError, match="^config key 'reward' is required$"):
        validate_config(merged("reward=null"))


def test_a_benchmark_set_to_null_is_dropped(tmp_path):
    """``benchmarks.NAME=null`` is how an evaluation leaves out a bundled benchmark; catches the
    ``TypeError`` it raised, and dropping every benchmark passing."""
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.output_dir = str(tmp_path / "out")
    (name,) = cfg.benchmarks
    cfg.benchmarks.copy = OmegaConf.to_container(cfg.benchmarks[name])
    cfg.benchmarks[name] = None
    typed = validate_eval_config(cfg)
    assert list(typed.benchmarks) == ["copy"] and list(cfg.benchmarks) == ["copy"]
    cfg.benchmarks.copy = None
    with pytest.raises(ValueError, match=r"^every benchmark is dropped \(null\): \['copy'\]"):
        validate_eval_config(cfg)
    cfg.benchmarks = {"x": 5}
    with pytest.raises(ValueError, match=r"^benchmarks.x must be a section with dataset and k"):
        validate_eval_config(cfg)
    cfg.benchmarks = {"x": {"k": 1}}  # the dataset is the benchmark
    with pytest.raises(ValueError, match=r"^benchmarks.x.dataset is required$"):
        validate_eval_config(cfg)
    cfg.benchmarks = {"x": {"k": 1, "datset": {}}}
    with pytest.raises(ValueError, match=r"^unknown config key 'benchmarks.x.datset'; valid keys: "
                                         r"\['dataset', 'k'\]$"):
        validate_eval_config(cfg)
    cfg.benchmarks = ["eval_tiny"]  # a list of names: a traceback from .items()
    with pytest.raises(ValueError, match=r"^benchmarks must be a mapping name -> \{dataset, k\}, "
                                         r"got \['eval_tiny'\]$"):
        validate_eval_config(cfg)


def test_the_command_line_forms_torchtune_cannot_take_are_named(capsys):
    """``--config=tiny`` (argparse's form, which ``python -m pepo_recipe`` takes) is resolved as
    ``--config tiny`` (it was read as a file in the working directory); an override whose value
    holds '=' (a directory named lr=1e-6) exits with one line instead of torchtune's
    traceback."""
    from pepo.training.config import resolve_config_arg

    assert resolve_config_arg(["x", "--config=tiny", "seed=1"]) == [
        "x", "--config", find_config("tiny"), "seed=1"]
    with pytest.raises(SystemExit, match="torchtune's overrides take one '='"):
        resolve_config_arg(["x", "--config", "tiny", "output_dir=runs/lr=1e-6"])
    assert resolve_config_arg(["x", "--config", "tiny", "~val_dataset"])[-1] == "~val_dataset"
    with pytest.raises(SystemExit, match=r"^error: --config needs a config: a bundled name"):
        resolve_config_arg(["x", "--config"])  # an IndexError traceback, not a line


def test_a_config_file_that_is_not_a_mapping_or_of_the_other_recipe_is_one_line(tmp_path):
    """A YAML syntax error or a top-level list was a yaml/torchtune traceback; an eval config
    given to pepo_recipe (or an empty one) said ``estimator.name must be one of ..., got None``,
    a training config given to pepo_eval ``unknown config key 'name'``. Catches each of them
    reaching the schema (or torchtune) unexplained."""
    from omegaconf import OmegaConf

    from pepo.training.config import resolve_config_arg, validate_config, validate_eval_config

    bad, listed = tmp_path / "bad.yaml", tmp_path / "list.yaml"
    bad.write_text("a: [1, 2\nb: 3\n")
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(SystemExit, match=rf"^error: {bad} is not a YAML config: while parsing"):
        resolve_config_arg(["x", "--config", str(bad)])
    with pytest.raises(SystemExit, match=r": a config is a YAML mapping of keys, not a list$"):
        resolve_config_arg(["x", "--config", str(listed)])
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\n")  # not UTF-8: the error named no file
    with pytest.raises(SystemExit, match=rf"^error: {latin} is not a YAML config: 'utf-8'"):
        resolve_config_arg(["x", "--config", str(latin)])
    with pytest.raises(ValueError, match=r"^this is an evaluation config .* `tune run pepo_eval`$"):
        validate_config(OmegaConf.load(find_config("eval_tiny")))
    with pytest.raises(ValueError, match=r"^this is not a training config: it has no strategy or "
                                         r"estimator section \(its keys: history, val_problems\)"):
        validate_config(OmegaConf.create({"history": [], "val_problems": 4}))
    with pytest.raises(ValueError, match=r"^the config is empty"):
        validate_config(OmegaConf.create({}))
    with pytest.raises(ValueError, match=r"^the config is empty"):
        validate_config(OmegaConf.create({"imports": []}))  # nothing but the modules to import
    with pytest.raises(ValueError, match=r"^this is a training config .* `tune run pepo_recipe`$"):
        validate_eval_config(OmegaConf.load(find_config("tiny")))
    with pytest.raises(ValueError, match=r"^this is a training config .* `tune run pepo_recipe`$"):
        validate_eval_config(OmegaConf.create({"estimator": {"name": "group"}}))  # no strategy
    register_resolvers()
    validate_eval_config(OmegaConf.load(find_config("eval_tiny")))  # its own kind passes


def test_fsdp_settings_on_one_process_are_refused(tmp_path):
    """``distributed.mixed_precision`` and ``cpu_offload`` apply to FSDP2, which a run of one
    process does not use: catches them accepted there and dropped in silence (an fp32 run
    recorded as bf16 mixed precision)."""
    from pepo.training.config import check_world_size

    cfg = tiny_cfg(tmp_path, prompts_per_step=4, micro_batch_size=2)
    check_world_size(cfg, 1)
    cfg.distributed = {"mixed_precision": "bf16"}
    with pytest.raises(ValueError, match=r"^distributed.mixed_precision=bf16 is FSDP2's"):
        check_world_size(cfg, 1)
    check_world_size(cfg, 2)
    cfg.distributed = {"mixed_precision": None, "cpu_offload": True}
    with pytest.raises(ValueError, match=r"^distributed.cpu_offload=true is FSDP2's"):
        check_world_size(cfg, 1)


@pytest.mark.parametrize("device, world, refused", [
    ("cuda", 2, True), ("cuda:1", 1, True), ("cuda", 1, False), ("cuda:0", 1, False),
    ("cpu", 2, False),
])
def test_vllm_is_refused_where_it_would_not_run_beside_its_trainer(tmp_path, device, world,
                                                                   refused):
    """vLLM's single-process engine runs on the first GPU whatever the process's (its device
    string has no index): catches every torchrun process's engine put on GPU 0 (and a trainer on
    cuda:1 beside an engine on cuda:0) accepted, and a refusal of what works (one process on
    the first GPU, CPU processes)."""
    from pepo.training.config import check_world_size

    cfg = tiny_cfg(tmp_path, prompts_per_step=4, micro_batch_size=2, device=device)
    cfg.generation.engine = "vllm"
    if refused:
        where = f"{world} CUDA processes" if world > 1 else f"device={device}"
        with pytest.raises(ValueError, match=rf"^generation.engine=vllm with {where}: vLLM's "
                                             rf"single-process engine runs on the first GPU"):
            check_world_size(cfg, world)
    else:
        check_world_size(cfg, world)
    cfg.generation.engine = "inprocess"
    check_world_size(cfg, world)


@pytest.mark.parametrize("cuda_build, advice", [
    (None, r"use device=cpu, or a CUDA build of torch on a machine with a GPU$"),
    ("13.0", r"this torch is built for CUDA 13.0: check that a GPU is visible and its driver "
             r"supports that CUDA \(nvidia-smi\)$"),
])
def test_cuda_unavailable_says_what_to_check(monkeypatch, cuda_build, advice):
    """A CUDA build of torch that sees no GPU (none visible, or a driver too old for its CUDA)
    is told to check the driver, a CPU build to use the CPU or install a CUDA build: catches the
    advice to install a CUDA build given to one who has it."""
    import torch

    from pepo.training.config import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(ValueError, match=r"^device='cuda' but CUDA is not available here "
                                         r"\(torch [^)]+\); " + advice):
        check_device("cuda")
    check_device("cpu")


def test_fp16_mixed_precision_is_refused(tmp_path):
    """Nothing scales the loss, so fp16 gradients could underflow in silence: catches fp16
    accepted where ``dtype`` and ``compute_dtype`` already refuse it."""
    cfg = tiny_cfg(tmp_path, distributed={"mixed_precision": "fp16"})
    with pytest.raises(ValueError, match=r"^distributed.mixed_precision must be null or 'bf16' "
                                         r"\(fp16 needs loss scaling, which pepo does not do\), "
                                         r"got 'fp16'$"):
        schema.parse(cfg)


def test_pepo_eval_refuses_vllm_on_a_gpu_it_would_not_run_on(monkeypatch):
    """The eval script's vLLM engine on ``cuda:1`` would sample on ``cuda:0``: catches the eval
    config's check left out (the recipe's is in check_world_size)."""
    import torch

    from pepo.training.config import validate_eval_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.device, cfg.generation.engine = "cuda:1", "vllm"
    with pytest.raises(ValueError, match=r"^generation.engine=vllm with device=cuda:1: vLLM's"):
        validate_eval_config(cfg)


@pytest.mark.parametrize("override, message", [
    ({"gradient_accumulation_steps": 2},
     r"unknown config key 'gradient_accumulation_steps'; pepo calls it micro_batch_size \("),
    ({"learning_rate": 1e-6}, r"unknown config key 'learning_rate'; pepo calls it optimizer.lr$"),
    ({"temperature": 0.6},
     r"unknown config key 'temperature'; pepo calls it generation.temperature$"),
    ({"loss": {"epsilon": 0.2}}, r"unknown config key 'loss.epsilon'; pepo calls it loss.eps_low"),
    ({"generation": {"max_completion_length": 64}},
     r"'generation.max_completion_length'; pepo calls it generation.max_new_tokens$"),
    ({"estimator": {"num_generations": 4}},
     r"unknown estimator key\(s\) \['num_generations'\] .*; pepo calls it estimator.group_size"),
    ({"beta": 0.04}, r"unknown config key 'beta'; pepo has no such key: .* no KL penalty$"),
    ({"loss": {"kl_coef": 0.1}},
     r"unknown config key 'loss.kl_coef'; pepo has no such key: .* no KL penalty$"),
    ({"optimizer": {"learning_rate": 1e-6}},
     r"got an unexpected keyword argument 'learning_rate'; pepo calls it optimizer.lr$"),
    # not another trainer's name, or one that means nothing pepo has there: the closest spelling
    ({"num_stepz": 2}, r"unknown config key 'num_stepz'; did you mean 'num_steps'\?$"),
    ({"dataset": {"batch_size": 2}}, r"'batch_size'; did you mean 'dataset.size'\?$"),
    # another trainer's name, but not for a key of the section it stands in
    ({"estimator": {"epsilon": 1e-3}}, r"\['epsilon'\] .*; did you mean 'estimator.eps'\?$"),
    ({"validation": {"n": 4}}, r"unknown config key 'validation.n'; valid keys: "),
    ({"generation": {"beta": 0.1}}, r"unknown config key 'generation.beta'; (did you|valid)"),
    ({"strategy": {"window_average": {"temperature": 1.0}}},
     r"'strategy.window_average.temperature'; valid keys: "),
])
def test_other_trainers_key_names_get_pepos_name(tmp_path, override, message):
    """Users write TRL's and verl's names (``gradient_accumulation_steps``, ``learning_rate``,
    ``num_generations``, ``beta``); the closest spelling sent ``gradient_accumulation_steps``
    to ``num_steps``. Catches the aliases not consulted (each message would be a did-you-mean),
    consulted in a component whose arguments they do not name (``dataset.batch_size`` is not
    the step's batch), or put before a misspelling of pepo's own key."""
    with pytest.raises(ValueError, match=message):
        validate_config(tiny_cfg(tmp_path, **override))


def test_an_eval_config_gets_no_training_keys_for_other_trainers_names(tmp_path):
    """``pepo_eval``'s config has no optimizer, estimator or step batch: the aliases that name
    them (``generation.batch_size`` was told prompts_per_step, ``n`` estimator.group_size)
    must not answer there. Catches the section rule not applied to eval configs."""
    from pepo.training.key_aliases import foreign_key_hint
    from pepo.training.schema import EvalConfig

    top = {f.name for f in dataclasses.fields(EvalConfig)}
    for name in ("n", "learning_rate", "per_device_train_batch_size", "num_generations"):
        assert foreign_key_hint(name, "", top) is None, name
    assert foreign_key_hint("temperature", "", top) == "pepo calls it generation.temperature"
    assert foreign_key_hint("batch_size", "generation.", {"temperature", "top_p"}) is None
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.learning_rate = 1e-6
    register_resolvers()
    with pytest.raises(ValueError, match=r"^unknown config key 'learning_rate'; (did you mean|"
                                         r"valid keys)"):
        validate_eval_config(cfg)


def test_an_alias_answers_only_for_an_unknown_key_of_its_own_section():
    """``foreign_key_hint``'s contract beyond the shipped schema's sections: catches a key that
    ``known`` holds getting the hint (it is no foreign name there), a section's hint given when
    the section lacks the aliased key, and one given in a section whose name is another's of
    the same length (``validation.`` for ``generation.``: the section read off by its length)."""
    from pepo.training.key_aliases import foreign_key_hint

    assert foreign_key_hint("temperature", "generation.", {"temperature", "top_p"}) is None
    assert foreign_key_hint("temperature", "", {"temperature", "generation"}) is None
    assert foreign_key_hint("max_tokens", "generation.", {"top_p"}) is None
    assert foreign_key_hint("max_tokens", "validation.", {"max_new_tokens"}) is None
    assert (foreign_key_hint("max_tokens", "generation.", {"max_new_tokens"})
            == "pepo calls it generation.max_new_tokens")


def test_every_key_alias_names_a_key_pepo_has():
    """Catches the alias table going stale: each entry's first word is a key of the docs' key
    table (``optimizer.lr`` an argument of the shipped optimizer), and the no-KL entries stay
    true of the loss (no argument mentions a KL term)."""
    from pepo.loss import ClippedPolicyLoss
    from pepo.training.key_aliases import ALIASES

    table = _key_table()
    for name, target in ALIASES.items():
        first = target.split(" ", 1)[0]
        if first == "pepo":
            assert "KL" in target and not any(
                "kl" in p.lower() or p == "beta"
                for p in inspect.signature(ClippedPolicyLoss).parameters), name
        elif first == "optimizer.lr":
            assert "lr" in inspect.signature(torch.optim.AdamW).parameters
        else:
            assert first in table, (name, first)
        assert name not in table, f"{name} is pepo's own key: an alias would never be asked"


def test_estimator_keys_its_flags_turn_off_are_warned_of(tmp_path):
    """The fuzz's estimator settings accepted where they do nothing: ``eps`` and ``unbiased``
    with ``normalize_std=false``, SPO's constant ``rho`` with adaptive forgetting (on by
    default) and ``rho_max`` / ``d_half`` without it. Catches a warning missed, a flag's
    default read the wrong way (``adaptive_forgetting`` is on when not given), and a warning
    for a key the config does not set or that the run uses."""
    def warned(name, **est):
        cfg = tiny_cfg(tmp_path, "tiny_spo" if name == "single_stream" else "tiny")
        cfg.estimator = {k: v for k, v in cfg.estimator.items()
                         if k not in ("rho", "rho_max", "d_half", "eps", "unbiased",
                                      "adaptive_forgetting")} | est
        return setting_warnings(validate_config(cfg))

    assert warned("group", normalize_std=False, eps=1e-3, unbiased=False) == [
        "estimator.eps, estimator.unbiased: not used with estimator.normalize_std=false"]
    assert warned("group", normalize_std=True, eps=1e-3, unbiased=False) == []
    assert warned("group", normalize_std=False) == []
    assert warned("single_stream", rho=0.9) == [
        "estimator.rho: not used with estimator.adaptive_forgetting=true"]
    assert warned("single_stream", adaptive_forgetting=False, rho=0.9, rho_max=0.96,
                  d_half=0.1) == ["estimator.rho_max, estimator.d_half: not used with "
                                  "estimator.adaptive_forgetting=false"]
    assert warned("single_stream", adaptive_forgetting=False, rho=0.9) == []
    assert warned("single_stream", normalize=False, eps=1e-3, rho_max=0.96) == [
        "estimator.eps: not used with estimator.normalize=false"]


def test_another_estimators_key_says_how_to_remove_it(tmp_path, monkeypatch):
    """Switching ``estimator.name`` on the command line to a registered estimator (the docs'
    ``dr_grpo``) left the config's ``normalize_std``, refused with its valid keys only; the
    way out, torchtune's ``~estimator.normalize_std``, was written nowhere. Catches the hint
    missing, and given for a key no estimator has (a misspelling)."""
    from pepo import estimators

    class DrGRPO(estimators.GroupEstimator):
        name = "test_dr_grpo"

        def __init__(self, group_size: int = 8):
            super().__init__(group_size, normalize_std=False)

    monkeypatch.setitem(estimators.ESTIMATORS, "test_dr_grpo", DrGRPO)
    cfg = tiny_cfg(tmp_path)
    cfg.estimator.name = "test_dr_grpo"
    with pytest.raises(ValueError, match=r"\['normalize_std'\] for estimator.name='test_dr_grpo'; "
                                         r"valid keys: .* \(a key of estimator.name='group': "
                                         r"remove it on the command line with "
                                         r"~estimator.normalize_std\)$"):
        validate_config(cfg)
    del cfg.estimator["normalize_std"]
    cfg.estimator.group_siz = 4
    with pytest.raises(ValueError, match=r"did you mean 'estimator.group_size'\?$"):
        validate_config(cfg)


def test_a_required_key_left_out_says_how_to_give_it():
    """A paper config run as it is (its checkpoint_dir is ???): the error named the key only,
    not that the command line takes it. Catches the hint lost, or given for another key."""
    from omegaconf import OmegaConf

    from pepo.training.config import find_config, register_resolvers, validate_config

    register_resolvers()
    with pytest.raises(ValueError, match=r"^config key 'checkpoint_dir' is required \(on the "
                                         r"command line: checkpoint_dir=\.\.\.\)$"):
        validate_config(OmegaConf.load(find_config("qwen3_1_7b_pepo")))


# ------------------------------------------------ paths and values that failed after the work


def test_a_cache_path_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """``prior_cache`` or ``validation.before_cache`` naming a directory, or a place nothing can
    be created, is one line from the machine phase. Catches the old order: SPO's offline prior
    (or the validation before training) computed, then ``IsADirectoryError`` from its write."""
    d = tmp_path / "a_dir"
    d.mkdir()
    spo = {"estimator": {"name": "single_stream", "prior_samples": 2}}
    with pytest.raises(ValueError, match=r"^prior_cache=.*a_dir' is a directory; prior_cache "
                                         r"names a file \(e.g. .*prior_cache.json'\)$"):
        validate_config(tiny_cfg(tmp_path, "tiny_spo", prior_cache=str(d), **spo))
    with pytest.raises(ValueError, match=r"^validation.before_cache=.*a_dir' is a directory; "
                                         r"validation.before_cache names a file \(e.g. "
                                         r".*a_dir/before_cache.json'\)$"):
        validate_config(tiny_cfg(tmp_path, validation={"every": 1, "before_cache": str(d)}))
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^validation.before_cache=.*a_file/v.json' cannot be "
                                         r"written: validation.before_cache=.* cannot be a "
                                         r"directory: .*a_file is a file$"):
        validate_config(tiny_cfg(tmp_path, validation={"every": 1, "before_cache":
                                                       str(blocker / "v.json")}))
    ok = tiny_cfg(tmp_path, validation={"every": 1, "before_cache": str(tmp_path / "n/v.json")})
    validate_config(ok)
    assert not (tmp_path / "n").exists()  # the check leaves nothing behind


def test_an_unwritable_metric_logger_dir_is_one_config_error(tmp_path):
    """Catches ``metric_logger.log_dir`` left to the logger: a ``FileNotFoundError`` traceback
    after the model was built, then a second from the logger's ``__del__``."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    cfg = tiny_cfg(tmp_path)
    cfg.metric_logger = OmegaConf.create({
        "_component_": "torchtune.training.metric_logging.DiskLogger",
        "log_dir": str(blocker / "logs")})
    with pytest.raises(ValueError, match=r"^metric_logger.log_dir=.*a_file/logs' cannot be a "
                                         r"directory: .*a_file is a file$"):
        validate_config(cfg)


COSINE = "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup"


def test_an_lr_schedule_that_fails_after_its_warm_up_is_refused_before_training(tmp_path):
    """The schedule is stepped through the run's optimizer steps before anything is built.
    Catches ``num_cycles: abc`` accepted (step 1 trained and checkpointed, step 2 a
    ``TypeError``, and a resume with the value corrected refused as another experiment), and a
    schedule checked at step 0 only (the warm-up never reads ``num_cycles``)."""
    bad = {"_component_": COSINE, "num_warmup_steps": 3, "num_cycles": "abc"}
    with pytest.raises(ValueError, match=r"^lr_scheduler: .*get_cosine_schedule_with_warmup "
                                         r"fails: TypeError: .* at optimizer step 3 of 8 "
                                         r"\(num_steps x ppo_epochs x ppo_mini_batches\); check "
                                         r"its arguments$"):
        validate_config(tiny_cfg(tmp_path, lr_scheduler=bad, num_steps=4, ppo_mini_batches=2))
    # within its warm-up for the whole run, the scheduler's step after the last optimizer step
    # included (step 2 of 2): never reads num_cycles; one step more does
    validate_config(tiny_cfg(tmp_path, lr_scheduler=bad, num_steps=1, ppo_mini_batches=2))
    with pytest.raises(ValueError, match="at optimizer step 3 of 3"):
        validate_config(tiny_cfg(tmp_path, lr_scheduler=bad, num_steps=3, ppo_mini_batches=1))
    with pytest.raises(ValueError, match="at optimizer step 3 of 4"):  # epochs step it too
        validate_config(tiny_cfg(tmp_path, lr_scheduler=bad, num_steps=2, ppo_epochs=2,
                                 ppo_mini_batches=1))
    good = {"_component_": COSINE, "num_warmup_steps": 3}
    validate_config(tiny_cfg(tmp_path, lr_scheduler=good, num_steps=4, ppo_mini_batches=2))


def falling_schedule(optimizer, num_training_steps):
    """A schedule whose learning rate falls by the initial one each step: negative at step 2."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step)


def test_an_lr_schedule_that_goes_negative_is_refused(tmp_path):
    """Catches a learning rate below 0 let through (AdamW then climbs the loss, in silence)."""
    sched = {"_component_": "tests.training.test_config_schema.falling_schedule"}
    with pytest.raises(ValueError, match=r"^lr_scheduler: .*falling_schedule gives the learning "
                                         r"rate -0.01 at optimizer step 2 of 2 "):
        validate_config(tiny_cfg(tmp_path, lr_scheduler=sched, num_steps=2, ppo_mini_batches=1))
    # 0 at its last step
    validate_config(tiny_cfg(tmp_path, lr_scheduler=sched, num_steps=1, ppo_mini_batches=1))


def test_a_tokenizer_path_without_its_config_is_refused(tmp_path):
    """Catches ``tokenizer.path`` checked for ``tokenizer.json`` alone: the run failed once the
    model was built."""
    import shutil

    from pepo.training.config import asset_dir

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(Path(asset_dir("tiny")) / "tokenizer.json", tok)
    with pytest.raises(ValueError, match=r"^tokenizer.path='.*tok' has no tokenizer_config.json$"):
        validate_config(tiny_cfg(tmp_path, tokenizer={"path": str(tok)}))


def test_a_key_the_recipe_passes_itself_is_refused(tmp_path):
    """Catches ``lr_scheduler.num_training_steps`` accepted and silently replaced by the
    recipe's count (a schedule meant to decay by step 5 decayed over the whole run)."""
    cfg = {"_component_": COSINE, "num_warmup_steps": 1, "num_training_steps": 5}
    with pytest.raises(ValueError, match=r"^lr_scheduler.num_training_steps=5 would be ignored: "
                                         r"the recipe passes num_training_steps \(num_steps x "
                                         r"ppo_epochs x ppo_mini_batches\); remove it$"):
        validate_config(tiny_cfg(tmp_path, lr_scheduler=cfg))


@pytest.mark.parametrize("override, message", [
    ({"loss": {"tis_cap": float("inf")}}, "loss.tis_cap must be a finite number > 0.0, got inf"),
    ({"seed": -1}, "seed must be an int in [0, 4294967295] (exact resume"),
    ({"seed": 2**32}, "seed must be an int in [0, 4294967295]"),
])
def test_values_that_failed_after_the_start_fail_in_the_schema(tmp_path, override, message):
    """Catches ``tis_cap: .inf`` passing the schema (a traceback at step 1, after the
    validation before training), a seed outside what torchtune's ``set_seed`` takes (its error
    named no key)."""
    with pytest.raises(ValueError) as e:
        validate_config(tiny_cfg(tmp_path, **override))
    assert str(e.value).startswith(message), str(e.value)


def test_a_misspelt_required_argument_is_named_not_the_one_it_leaves_missing():
    """Catches ``dataset.pth`` reported as "missing a required argument: 'path'"."""
    from pepo.training.config_rules import bind_component

    node = OmegaConf.create({"_component_": "pepo.tasks.datasets.load_math_dataset",
                             "pth": "x.jsonl"})
    with pytest.raises(ValueError, match=r"^dataset: pepo.tasks.datasets.load_math_dataset got "
                                         r"an unexpected keyword argument 'pth'; did you mean "
                                         r"'dataset.path'\?$"):
        bind_component("dataset", node)
    del node["pth"]
    with pytest.raises(ValueError, match="missing a required argument: 'path'"):
        bind_component("dataset", node)


def test_an_eval_seed_outside_the_seed_range_is_refused(tmp_path):
    """``pepo_eval`` accepted ``seed=-1`` where training refuses it."""
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.output_dir, cfg.seed = str(tmp_path / "out"), -1
    with pytest.raises(ValueError, match=re.escape("seed must be an int in [0, 4294967295]")):
        validate_eval_config(cfg)


def test_the_seed_ranges_ends_are_seeds(tmp_path):
    """``StrictInt``'s bounds are inclusive: catches the largest seed NumPy takes
    (2**32 - 1) refused, and the rule's ends checked directly."""
    from pepo.training.config_rules import StrictInt

    validate_config(tiny_cfg(tmp_path, seed=2**32 - 1))
    validate_config(tiny_cfg(tmp_path, seed=0))
    rule = StrictInt("", (0, 3))
    assert [rule.check("k", v) for v in (0, 3)] == [0, 3]
    for bad in (-1, 4, True):
        with pytest.raises(ValueError, match=r"^k must be an int in \[0, 3\], got "):
            rule.check("k", bad)


def test_a_component_whose_module_fails_on_a_missing_dependency_names_the_dependency(
        tmp_path, monkeypatch):
    """A user's reward module that exists but imports a package not installed
    was reported as "no module 'myrewards'" (or "mypkg has no 'rewards'"): the shorter prefix
    was tried as if the module itself were missing. Catches the missing dependency not named."""
    from pepo.training.config_rules import resolve_component

    (tmp_path / "myrewards_xyz.py").write_text("import no_such_dep_xyz\n", encoding="utf-8")
    pkg = tmp_path / "mypkg_xyz"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "rewards.py").write_text("import no_such_dep_xyz\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("myrewards_xyz.Reward", "mypkg_xyz.rewards.Reward"):
        with pytest.raises(ValueError, match=rf"^reward: cannot import '{re.escape(path)}': No "
                                             rf"module named 'no_such_dep_xyz'$"):
            resolve_component("reward", path)
    with pytest.raises(ValueError, match=r"no module 'nowhere_xyz'"):  # itself missing
        resolve_component("reward", "nowhere_xyz.Reward")


def test_a_top_level_variable_read_through_a_dot_or_an_index_is_not_a_typo(tmp_path):
    """A top-level key the config reads as ``${paths.out}`` or ``${roots[0]}`` is a variable,
    as ``${key}`` is. Catches the variables found by ``${key}`` alone: those configs were
    refused as unknown keys ``paths`` and ``roots``. A key nothing reads is still refused."""
    out = tmp_path / "out"
    cfg = tiny_cfg(tmp_path, paths={"out": str(out)}, roots=[str(tmp_path)],
                   output_dir="${paths.out}/run", metric_logger={"log_dir": "${roots[0]}/logs"})
    rc = validate_config(cfg)
    assert (rc.output_dir, rc.metric_logger.log_dir) == (f"{out}/run", f"{tmp_path}/logs")
    with pytest.raises(ValueError, match=r"^unknown config key 'unread'"):
        validate_config(tiny_cfg(tmp_path, unread=1))


def test_an_unknown_packaged_asset_is_one_line_naming_it():
    """``${pepo_asset:tinyy}`` is one config error naming the asset, not a path that does not
    exist handed to the tokenizer and the checkpoint loader (catches the check left out)."""
    from pepo.training.config import asset_dir, config_error_exit, register_resolvers

    assert (Path(asset_dir("tiny")) / "tokenizer.json").is_file()
    register_resolvers()
    cfg = OmegaConf.create({"checkpoint_dir": "${pepo_asset:tinyy}"})
    with pytest.raises(ValueError, match=r"no packaged asset 'tinyy' \(looked in .*assets\)") as e:
        OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(SystemExit) as done:
        config_error_exit(e.value)
    assert str(done.value.code).startswith("config error: no packaged asset 'tinyy' (looked in ")


def test_a_strategy_section_is_a_mapping_or_null(tmp_path):
    """``strategy.global_topk: null`` drops that strategy's parameters (the chosen one keeps
    its own); a section that is not a mapping, and no ``strategy`` at all, are one line each.
    Catches a null section refused as not a mapping, a number taken for one, and the missing
    section an ``AttributeError`` on None."""
    cfg = tiny_cfg(tmp_path)
    cfg.strategy.global_topk = None
    rc = validate_config(cfg)
    assert rc.strategy.name == "proximal_softmax" and rc.strategy.params["window"] == 11
    cfg.strategy.global_topk = {"fraction": 2.0}  # every section, not only the chosen one's
    with pytest.raises(ValueError, match=r"^strategy.global_topk: fraction"):
        validate_config(cfg)
    cfg.strategy.global_topk = None
    cfg.strategy.window_average = 5
    with pytest.raises(ValueError, match=r"^strategy.window_average must be a mapping of its "
                                         r"parameters, got 5$"):
        validate_config(cfg)
    cfg = tiny_cfg(tmp_path)
    cfg.strategy = None
    with pytest.raises(ValueError, match=r"^config key 'strategy.name' is required$"):
        validate_config(cfg)


def test_the_eval_config_reads_generation_as_training_does(caplog):
    """An eval config's ``generation.engine: torchtune`` (the in-process engine's old name)
    works as in training, with the notice; a typo under ``generation.vllm`` is refused as
    there. Catches the eval's schema without the renaming or the vLLM keys' check."""
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.generation.engine = "torchtune"
    assert validate_eval_config(cfg).generation.engine == "inprocess"
    assert "generation.engine=torchtune is now called inprocess" in caplog.text
    cfg.generation.vllm = {"gpu_memory_utilisation": 0.5}
    with pytest.raises(ValueError, match=r"^unknown config key 'generation.vllm."
                                         r"gpu_memory_utilisation'; did you mean "
                                         r"'generation.vllm.gpu_memory_utilization'\?$"):
        validate_eval_config(cfg)


def test_a_checkpoint_dir_is_a_directory_of_whole_or_sharded_weights(tmp_path):
    """Catches a file taken for the checkpoint directory (a traceback from the loader) and a
    sharded checkpoint (``model.safetensors.index.json``, as 1.7-4B checkpoints ship) refused."""
    from pepo.training.config import check_checkpoint_dir

    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"^checkpoint_dir=.*weights.safetensors' is a file, not "
                                         r"a checkpoint directory$"):
        check_checkpoint_dir(tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match=r"has no model.safetensors \(nor "
                                         r"model.safetensors.index.json\)$"):
        check_checkpoint_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}", encoding="utf-8")
    check_checkpoint_dir(tmp_path)


def duplicate_ids():
    """A dataset component whose two problems share an id."""
    from pepo.tasks.problems import Problem

    return [Problem("p0", "1 + 1 = ?", "2"), Problem("p0", "2 + 2 = ?", "4")]


@pytest.mark.parametrize("estimator", ["group", "single_stream"])
def test_repeated_ids_are_refused_only_where_the_run_keys_state_by_them(estimator):
    """Ids key SPO's tracker and its prior cache, which read the training set alone: a repeated
    id in a single-stream run's ``dataset`` is refused; in its ``val_dataset``, or in a group
    run, it is warned of. Catches the validation set held to the training set's rule."""
    from pepo.training.config import build

    section = {"_component_": "tests.training.test_config_schema.duplicate_ids"}
    cfg = OmegaConf.create({"dataset": section, "val_dataset": section,
                            "estimator": {"name": estimator}})
    with pytest.warns(UserWarning, match="items 0 and 1 have the same id 'p0'"):
        assert len(build(cfg, "val_dataset")) == 2
    if estimator == "group":
        with pytest.warns(UserWarning, match="items 0 and 1 have the same id 'p0'"):
            build(cfg, "dataset")
    else:
        with pytest.raises(ValueError, match=r"^dataset: items 0 and 1 have the same id 'p0'"):
            build(cfg, "dataset")


def test_the_checkpoint_a_resume_takes(tmp_path):
    """``resumable_checkpoint`` on a checkpointer's newest checkpoint: none is one line; one that
    records no experiment is taken with a warning (the resume cannot check it); one at
    ``num_steps`` is refused once the run closed and taken when it did not (it stopped after
    that step's checkpoint, before its summary); one beyond ``num_steps`` is refused. Catches
    the warning left out, and ``closed`` ignored either way."""
    from pepo.training.config import resumable_checkpoint

    class Holding:
        root = tmp_path

        def __init__(self, found):
            self.found = found

        def load_latest(self):
            return self.found

    with pytest.raises(ValueError, match=r"^resume_from_checkpoint=True but .* holds no intact "
                                         r"checkpoint"):
        resumable_checkpoint(Holding(None), {}, 5, print)
    warned: list = []
    at_3 = (tmp_path / "step_3", {"step": 3})
    assert resumable_checkpoint(Holding(at_3), {"seed": 0}, 5, warned.append) == at_3
    assert warned == [f"{tmp_path / 'step_3'} records no experiment config; the resume cannot "
                      f"check it"]
    assert resumable_checkpoint(Holding(at_3), {}, 3, print, closed=False) == at_3
    for num_steps, closed in ((3, True), (2, False)):
        with pytest.raises(ValueError, match=rf"step_3 is at step 3, and num_steps={num_steps} "
                                             rf"asks for no more"):
            resumable_checkpoint(Holding(at_3), {}, num_steps, print, closed=closed)


def test_the_eval_config_checks_the_machine_as_training_does(tmp_path, monkeypatch):
    """pepo_eval's config: a checkpoint that does not exist and a CUDA device on a machine
    without one are one line each before any model is built (catches either check left out
    of the evaluation's validation)."""
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.checkpoint_dir = str(tmp_path / "no_such_run")
    with pytest.raises(ValueError, match=r"^checkpoint_dir=.*no_such_run' does not exist"):
        validate_eval_config(cfg)
    cfg = OmegaConf.load(find_config("eval_tiny"))
    cfg.device = "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device='cuda' but CUDA is not available here"):
        validate_eval_config(cfg)


def test_the_vllm_engine_without_vllm_is_one_line_before_anything_is_built(tmp_path,
                                                                            monkeypatch):
    """Catches the machine phase without the engine's check: vLLM's ImportError once the
    model was built (the message names the install line)."""
    from pepo.training import engines

    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    for validate, cfg in ((validate_config, tiny_cfg(tmp_path)),
                          (validate_eval_config, OmegaConf.load(find_config("eval_tiny")))):
        cfg.generation.engine = "vllm"
        with pytest.raises(ValueError, match=r"^generation.engine=vllm needs vLLM, which is not "
                                             r"installed: "):
            validate(cfg)


def test_a_number_given_as_an_int_is_read_as_a_float(tmp_path):
    """``temperature: 1`` and ``top_p: 1`` (YAML ints) are floats in the typed config, as its
    annotations say (catches the int passed on: JSON records it as 1, not 1.0, and a caller
    typed for a float gets an int)."""
    rc = validate_config(tiny_cfg(tmp_path, generation={"temperature": 1, "top_p": 1}))
    assert type(rc.generation.temperature) is float and type(rc.generation.top_p) is float
    assert (rc.generation.temperature, rc.generation.top_p) == (1.0, 1.0)


def test_a_component_whose_module_fails_to_import_is_one_line_naming_the_error(tmp_path,
                                                                                monkeypatch):
    """A module that exists but raises at import (not an ``ImportError``) is one line with the
    error's type and message. Catches only ``ImportError`` caught: the module's own traceback."""
    from pepo.training.config_rules import resolve_component

    (tmp_path / "pepo_test_broken_module.py").write_text("raise RuntimeError('no GPU here')\n",
                                                         encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^reward: cannot import "
                                         r"'pepo_test_broken_module.Reward': RuntimeError: no "
                                         r"GPU here$"):
        resolve_component("reward", "pepo_test_broken_module.Reward")
