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
evaluation in ``output_dir``, one row each (the base model beside the trained one), with a note
where rows were sampled or scored with different settings.

The results file is written after every benchmark and records, besides avg@k, everything that
decides it: the resolved settings (seed, precision, tokenizer, reward, sampling), each
benchmark's dataset, ``k``, problem count and share of truncated responses, and pepo's version.
An evaluation that stopped (Ctrl-C, a crash) keeps the benchmarks it finished; the same command
again evaluates only the rest. A label's results are never replaced by another checkpoint's or
by other settings': that is refused, naming what differs.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pepo
from pepo import _extras

_extras.require("pepo_eval")  # before torchtune: a missing extra gets the line that names it

from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from pepo.training.checkpointing import resolve_marker
from pepo.training.config import (
    check_output_dir,
    config_error_exit,
    experiment_changes,
    flatten_config,
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


# keys that change no benchmark's number (a rollout samples alike in any batch), or that are
# compared apart (the checkpoint, each benchmark)
_NOT_SETTINGS = ("output_dir", "model_name", "batch_size", "checkpoint_dir", "data_dir",
                 "benchmarks")


def _settings(cfg: DictConfig) -> dict[str, Any]:
    """What decides every benchmark's avg@k besides the weights: the resolved config (flattened
    ``a.b``) but for :data:`_NOT_SETTINGS` and the paths that are the checkpoint's, as JSON
    gives them back."""
    ckpt = str(cfg.checkpoint_dir)
    return json.loads(json.dumps({k: v for k, v in flatten_config(cfg, _NOT_SETTINGS).items()
                                  if v != ckpt}))


def _benchmark_settings(cfg: DictConfig, name: str) -> dict[str, Any]:
    """Benchmark ``name``'s own keys (its ``k`` and dataset), resolved and flattened."""
    return json.loads(json.dumps(flatten_config(cfg.benchmarks[name])))


def _check_results_dir(cfg: DictConfig, label: str) -> tuple[RunLock, dict[str, Any]]:
    """``output_dir`` must be writable, not in use by another evaluation or run (it is locked
    until the evaluation ends: the returned lock), and its folder for ``label`` must not hold
    another checkpoint's results, or results under other settings (they would be silently
    replaced). Also returns the benchmarks that folder already holds under this config's
    settings (:func:`_previous_results`)."""
    check_output_dir(cfg.get("output_dir"))
    lock = RunLock(str(cfg.output_dir))
    try:
        return lock, _previous_results(cfg, label)
    except BaseException:
        lock.release()
        raise


def _previous_results(cfg: DictConfig, label: str) -> dict[str, Any]:
    """The benchmark entries of ``label``'s results file that this config would evaluate
    again alike (same checkpoint, settings and benchmark keys), to be kept, not re-sampled.

    Raises:
        ValueError: the file holds another checkpoint's results or other settings'.
    """
    previous = _results_dir(cfg, label) / "eval_results.json"
    if not previous.is_file():
        return {}
    try:
        saved = json.loads(previous.read_text(encoding="utf-8"))
        saved = saved if isinstance(saved, dict) else {}
    except json.JSONDecodeError:
        saved = {}
    here = str(Path(str(cfg.checkpoint_dir)).resolve())
    if saved.get("checkpoint_dir") != here:
        raise ValueError(
            f"{previous} holds the results of another evaluation labelled {label!r} "
            f"(checkpoint_dir={saved.get('checkpoint_dir')!r}); give this one another "
            f"model_name=, choose another output_dir, or remove {previous}")
    changes = (experiment_changes(saved["settings"], _settings(cfg))
               if isinstance(saved.get("settings"), dict) else ["its settings (not recorded)"])
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise ValueError(
            f"{previous} holds the results labelled {label!r} under other settings: "
            f"{'; '.join(changes[:3])}{more}; give this evaluation another model_name=, choose "
            f"another output_dir, or remove {previous}")
    done = saved.get("benchmarks") if isinstance(saved.get("benchmarks"), dict) else {}
    return {n: e for n, e in done.items() if n in cfg.benchmarks and isinstance(e, dict)
            and e.get("settings") == _benchmark_settings(cfg, n)}


def _check_prompts_fit(data: dict[str, list], tokenizer: Any, limit: int,
                       max_new_tokens: int) -> None:
    """Every benchmark has problems, and each prompt fits ``limit`` with ``max_new_tokens``
    (dropping one would change the benchmark; the training recipe's validation drops them)."""
    for name, problems in data.items():
        if not problems:
            raise ValueError(f"benchmarks.{name}: its dataset has no problems")
        lengths = [len(tokenizer.encode_prompt(p.prompt)) for p in problems]
        long = [n for n in lengths if n + max_new_tokens > limit]
        if long:
            raise ValueError(
                f"benchmarks.{name}: {len(long)} of {len(problems)} prompts (the longest "
                f"{max(long)} tokens) do not fit {limit} tokens with generation.max_new_tokens="
                f"{max_new_tokens}; raise model.max_seq_len (or generation.vllm.max_model_len) "
                f"or lower generation.max_new_tokens")


def _setup(cfg: DictConfig) -> dict[str, Any]:
    """Everything an evaluation needs, cheapest checks first: config, output directory, data,
    tokenizer, reward, then the model. Raises ``ValueError`` for what the user must fix."""
    given = cfg.get("checkpoint_dir")
    cfg.checkpoint_dir = resolve_marker(given)  # RUN/checkpoints/best works
    c = validate_eval_config(cfg)  # typed, with every default filled in
    label = c.model_name or evaluation_label(given, c.checkpoint_dir)
    lock, previous = _check_results_dir(cfg, label)
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
        _check_prompts_fit(data, tokenizer, sequence_limit(model, name, options),
                           c.generation.max_new_tokens)  # before vLLM starts
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
                reward=reward, engine=engine, lock=lock, label=label, config=c,
                previous=previous)


