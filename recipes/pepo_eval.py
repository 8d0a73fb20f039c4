"""avg@k of a checkpoint on math benchmarks, printed in the paper's table layout.

    tune run pepo_eval --config eval_tiny [key=value ...]
    tune run pepo_eval --config eval_math checkpoint_dir=/models/Qwen3-4B \
        benchmarks.AIME2024.dataset.path=/data/aime24.parquet ...

Each entry of ``benchmarks`` names a dataset component and its ``k``; the model samples ``k``
responses per problem with ``generation``'s settings and a fixed seed, ``reward`` scores them,
and avg@k is the mean share of correct responses (``pepo.training.evaluation.avg_at_k``, the
function the training recipe validates with).

Each evaluated checkpoint has a label (``model_name``, default :func:`evaluation_label`: ``tiny
(base)`` for a packaged or converted base model, else the ``checkpoint_dir`` as given, with the
step a ``best``/``latest`` marker named) and its results go to
``output_dir/<label>/eval_results.{json,md}``; ``output_dir/eval_results.md`` is the table of every
evaluation in ``output_dir``, one row each (the base model beside the trained one).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from pepo import _extras

_extras.require("pepo_eval")  # before torchtune: a missing extra gets the line that names it

from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from pepo.training.checkpointing import resolve_marker
from pepo.training.config import (
    check_output_dir,
    config_error_exit,
    register_resolvers,
    resolve_config_arg,
    validate_eval_config,
)
from pepo.training.engines import build_engine, sequence_limit
from pepo.training.evaluation import (
    RewardError,
    avg_at_k,
    eval_generator,
    format_tables,
    write_results,
)
from pepo.training.precision import cpu_attention_in_fp32, cpu_warnings, resolve_compute_dtype
from pepo.training.precision import describe as describe_precision
from pepo.training.run_lock import RunLock
from pepo.training.tokenizers import stop_token_ids
from pepo.training.weights import load_model_weights

log = utils.get_logger("INFO")
register_resolvers()


def evaluation_label(given: Any, resolved: Any) -> str:
    """What the results table calls an evaluated checkpoint when ``model_name`` is null:
    ``NAME (base)`` for a model pepo ships or converts (``${pepo_asset:NAME}``,
    ``${pepo_pretrained:NAME}``), else ``checkpoint_dir`` as the user gave it, followed by the
    step directory when that was a ``checkpoints/best`` or ``latest`` marker."""
    src = Path(str(resolved)).resolve()
    from pepo.training.pretrained import cache_root

    for root in (Path(str(importlib.resources.files("pepo") / "assets")), cache_root()):
        try:
            src.relative_to(root.resolve())
        except ValueError:
            continue
        return f"{src.name} (base)"
    if str(given) != str(resolved):
        return f"{given} ({Path(str(resolved)).name})"
    return str(given)


def _results_dir(cfg: DictConfig, label: str) -> Path:
    """``output_dir/<label>``, the label made a safe folder name (its last 100 characters)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", label)[-100:].strip("_.") or "model"
    return Path(str(cfg.output_dir)) / name


def _check_results_dir(cfg: DictConfig, label: str) -> RunLock:
    """``output_dir`` must be writable, not in use by another evaluation or run (it is locked
    until the evaluation ends: the returned lock), and its folder for ``label`` must not hold
    another checkpoint's results (they would be silently replaced)."""
    check_output_dir(cfg.get("output_dir"))
    lock = RunLock(str(cfg.output_dir))
    try:
        _check_previous_results(cfg, label)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_previous_results(cfg: DictConfig, label: str) -> None:
    previous = _results_dir(cfg, label) / "eval_results.json"
    if previous.is_file():
        try:
            saved = json.loads(previous.read_text(encoding="utf-8")).get("checkpoint_dir")
        except (json.JSONDecodeError, AttributeError):
            saved = None
        here = str(Path(str(cfg.checkpoint_dir)).resolve())
        if saved != here:
            raise ValueError(
                f"{previous} holds the results of another evaluation labelled {label!r} "
                f"(checkpoint_dir={saved!r}); give this one another model_name=, choose another "
                f"output_dir, or remove {previous}"
            )


