"""What a training run shows while it trains, on standard error.

On a terminal, a progress bar of the steps with the latest metrics; elsewhere (a log file, a job
scheduler, ``TERM=dumb``) plain lines instead, about twenty a run (and one at least each minute),
since a bar's carriage-return updates pile up there as one endless line. Either way each
validation and each checkpoint gets a line of its own, and the bar is closed however the loop
ends, so that an error's traceback, not a half-drawn bar, is the last thing shown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress", "is_terminal", "postfix", "rollout_counter", "run_line"]


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that redraws a bar in place (not a file, a pipe, or a
    ``TERM=dumb`` console, which shows its cursor moves as text)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """A step's metrics as the bar shows them, the validation first (the first to be cut off
    at the end of a narrow terminal's line is then the least important)."""
    shown = {"val": "val_accuracy", "reward": "reward", "acc": "accuracy", "loss": "loss",
             "step_s": "step_time", "tok_s": "tokens_per_s"}
    out = {}
    for label, key in shown.items():
        if key in metrics:
            v = float(metrics[key])
            out[label] = (f"{v:.3g}" if key == "loss" else f"{v:.0f}" if key == "tokens_per_s"
                          else f"{v:.2f}" if key == "step_time" else f"{v:.3f}")
    return out


class Progress:
    """The steps ``initial + 1 .. total`` of a run, shown as they finish (by the main process:
    ``enabled``). Use it as a context manager; :meth:`write` prints a line of its own."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True,
                 stream: Optional[TextIO] = None, every_s: float = 60.0,
                 logger: Optional[logging.Logger] = None) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.every = max(1, (total - initial) // 20)
        self._last = time.monotonic()
        self._logger = logger
        self._stack = contextlib.ExitStack()
        self.bar: Any = None
        if enabled and is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                            file=self.stream)

    def __enter__(self) -> "Progress":
        handlers = self._logger.handlers if self._logger is not None else []
        if self.bar is not None and any(
                isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
                for h in handlers):
            from tqdm.contrib.logging import logging_redirect_tqdm

            # the logger's lines (a Ctrl-C's notice) above the bar, not through it; only a
            # logger that prints itself (one that propagates to the root's would print twice)
            self._stack.enter_context(logging_redirect_tqdm(loggers=[self._logger]))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` finished with ``metrics``."""
        if not self.enabled:
            return
        shown = postfix(metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(shown)
            return
        now = time.monotonic()
        if step % self.every == 0 or step == self.total or now - self._last >= self.every_s:
            self._last = now
            self.write(f"{self.desc} step {step}/{self.total}: "
                       + ", ".join(f"{k}={v}" for k, v in shown.items()))

    def write(self, line: str) -> None:
        """``line`` on a line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Removes the bar's live state (idempotent): nothing redraws it afterwards."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._stack.close()


class _Lines:
    """:func:`rollout_counter` off a terminal: a line each ``every_s`` seconds while counting,
    and a closing one only if any was printed (a short count prints nothing)."""

    def __init__(self, total: int, desc: str, stream: TextIO, every_s: float) -> None:
        self.total, self.desc, self.stream, self.every_s = total, desc, stream, every_s
        self.n, self._t0 = 0, time.monotonic()
        self._last, self._printed = self._t0, False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last, self._printed = now, True
            self._line(now)

    def _line(self, now: float) -> None:
        print(f"{self.desc}: {self.n}/{self.total} rollouts ({now - self._t0:.0f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._printed:
            self._printed = False
            self._line(time.monotonic())


def rollout_counter(total: int, desc: str, stream: Optional[TextIO] = None,
                    every_s: float = 60.0) -> Any:
    """A count of ``total`` rollouts as they finish (``update(n)``, ``close()``): a bar on a
    terminal, removed when done; elsewhere a line a minute (see :class:`Progress`)."""
    stream = stream if stream is not None else sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="rollout", leave=False, dynamic_ncols=True,
                    file=stream)
    return _Lines(total, desc, stream, every_s)


def run_line(recipe: Any) -> str:
    """One line saying what a run will do, after the config's dump: the config, strategy and
    estimator, the steps and batch, the training problems they are drawn from (a shard of a
    dataset pointed at instead of its directory shows here), the device and processes, where
    the outputs go."""
    est, n = recipe.estimator, recipe.dist.world_size
    return (f"{recipe.config_name}: {recipe.strategy_name}, {est.name} estimator, "
            f"{recipe.num_steps} step{'s' * (recipe.num_steps != 1)} of "
            f"{recipe.prompts_per_step} prompts x "
            f"{est.rollouts_per_prompt} rollouts from {len(recipe.train_data):,} training "
            f"problems, on {recipe._device.type} ({n} process{'es' * (n > 1)}), outputs in "
            f"{recipe.output_dir}")
