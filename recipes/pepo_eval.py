"""avg@k of a checkpoint on math benchmarks, printed in the paper's table layout.

    tune run pepo_eval --config eval_tiny [key=value ...]
    tune run pepo_eval --config eval_math checkpoint_dir=/models/Qwen3-4B \
        benchmarks.AIME2024.path=/data/aime24.parquet ...

Each entry of ``benchmarks`` names a dataset component and its ``k``; the model samples ``k``
responses per problem with ``generation``'s settings and a fixed seed, ``reward`` scores them,
and avg@k is the mean share of correct responses (``pepo.training.evaluation.avg_at_k``, the function
the training recipe validates with). Results go to ``output_dir/eval_results.{json,md}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from pepo import _extras

_extras.require("pepo_eval")  # before torchtune: a missing extra gets the line that names it

from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from pepo.training.evaluation import (RewardError, avg_at_k, eval_generator, format_table,
                                      write_results)
from pepo.training.checkpointing import resolve_marker
from pepo.training.engines import build_engine, sequence_limit
from pepo.training.config import (
    check_checkpoint_dir,
    config_error_exit,
    check_device,
    check_engine,
    check_keys,
    check_output_dir,
    register_resolvers,
    engine_options,
    resolve_config_arg,
)
from pepo.training.run_lock import RunLock
from pepo.training.tokenizers import stop_token_ids
from pepo.training.weights import load_model_weights

log = utils.get_logger("INFO")
register_resolvers()


EVAL_SCHEMA = {
    "output_dir": "value", "model_name": "value", "seed": "value", "device": "value",
    "dtype": "value", "batch_size": "value", "tokenizer": None, "model": None,
    "checkpoint_dir": "value", "reward": None,
    "generation": {"max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens", "engine",
                   "vllm"},
    "benchmarks": None,  # name -> {k, dataset}, checked below
}


def validate_eval_config(cfg: DictConfig) -> None:
    """Checks an eval config before any model is built (``ValueError`` naming the key)."""
    check_keys(cfg, EVAL_SCHEMA)
    if not cfg.get("benchmarks"):
        raise ValueError("config key 'benchmarks' is required (name -> {dataset, k})")
    for name, b in cfg.benchmarks.items():
        for key in b:
            if key not in ("k", "dataset"):
                raise ValueError(f"unknown config key 'benchmarks.{name}.{key}'; valid keys: ['dataset', 'k']")
        k = b.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"benchmarks.{name}.k must be an int >= 1, got {k!r}")
        if b.get("dataset") is None:
            raise ValueError(f"benchmarks.{name}.dataset is required")
        path = b.dataset.get("path")
        if path is not None and not Path(path).exists():
            raise ValueError(f"benchmarks.{name}.dataset.path={path!r} does not exist")
    check_checkpoint_dir(cfg.get("checkpoint_dir"))
    check_device(cfg.get("device", "cpu"))
    check_engine(cfg.generation)


def _check_results_dir(cfg: DictConfig) -> RunLock:
    """``output_dir`` must be writable, not in use by another evaluation or run (it is locked
    until the evaluation ends: the returned lock), and must not hold another checkpoint's
    results (two evaluations into one directory would silently replace one with the other)."""
    check_output_dir(cfg.get("output_dir"))
    lock = RunLock(str(cfg.output_dir))
    try:
        _check_previous_results(cfg)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_previous_results(cfg: DictConfig) -> None:
    previous = Path(str(cfg.output_dir)) / "eval_results.json"
    if previous.is_file():
        try:
            saved = json.loads(previous.read_text(encoding="utf-8")).get("checkpoint_dir")
        except (json.JSONDecodeError, AttributeError):
            saved = None
        here = str(Path(str(cfg.checkpoint_dir)).resolve())
        if saved != here:
            raise ValueError(
                f"output_dir={str(cfg.output_dir)!r} holds the results of another evaluation "
                f"(checkpoint_dir={saved!r}); choose another output_dir, or remove {previous}"
            )


def _setup(cfg: DictConfig) -> dict[str, Any]:
    """Everything an evaluation needs, cheapest checks first: config, output directory, data,
    tokenizer, reward, then the model. Raises ``ValueError`` for what the user must fix."""
    cfg.checkpoint_dir = resolve_marker(cfg.get("checkpoint_dir"))  # RUN/checkpoints/best works
    validate_eval_config(cfg)
    lock = _check_results_dir(cfg)
    reward = None
    try:
        device = utils.get_device(cfg.get("device", "cpu"))
        dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=device)
        tokenizer = config.instantiate(cfg.tokenizer)
        stop_tokens = stop_token_ids(tokenizer, cfg.generation.get("stop_tokens"))
        data = {name: list(config.instantiate(b.dataset)) for name, b in cfg.benchmarks.items()}
        reward = config.instantiate(cfg.reward)
        with training.set_default_dtype(dtype), device:
            model = config.instantiate(cfg.model)
        load_model_weights(model, cfg.checkpoint_dir)
        model.eval()
        name, options = engine_options(cfg.generation)
        sequence_limit(model, name, options)  # a bad max_model_len before vLLM starts
        src = Path(str(cfg.checkpoint_dir))
        engine = build_engine(name, model, compile=cfg.generation.get("compile", False), **(
            {**options, "hf_dir": src if (src / "config.json").is_file() else None,
             "seed": cfg.seed} if name == "vllm" else {}))
    except BaseException:
        _close(reward, lock)
        raise
    return dict(device=device, tokenizer=tokenizer, stop_tokens=stop_tokens, data=data,
                reward=reward, engine=engine, lock=lock)


def _close(*owners: Any) -> None:
    for owner in owners:
        close = getattr(owner, "close", None)
        if callable(close):
            close()


def _evaluate(cfg: DictConfig, setup: dict[str, Any]) -> dict[str, float]:
    g = cfg.generation
    results: dict[str, float] = {}
    try:
        for name, b in cfg.benchmarks.items():
            problems = setup["data"][name]
            t0 = time.perf_counter()
            results[name] = avg_at_k(
                setup["engine"], setup["tokenizer"], problems, b.k, setup["reward"],
                max_new_tokens=g.max_new_tokens, temperature=float(g.temperature),
                top_k=g.get("top_k"), top_p=float(g.top_p),
                generator=eval_generator(cfg.seed, setup["device"]),
                batch_size=cfg.get("batch_size", 256), stop_tokens=setup["stop_tokens"],
                progress=f"{name} (avg@{b.k}, {len(problems)} problems)",
            )
            log.info(f"{name}: avg@{b.k} = {100 * results[name]:.2f} over {len(problems)} "
                     f"problems ({time.perf_counter() - t0:.1f}s)")
        name = cfg.get("model_name") or Path(str(cfg.checkpoint_dir)).name
        table = format_table(results, name)
        js, md = write_results(
            results, cfg.output_dir, name,
            meta={"checkpoint_dir": str(Path(str(cfg.checkpoint_dir)).resolve()),
                  "k": {n: b.k for n, b in cfg.benchmarks.items()},
                  "generation": OmegaConf.to_container(g, resolve=True)})
    finally:
        _close(setup["reward"], setup["engine"], setup["lock"])
    print("\n" + table + "\n")
    log.info(f"Results: {js} and {md}")
    return results


def eval_main(cfg: DictConfig) -> dict[str, float]:
    """Runs the evaluation; returns ``{benchmark: avg@k}``."""
    return _evaluate(cfg, _setup(cfg))


@config.parse
def _main(cfg: DictConfig) -> None:
    try:  # a bad config, file or field is the user's to fix: one line, no traceback
        setup = _setup(cfg)
    except ValueError as e:
        config_error_exit(e)
    try:
        _evaluate(cfg, setup)
    except RewardError as e:  # the user's reward code: one line
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    sys.argv = resolve_config_arg(sys.argv)
    sys.exit(_main())
