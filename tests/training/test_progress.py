"""pepo.training.progress: what a run shows while it trains, on a terminal and off one."""

from __future__ import annotations

import io

import pytest

from pepo.training.progress import Progress, is_terminal, postfix, rollout_counter


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


METRICS = {"reward": 0.5, "accuracy": 0.25, "loss": -9.251e-05, "tokens_per_s": 6230.4,
           "step_time": 0.4971}


def test_off_a_terminal_steps_are_lines_about_twenty_a_run_and_nothing_is_redrawn():
    """A log file got the bar's carriage-return updates, one 23 kB line for the tiny run.
    Catches lines for every step (a 500-step run's log), none at all, the last step or a
    validation left out, a carriage return, and lines from a process other than the main."""
    out = io.StringIO()
    with Progress(60, 0, "pepo[x]", stream=out) as p:
        for step in range(1, 61):
            p.step(step, {**METRICS, **({"val_accuracy": 0.75} if step == 30 else {})})
        p.write("step 60: checkpoint out/step_60")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 21  # every third step of 60, and the line written
    assert lines[0] == ("pepo[x] step 3/60: reward=0.500, acc=0.250, loss=-9.25e-05, "
                        "step_s=0.50, tok_s=6230")
    assert lines[9].startswith("pepo[x] step 30/60: val=0.750, reward=0.500")
    assert lines[-2].startswith("pepo[x] step 60/60:")
    assert lines[-1] == "step 60: checkpoint out/step_60"
    resumed = io.StringIO()
    with Progress(60, 40, "pepo[x]", stream=resumed) as p:  # 20 steps left: a line each
        p.step(41, METRICS)
    assert resumed.getvalue().startswith("pepo[x] step 41/60:")
    quiet = io.StringIO()
    with Progress(60, 0, "pepo[x]", stream=quiet, enabled=False) as p:
        p.step(3, METRICS)
        p.write("not the main process")
    assert quiet.getvalue() == ""


