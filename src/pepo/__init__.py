"""pepo: Proximal Entropy Policy Optimization and the token-weighting baselines it is measured
against, for reinforcement learning with verifiable rewards.

The modules at this level are the core, and need torch alone (``pip install .`` in pepo's
source): ``weighting`` (the strategies), ``estimators`` (sequence-level advantages), ``loss`` (the
clipped surrogate) and ``entropy`` (log-probs and entropies from logits), imported with
``pepo``, and ``sampling`` (the resumable prompt order; ``import pepo.sampling``) with the
private helpers they share. The layers above it live in subpackages: ``pepo.tasks`` (the
embedded tasks and verifiers, plain Python), ``pepo.training`` (the recipe's machinery) and
``pepo.study`` (diagnostics and the strategy study), which need ``pip install -e ".[recipe]"``,
and ``pepo.integrations`` (TRL, verl).
"""

from pepo import entropy, estimators, loss, weighting

__version__ = "0.2.0"

__all__ = ["entropy", "estimators", "loss", "weighting", "__version__"]
