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
decides it: the resolved settings (seed, precision, tokenizer, reward, sampling), the weight
files (name, size, time), each benchmark's dataset, ``k``, a digest of its encoded prompts and
answers, its problem count and share of truncated responses, avg@k's standard error over the
problems, and pepo's version; ``<label>/responses/<benchmark>.jsonl`` holds every response with
its problem, answer, reward, success and truncation, to score again or read. An evaluation
that stopped (Ctrl-C, a crash) keeps the benchmarks it finished, and the same command again
evaluates only the rest: a saved benchmark is kept while the weight files, the settings, its
``k`` and its prompts are unchanged, and sampled again (said in one line) when its ``k`` or
prompts changed or the weights were rewritten. A label's results are never replaced by another
checkpoint path's or by other settings': that is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pepo
from pepo import _extras

_extras.require("pepo_eval")  # before torchtune: a missing extra gets the line that names it

from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from pepo.training import schema
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
    problem_se,
    write_results,
)
from pepo.training.hf import prompt_differences
from pepo.training.precision import cpu_attention_in_fp32, cpu_warnings, resolve_compute_dtype
from pepo.training.precision import describe as describe_precision
from pepo.training.reporting import write_rollouts
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


# keys that change no benchmark's number (a rollout samples alike in any batch, and a verifier
# scores alike with any number of workers), or that are compared apart: the checkpoint (by its
# weight files), the tokenizer (by the prompts it encodes) and each benchmark (by its k and data)
_NOT_SETTINGS = ("output_dir", "model_name", "batch_size", "checkpoint_dir", "data_dir",
                 "benchmarks", "reward.workers", "tokenizer.path", "model.model_dir")


def _settings(cfg: DictConfig, typed: Any) -> dict[str, Any]:
    """What decides every benchmark's avg@k besides the weights, the prompts and the benchmark:
    the resolved config (flattened ``a.b``, each default filled in from ``typed``, the
    validated config) but for :data:`_NOT_SETTINGS`, with the device's type (``cuda:1`` samples
    as ``cuda``) and the precision ``compute_dtype: auto`` chose here, as JSON gives it back."""
    flat = flatten_config(cfg, _NOT_SETTINGS)
    for key, _ in schema.fields_of(schema.EvalConfig):
        if not any(k == key or k.startswith(key + ".") for k in flat) and \
                key.split(".")[0] not in _NOT_SETTINGS:
            value = typed
            for part in key.split("."):
                value = getattr(value, part)
            flat[key] = value
    flat["device"] = str(flat["device"]).split(":")[0]
    if flat.get("compute_dtype") == "auto":
        resolved = resolve_compute_dtype("auto", utils.get_device(str(cfg.device)))
        flat["compute_dtype_resolved"] = "bf16" if resolved is not None else "fp32"
    return json.loads(json.dumps(flat))