def test_a_slow_run_off_a_terminal_still_says_where_it_is_each_minute(monkeypatch):
    clock = iter([0.0, 61.0, 62.0])
    monkeypatch.setattr("pepo.training.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    p = Progress(500, 0, "pepo[x]", stream=out)  # a line each 25 steps, or each minute
    p.step(1, METRICS)  # 61 s after the start
    p.step(2, METRICS)  # 1 s later
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == ["pepo[x] step 1/500"]


def test_on_a_terminal_the_bar_is_closed_however_the_loop_ends(monkeypatch):
    """A run that failed mid-way ended its terminal with the bar redrawn after the traceback
    (the bar was never closed): its last line read 5 %, not the error. Catches the bar left
    open by an exception, and a bar drawn under TERM=dumb (whose cursor moves show as text)."""
    monkeypatch.delenv("TERM", raising=False)
    term = Terminal()
    assert is_terminal(term)
    with pytest.raises(RuntimeError, match="reward server"):
        with Progress(60, 0, "pepo[x]", stream=term) as p:
            assert p.bar is not None
            p.step(1, METRICS)
            p.write("step 1: checkpoint out/step_1")
            raise RuntimeError("reward server unreachable")
    assert p.bar is None
    shown = term.getvalue()
    assert "pepo[x]" in shown and "step 1: checkpoint out/step_1\n" in shown
    drawn = len(shown)
    p.close()  # idempotent, and nothing draws again
    assert len(term.getvalue()) == drawn
    monkeypatch.setenv("TERM", "dumb")
    assert not is_terminal(Terminal())
    dumb = Terminal()
    with Progress(60, 0, "pepo[x]", stream=dumb) as p:
        p.step(3, METRICS)
    assert p.bar is None and dumb.getvalue().startswith("pepo[x] step 3/60:")


def test_the_postfix_puts_the_validation_first_and_a_small_loss_in_three_figures():
    """The validation came last (tqdm sorts keyword postfixes), the first cut off at the end of
    a narrow terminal, and a loss of -9.25e-05 read -0.0001. Catches either."""
    shown = postfix({**METRICS, "val_accuracy": 0.8125})
    assert list(shown) == ["val", "reward", "acc", "loss", "step_s", "tok_s"]
    assert shown["loss"] == "-9.25e-05" and shown["val"] == "0.812"
    assert list(postfix({"loss": 0.5})) == ["loss"]  # what a step did not report is left out


def test_a_rollout_count_off_a_terminal_is_a_line_a_minute_and_silent_when_short(monkeypatch):
    """Off a terminal the validation's bar ended each validation at a part-way count (72 %),
    as if it had stopped. Catches a bar drawn there, and lines for a count under a minute."""
    short = io.StringIO()
    counter = rollout_counter(512, "validation", stream=short)
    for _ in range(8):
        counter.update(64)
    counter.close()
    assert short.getvalue() == ""
    clock = iter([0.0, 61.0, 70.0, 75.0])
    monkeypatch.setattr("pepo.training.progress.time.monotonic", lambda: next(clock))
    slow = io.StringIO()
    counter = rollout_counter(512, "validation", stream=slow)  # t0 = 0
    counter.update(256)  # 61 s
    counter.update(256)  # 70 s: within the minute
    counter.close()  # 75 s
    assert slow.getvalue().splitlines() == ["validation: 256/512 rollouts (61 s)",
                                            "validation: 512/512 rollouts (75 s)"]


def test_the_loggers_lines_go_above_the_bar_only_for_a_logger_that_prints(monkeypatch):
    """On a terminal a logger that prints to the console has its lines written above the bar
    (a Ctrl-C's notice cut through it); one without a console handler of its own (it
    propagates to the root's) is left alone, or each of its lines would print twice."""
    import logging
    import sys

    monkeypatch.delenv("TERM", raising=False)
    own = logging.getLogger("pepo.test.progress.own")
    own.addHandler(logging.StreamHandler(sys.stderr))
    bare = logging.getLogger("pepo.test.progress.bare")
    try:
        for logger, redirected in ((own, True), (bare, False)):
            before = list(logger.handlers)
            with Progress(10, 0, "pepo[x]", stream=Terminal(), logger=logger):
                assert (logger.handlers != before) == redirected
            assert logger.handlers == before
    finally:
        own.handlers.clear()


def test_the_run_line_says_what_the_run_will_do():
    """One line after the config's dump (85 lines, every strategy's section) says what runs:
    catches a field read from the wrong place (the estimator's rollouts, the processes)."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from pepo.training.progress import run_line

    recipe = SimpleNamespace(
        config_name="tiny_spo", strategy_name="proximal_softmax", num_steps=60,
        prompts_per_step=64, estimator=SimpleNamespace(name="single_stream",
                                                       rollouts_per_prompt=1),
        dist=SimpleNamespace(world_size=2), _device=torch.device("cpu"),
        output_dir=Path("pepo_runs") / "tiny_spo", train_data=[None] * 4096)
    assert run_line(recipe) == (
        f"tiny_spo: proximal_softmax, single_stream estimator, 60 steps of 64 prompts x 1 "
        f"rollouts from 4,096 training problems, on cpu (2 processes), outputs in "
        f"{Path('pepo_runs') / 'tiny_spo'}")


def test_off_a_terminal_the_last_step_has_its_line_when_the_period_misses_it():
    """45 steps: a line every second step (45 // 20), which step 45 is not: catches
    the run's last step left without a line (the log then ends at step 44 as if the run had
    stopped one short)."""
    out = io.StringIO()
    with Progress(45, 0, "pepo[x]", stream=out) as p:
        for step in range(1, 46):
            p.step(step, METRICS)
    steps = [int(line.split()[2].split("/")[0]) for line in out.getvalue().splitlines()]
    assert steps == list(range(2, 45, 2)) + [45]


def test_only_a_console_handler_is_redirected_and_the_redirect_ends_with_the_bar(
        monkeypatch, tmp_path):
    """Catches a logger that writes to a file only (a FileHandler is a
    StreamHandler too) given the bar's console handler, so its lines also reach the terminal;
    and the redirect of a console logger left in place after the bar closed while the
    Progress is still referenced (the loop's frame, kept by an error's traceback): the error's
    own log lines would then go through a closed bar."""
    import logging
    import sys

    monkeypatch.delenv("TERM", raising=False)
    to_file = logging.getLogger("pepo.test.progress.file")
    to_file.addHandler(logging.FileHandler(tmp_path / "run.log"))
    own = logging.getLogger("pepo.test.progress.console")
    own.addHandler(logging.StreamHandler(sys.stderr))
    try:
        before = list(to_file.handlers)
        with Progress(10, 0, "pepo[x]", stream=Terminal(), logger=to_file):
            assert to_file.handlers == before
        before = list(own.handlers)
        with Progress(10, 0, "pepo[x]", stream=Terminal(), logger=own) as p:
            assert own.handlers != before
        assert own.handlers == before and p.bar is None  # p still referenced here
    finally:
        for h in to_file.handlers:
            h.close()
        to_file.handlers.clear()
        own.handlers.clear()


def test_the_run_line_of_one_step_on_one_process_is_singular():
    """Catches "1 steps" (and "1 processes")."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from pepo.training.progress import run_line

    recipe = SimpleNamespace(
        config_name="tiny", strategy_name="uniform", num_steps=1, prompts_per_step=8,
        estimator=SimpleNamespace(name="group", rollouts_per_prompt=4),
        dist=SimpleNamespace(world_size=1), _device=torch.device("cpu"),
        output_dir=Path("out"), train_data=[None] * 12)
    assert run_line(recipe) == (
        f"tiny: uniform, group estimator, 1 step of 8 prompts x 4 rollouts from 12 training "
        f"problems, on cpu (1 process), outputs in {Path('out')}")
