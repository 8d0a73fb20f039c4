"""Tasks: the embedded problem generators (``problems``), dataset loaders (``datasets``) and
the verifiers that turn responses into rewards (``rewards``).

Plain Python: importable with the core install. ``rewards.MathVerify`` needs ``math-verify``,
which the ``recipe`` extra installs.
"""

from pepo.tasks.datasets import BOXED_TEMPLATE, load_math_dataset
from pepo.tasks.problems import (
    Problem,
    apply_op,
    drift_dataset,
    drift_problem,
    modsum_dataset,
    modsum_problem,
    modsum_solution,
    reason_dataset,
    small_sums_dataset,
    step_arithmetic_dataset,
)
from pepo.tasks.rewards import BoxedMatch, MathVerify, boxed_match, last_boxed

__all__ = [
    "BOXED_TEMPLATE",
    "BoxedMatch",
    "MathVerify",
    "Problem",
    "apply_op",
    "boxed_match",
    "drift_dataset",
    "drift_problem",
    "last_boxed",
    "load_math_dataset",
    "modsum_dataset",
    "modsum_problem",
    "modsum_solution",
    "reason_dataset",
    "small_sums_dataset",
    "step_arithmetic_dataset",
]