def _weights(checkpoint_dir: Any) -> list:
    """The checkpoint's weight files as ``[name, size, mtime_ns]``: a checkpoint rewritten at
    the same path (a resumed run's ``hf_model``) is another checkpoint."""
    files = sorted(f for f in Path(str(checkpoint_dir)).iterdir() if f.is_file()
                   and f.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _check_results_dir(cfg: DictConfig, label: str, typed: Any) -> tuple[RunLock, Any]:
    """``output_dir`` must be writable, not in use by another evaluation or run (it is locked
    until the evaluation ends: the returned lock), and its folder for ``label`` must not hold
    another checkpoint's results, or results under other settings (they would be silently
    replaced). Also returns what that folder holds (:func:`_previous_results`)."""
    check_output_dir(cfg.get("output_dir"))
    lock = RunLock(str(cfg.output_dir))
    try:
        return lock, _previous_results(cfg, label, typed)
    except BaseException:
        lock.release()
        raise


def _previous_results(cfg: DictConfig, label: str, typed: Any) -> Optional[dict[str, Any]]:
    """``label``'s saved results when they are this checkpoint path's under these settings
    (:func:`_reusable` then picks the benchmarks to keep); None when there are none, or when
    an earlier pepo wrote them without their settings (evaluated again and replaced).

    Raises:
        ValueError: the file is unreadable, or holds another checkpoint's results or other
            settings'.
    """
    previous = _results_dir(cfg, label) / "eval_results.json"
    if not previous.is_file():
        return None
    try:
        saved = json.loads(previous.read_text(encoding="utf-8"))
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (ValueError, OSError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"{previous} cannot be read as an evaluation's results ({e}); move or "
                         f"remove it") from None
    here = str(Path(str(cfg.checkpoint_dir)).resolve())
    if saved.get("checkpoint_dir") != here:
        raise ValueError(
            f"{previous} holds the results of another evaluation labelled {label!r} "
            f"(checkpoint_dir={saved.get('checkpoint_dir')!r}); give this one another "
            f"model_name=, choose another output_dir, or remove {previous}")
    if not isinstance(saved.get("settings"), dict):
        log.warning(f"{previous} was written by an earlier pepo that recorded no settings: "
                    f"every benchmark is evaluated again and it is replaced")
        return None
    changes = experiment_changes(saved["settings"], _settings(cfg, typed))
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise ValueError(
            f"{previous} holds the results labelled {label!r} under other settings: "
            f"{'; '.join(changes[:3])}{more}; give this evaluation another model_name=, choose "
            f"another output_dir, or remove {previous}")
    return saved


def _reusable(saved: Optional[dict[str, Any]], cfg: DictConfig, weights: list,
              prompts: dict[str, str]) -> dict[str, Any]:
    """The benchmark entries of ``saved`` (already checked: the same checkpoint path and
    settings) that need no sampling: all of them when the weight files are unchanged, minus
    those of this config whose ``k`` or prompts (``prompts``: a digest per benchmark) differ,
    each said in one line; none when the weights changed."""
    if saved is None:
        return {}
    done = saved.get("benchmarks") if isinstance(saved.get("benchmarks"), dict) else {}
    if saved.get("weights") != weights:
        log.info(f"the weights in {cfg.checkpoint_dir} changed since its saved results: every "
                 f"benchmark is evaluated again")
        return {}
    keep = {}
    for name, entry in done.items():
        if not isinstance(entry, dict):
            continue
        if name in cfg.benchmarks and (entry.get("k"), entry.get("prompts")) != (
                cfg.benchmarks[name].k, prompts[name]):
            log.info(f"{name}: its k or its prompts changed since the saved result "
                     f"(k {entry.get('k')} -> {cfg.benchmarks[name].k}): sampled again")
            continue
        keep[name] = entry
    return keep


def _check_benchmarks(data: dict[str, list], tokenizer: Any, limit: int,
                      max_new_tokens: int) -> dict[str, str]:
    """Every benchmark has problems, and each prompt fits ``limit`` with ``max_new_tokens``
    (dropping one would change the benchmark; the training recipe's validation drops them).
    Returns a digest of each benchmark's encoded prompts and answers: the same digest, the
    same questions asked alike (tokenizer, chat template and data file included)."""
    digests = {}
    for name, problems in data.items():
        if not problems:
            raise ValueError(f"benchmarks.{name}: its dataset has no problems")
        encoded = [tokenizer.encode_prompt(p.prompt) for p in problems]
        long = [len(ids) for ids in encoded if len(ids) + max_new_tokens > limit]
        if long:
            raise ValueError(
                f"benchmarks.{name}: {len(long)} of {len(problems)} prompts (the longest "
                f"{max(long)} tokens) do not fit {limit} tokens with generation.max_new_tokens="
                f"{max_new_tokens}; raise model.max_seq_len (or generation.vllm.max_model_len) "
                f"or lower generation.max_new_tokens")
        text = json.dumps([[list(map(int, ids)), str(p.answer)]
                           for ids, p in zip(encoded, problems)])
        digests[name] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return digests


def _setup(cfg: DictConfig) -> dict[str, Any]:
    """Everything an evaluation needs, cheapest checks first: config, output directory, data,
    tokenizer, reward, then the model. Raises ``ValueError`` for what the user must fix."""
    given = cfg.get("checkpoint_dir")
    cfg.checkpoint_dir = resolve_marker(given)  # RUN/checkpoints/best works
    c = validate_eval_config(cfg)  # typed, with every default filled in
    label = c.model_name or evaluation_label(given, c.checkpoint_dir)
    lock, previous = _check_results_dir(cfg, label, c)
    reward = None
    try:
        device = utils.get_device(c.device)
        dtype = training.get_dtype(c.dtype, device=device)
        tokenizer = config.instantiate(cfg.tokenizer)
        differs = prompt_differences(tokenizer, c.checkpoint_dir)
        if differs:  # a trained model asked otherwise than in training: its numbers differ
            log.warning(differs)
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
        prompts = _check_benchmarks(data, tokenizer, sequence_limit(model, name, options),
                                    c.generation.max_new_tokens)  # before vLLM starts
        weights = _weights(c.checkpoint_dir)
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
                prompts=prompts, weights=weights, settings=_settings(cfg, c),
                done=_reusable(previous, cfg, weights, prompts), finished=[])


