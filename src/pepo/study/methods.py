"""The study's methods (:mod:`pepo.study.compare` runs them, :mod:`pepo.study.power` tests
them as one family): each mode's method labels with their strategy sections, the baseline
first, and the optional ones, which run only when named."""

from __future__ import annotations

__all__ = ["METHODS", "MODES", "OPTIONAL", "methods"]

METHODS = {
    "group": [
        ("GRPO", {"name": "uniform"}),
        ("80/20", {"name": "global_topk"}),
        ("80/20, proximal score", {"name": "global_topk", "global_topk": {"score": "proximal"}}),
        ("Entropy Adv.", {"name": "entropy_bonus"}),
        ("PEPO", {"name": "proximal_softmax"}),
        ("window_average", {"name": "window_average"}),
        ("GTPO", {"name": "gtpo"}),
        # App. F.3's temperature sweep of PEPO (the paper's grid: 0.5, 1, 2)
        ("PEPO, τ = 0.5", {"name": "proximal_softmax", "proximal_softmax": {"temperature": 0.5}}),
        ("PEPO, τ = 2", {"name": "proximal_softmax", "proximal_softmax": {"temperature": 2.0}}),
    ],
    "single_stream": [
        ("SPO", {"name": "uniform"}),
        ("S-80/20", {"name": "global_topk"}),
        ("S-Entropy Adv.", {"name": "entropy_bonus"}),
        ("PESPO", {"name": "proximal_softmax"}),
    ],
}
# run only where ``--methods`` names them: PEPO's window ablation (the paper's Table 6), at the
# windows of the real-model study (about 10 % and 25 % of its responses' mean length, and the
# paper's 101; its W = 5 is the config's PEPO)
OPTIONAL = {
    "group": [(f"PEPO, W = {w}", {"name": "proximal_softmax", "proximal_softmax": {"window": w}})
              for w in (11, 29, 101)],
    "single_stream": [],
}
MODES = ("group", "single_stream")


def methods(mode: str) -> list[tuple[str, dict]]:
    """Every method label of ``mode`` with its strategy: the default plan's, then the optional."""
    return METHODS[mode] + OPTIONAL[mode]