def _setup(cfg: DictConfig) -> dict[str, Any]:
    """Everything an evaluation needs, cheapest checks first: config, output directory, data,
    tokenizer, reward, then the model. Raises ``ValueError`` for what the user must fix."""
    given = cfg.get("checkpoint_dir")
    cfg.checkpoint_dir = resolve_marker(given)  # RUN/checkpoints/best works
    c = validate_eval_config(cfg)  # typed, with every default filled in
    label = c.model_name or evaluation_label(given, c.checkpoint_dir)
    lock = _check_results_dir(cfg, label)
    reward = None
    try:
        device = utils.get_device(c.device)
        dtype = training.get_dtype(c.dtype, device=device)
        tokenizer = config.instantiate(cfg.tokenizer)
        stop_tokens = stop_token_ids(tokenizer, c.generation.stop_tokens)
        data = {name: list(config.instantiate(b.dataset)) for name, b in cfg.benchmarks.items()}
        reward = config.instantiate(cfg.reward)
        with training.set_default_dtype(dtype), device:
            model = config.instantiate(cfg.model)
        load_model_weights(model, c.checkpoint_dir)
        model.eval()
        if device.type == "cpu":  # as in training (docs/recipe.md, compute_dtype)
            cpu_attention_in_fp32(model)
        name, options = c.generation.engine, c.generation.engine_options
        sequence_limit(model, name, options)  # a bad max_model_len before vLLM starts
        src = Path(str(c.checkpoint_dir))
        compute_dtype = resolve_compute_dtype(c.compute_dtype, device)  # autocast
        log.info(describe_precision(c.compute_dtype, compute_dtype, device))
        for line in cpu_warnings(compute_dtype, None, device):
            log.warning(line)
        engine = build_engine(name, model, compute_dtype=compute_dtype, **(
            {**options, "hf_dir": src if (src / "config.json").is_file() else None,
             "seed": c.seed} if name == "vllm" else {}))
    except BaseException:
        _close(reward, lock)
        raise
    return dict(device=device, tokenizer=tokenizer, stop_tokens=stop_tokens, data=data,
                reward=reward, engine=engine, lock=lock, label=label, config=c)


def _close(*owners: Any) -> None:
    for owner in owners:
        close = getattr(owner, "close", None)
        if callable(close):
            close()


def _evaluate(cfg: DictConfig, setup: dict[str, Any]) -> dict[str, float]:
    c = setup["config"]
    g = c.generation
    results: dict[str, float] = {}
    try:
        for name, b in cfg.benchmarks.items():
            problems = setup["data"][name]
            t0 = time.perf_counter()
            results[name] = avg_at_k(
                setup["engine"], setup["tokenizer"], problems, b.k, setup["reward"],
                max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                top_k=g.top_k, top_p=g.top_p,
                generator=eval_generator(c.seed, setup["device"]),
                batch_size=c.batch_size, stop_tokens=setup["stop_tokens"],
                progress=f"{name} (avg@{b.k}, {len(problems)} problems)",
            )
            log.info(f"{name}: avg@{b.k} = {100 * results[name]:.2f} over {len(problems)} "
                     f"problems ({time.perf_counter() - t0:.1f}s)")
        label = setup["label"]
        js, _ = write_results(
            results, _results_dir(cfg, label), label,
            meta={"checkpoint_dir": str(Path(str(cfg.checkpoint_dir)).resolve()),
                  "k": {n: b.k for n, b in cfg.benchmarks.items()},
                  "generation": OmegaConf.to_container(cfg.generation, resolve=True)})
        table, everything = _write_summary(Path(str(cfg.output_dir)))
    finally:
        _close(setup["reward"], setup["engine"], setup["lock"])
    print("\n" + table + "\n")
    log.info(f"Results: {js}; every evaluation in {cfg.output_dir}: {everything}")
    return results


def _write_summary(out: Path) -> tuple[str, Path]:
    """``out/eval_results.md``: one row per evaluation whose results lie in a folder of ``out``,
    oldest first. Returns the table and its path."""
    rows = []
    for js in sorted(out.glob("*/eval_results.json"), key=lambda f: (f.stat().st_mtime, f)):
        try:
            saved = json.loads(js.read_text(encoding="utf-8"))
            rows.append((str(saved["model"]), {str(k): float(v)
                                               for k, v in saved["results"].items()}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning(f"{js} is not an evaluation's results; left out of the table")
    table = format_tables(rows)
    md = out / "eval_results.md"
    md.write_text(table + "\n", encoding="utf-8")
    return table, md


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