def _close(*owners: Any) -> None:
    for owner in owners:
        close = getattr(owner, "close", None)
        if callable(close):
            close()


def _save(cfg: DictConfig, setup: dict[str, Any], done: dict[str, Any]) -> Path:
    """Writes the results of the benchmarks in ``done`` (name -> entry: this config's, then
    those an earlier evaluation of the same checkpoint and settings left), with what decided
    them; ``complete`` once every benchmark of the config is there."""
    label = setup["label"]
    names = [n for n in cfg.benchmarks if n in done] + [n for n in done
                                                         if n not in cfg.benchmarks]
    js, _ = write_results(
        {n: done[n]["avg"] for n in names}, _results_dir(cfg, label), label,
        meta={"checkpoint_dir": str(Path(str(cfg.checkpoint_dir)).resolve()),
              "complete": all(n in done for n in cfg.benchmarks),
              "k": {n: done[n]["k"] for n in names},
              "generation": OmegaConf.to_container(cfg.generation, resolve=True),
              "settings": setup["settings"], "weights": setup["weights"],
              "benchmarks": {n: done[n] for n in names},
              "pepo_version": pepo.__version__,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return js


def _evaluate(cfg: DictConfig, setup: dict[str, Any]) -> dict[str, float]:
    c = setup["config"]
    g = c.generation
    done = dict(setup["done"])
    js = _results_dir(cfg, setup["label"]) / "eval_results.json"
    try:
        for name, b in cfg.benchmarks.items():
            problems = setup["data"][name]
            if name in done:
                log.info(f"{name}: avg@{b.k} = {100 * done[name]['avg']:.2f}{_se(done[name])}, "
                         f"kept from {js} (the same checkpoint, settings and benchmark)")
                continue
            t0 = time.perf_counter()
            counts: dict[str, int] = {}
            records: list[dict[str, Any]] = []
            avg = avg_at_k(
                setup["engine"], setup["tokenizer"], problems, b.k, setup["reward"],
                max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                top_k=g.top_k, top_p=g.top_p,
                generator=eval_generator(c.seed, setup["device"]),
                batch_size=c.batch_size, stop_tokens=setup["stop_tokens"],
                progress=f"{name} (avg@{b.k}, {len(problems)} problems)", counts=counts,
                records=records,
            )
            responses = write_rollouts(
                _results_dir(cfg, setup["label"]) / "responses" / _file_name(name), records)
            seconds = time.perf_counter() - t0
            cut = counts.get("truncated")
            share = None if cut is None else cut / max(1, counts["rollouts"])
            done[name] = {"avg": avg, "k": b.k, "problems": len(problems),
                          "truncated": share, "seconds": round(seconds, 1),
                          "prompts": setup["prompts"][name],
                          "dataset": flatten_config(b.dataset),
                          "se": problem_se([r["success"] for r in records], b.k),
                          "responses": str(responses)}
            note = "" if not share else (f"; {100 * share:.1f}% of responses truncated, scored "
                                         f"on their text")
            log.info(f"{name}: avg@{b.k} = {100 * avg:.2f}{_se(done[name])} over "
                     f"{len(problems)} problems ({seconds:.1f}s{note}); responses: {responses}")
            js = _save(cfg, setup, done)  # a stop later keeps this benchmark
            setup["finished"].append(name)
        # every benchmark kept: the file, and its row's place in the table, stay as they were
        if not js.is_file():
            js = _save(cfg, setup, done)
        table, everything = _write_summary(Path(str(cfg.output_dir)))
    finally:
        _close(setup["reward"], setup["engine"], setup["lock"])
    print("\n" + table + "\n")
    log.info(f"Results: {js}; every evaluation in {cfg.output_dir}: {everything}")
    return {n: done[n]["avg"] for n in cfg.benchmarks}


def _file_name(benchmark: Any) -> str:
    """``<benchmark>.jsonl``; a name with other characters than letters, digits, ``.``, ``_``
    and ``-`` made safe, with a digest of it so that two names never share a file."""
    name = str(benchmark)
    if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name):
        return f"{name}.jsonl"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")[:80]
    return f"{safe}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}.jsonl"


def _se(entry: dict[str, Any]) -> str:
    se = entry.get("se")
    return "" if se is None else f" ± {100 * se:.2f} (standard error over problems)"


def _write_summary(out: Path) -> tuple[str, Path]:
    """``out/eval_results.md``: one row per evaluation whose results lie in a folder of ``out``,
    oldest first (an unfinished one marked so), and a note naming the settings that differ
    between rows. Returns the table and its path."""
    rows, settings, unfinished = [], [], []
    for js in sorted(out.glob("*/eval_results.json"), key=lambda f: (f.stat().st_mtime, f)):
        try:
            saved = json.loads(js.read_text(encoding="utf-8"))
            label = str(saved["model"]) + (" (unfinished)" if saved.get("complete") is False
                                           else "")
            if saved.get("complete") is False:
                unfinished.append(label)
            rows.append((label, {str(k): float(v) for k, v in saved["results"].items()}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning(f"{js} is not an evaluation's results; left out of the table")
            continue
        mine = dict(saved.get("settings") or {"settings": "not recorded"})
        for name, k in (saved.get("k") or {}).items():
            mine[f"benchmarks.{name}.k"] = k
        for name, entry in (saved.get("benchmarks") or {}).items():
            if isinstance(entry, dict) and entry.get("prompts"):  # the questions, as asked
                mine[f"benchmarks.{name}.prompts"] = str(entry["prompts"])[:12]
        settings.append((label, mine))
    table = format_tables(rows, unfinished)

    def values(key: str) -> list[tuple[str, Any]]:  # a benchmark's keys where a row has it
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
    except KeyboardInterrupt:
        print("interrupted while loading, before any benchmark was evaluated", file=sys.stderr)
        sys.exit(130)
    try:
        _evaluate(cfg, setup)
    except RewardError as e:  # the user's reward code: one line
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        js = _results_dir(cfg, setup["label"]) / "eval_results.json"
        new = len(setup["finished"])
        kept = len(setup["done"]) + new  # what the file holds once this run saved anything
        print(f"interrupted: {new} benchmark(s) finished in this run"
              + (f"; {js} keeps {kept}, and the same command evaluates the rest" if kept
                 else ", none is kept"), file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.argv = resolve_config_arg(sys.argv)
    sys.exit(_main())
