"""pepo: Proximal Entropy Policy Optimization and the token-weighting baselines it is measured
against, for reinforcement learning with verifiable rewards."""

from pepo import entropy, estimators, loss, weighting

__version__ = "0.1.0"

__all__ = ["entropy", "estimators", "loss", "weighting", "__version__"]