def _close(*owners: Any) -> None:
    for owner in owners:
        close = getattr(owner, "close", None)
        if callable(close):
            close()


def _save(cfg: DictConfig, setup: dict[str, Any], done: dict[str, Any]) -> Path:
    """Writes the results of the benchmarks in ``done`` (name -> entry), with what decided
    them; ``complete`` once every benchmark of the config is there."""
    label = setup["label"]
    names = [n for n in cfg.benchmarks if n in done]
    js, _ = write_results(
        {n: done[n]["avg"] for n in names}, _results_dir(cfg, label), label,
        meta={"checkpoint_dir": str(Path(str(cfg.checkpoint_dir)).resolve()),
              "complete": len(names) == len(cfg.benchmarks),
              "k": {n: done[n]["k"] for n in names},
              "generation": OmegaConf.to_container(cfg.generation, resolve=True),
              "settings": _settings(cfg), "benchmarks": {n: done[n] for n in names},
              "pepo_version": pepo.__version__,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return js


def _evaluate(cfg: DictConfig, setup: dict[str, Any]) -> dict[str, float]:
    c = setup["config"]
    g = c.generation
    done = dict(setup["previous"])
    js = _results_dir(cfg, setup["label"]) / "eval_results.json"
    try:
        for name, b in cfg.benchmarks.items():
            problems = setup["data"][name]
            if name in done:
                log.info(f"{name}: avg@{b.k} = {100 * done[name]['avg']:.2f}, kept from {js} "
                         f"(the same checkpoint, settings and benchmark)")
                continue
            t0 = time.perf_counter()
            counts: dict[str, int] = {}
            avg = avg_at_k(
                setup["engine"], setup["tokenizer"], problems, b.k, setup["reward"],
                max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                top_k=g.top_k, top_p=g.top_p,
                generator=eval_generator(c.seed, setup["device"]),
                batch_size=c.batch_size, stop_tokens=setup["stop_tokens"],
                progress=f"{name} (avg@{b.k}, {len(problems)} problems)", counts=counts,
            )
            seconds = time.perf_counter() - t0
            cut = counts.get("truncated")
            share = None if cut is None else cut / max(1, counts["rollouts"])
            done[name] = {"avg": avg, "k": b.k, "problems": len(problems),
                          "truncated": share, "seconds": round(seconds, 1),
                          "settings": _benchmark_settings(cfg, name)}
            log.info(f"{name}: avg@{b.k} = {100 * avg:.2f} over {len(problems)} problems "
                     f"({seconds:.1f}s" + ("" if share is None else
                                            f"; {100 * share:.1f}% of responses truncated, "
                                            f"scored on their text") + ")")
            js = _save(cfg, setup, done)  # a stop later keeps this benchmark
        js = _save(cfg, setup, done)
        table, everything = _write_summary(Path(str(cfg.output_dir)))
    finally:
        _close(setup["reward"], setup["engine"], setup["lock"])
    print("\n" + table + "\n")
    log.info(f"Results: {js}; every evaluation in {cfg.output_dir}: {everything}")
    return {n: done[n]["avg"] for n in cfg.benchmarks}


def _write_summary(out: Path) -> tuple[str, Path]:
    """``out/eval_results.md``: one row per evaluation whose results lie in a folder of ``out``,
    oldest first (an unfinished one marked so), and a note naming the settings that differ
    between rows. Returns the table and its path."""
    rows, settings = [], []
    for js in sorted(out.glob("*/eval_results.json"), key=lambda f: (f.stat().st_mtime, f)):
        try:
            saved = json.loads(js.read_text(encoding="utf-8"))
            label = str(saved["model"]) + (" (unfinished)" if saved.get("complete") is False
                                           else "")
            rows.append((label, {str(k): float(v) for k, v in saved["results"].items()}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning(f"{js} is not an evaluation's results; left out of the table")
            continue
        mine = dict(saved.get("settings") or {"settings": "not recorded"})
        for name, k in (saved.get("k") or {}).items():
            mine[f"benchmarks.{name}.k"] = k
        settings.append((label, mine))
    table = format_tables(rows)

    def values(key: str) -> list[tuple[str, Any]]:  # a benchmark's k where a row has it
        return [(n, s[key] if key in s else "<unset>") for n, s in settings
                if key in s or not key.startswith("benchmarks.")]

    differ = [k for k in sorted({k for _, s in settings for k in s})
              if len({json.dumps(v) for _, v in values(k)}) > 1]
    if differ:
        shown = "; ".join(f"{k} (" + ", ".join(f"{n}: {v}" for n, v in values(k)) + ")"
                          for k in differ[:4])
        more = f"; and {len(differ) - 4} more" if len(differ) > 4 else ""
        table += f"\n\nThe rows were evaluated with different settings: {shown}{more}."
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
    except KeyboardInterrupt:
        print(f"interrupted: the benchmarks finished so far are kept in "
              f"{_results_dir(cfg, setup['label'])}; the same command evaluates the rest",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.argv = resolve_config_arg(sys.argv)
    sys.exit(_main())
