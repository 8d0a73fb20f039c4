"""The training machinery behind the torchtune recipes (``recipes/pepo_recipe.py``,
``recipes/pepo_eval.py``): the config schema (``config``), rollout engines and the in-process
decoder (``engines``, ``generation``), models and Hugging Face conversion (``models``, ``hf``,
``weights``, ``tokenizers``), checkpoints, processes (``distributed``), reports
(``reporting``), SPO's offline prior (``prior_cache``) and validation (``evaluation``).

It needs the recipe stack: ``pip install -e ".[recipe]"``. The core below it (``pepo.weighting``,
``pepo.estimators``, ``pepo.loss``, ``pepo.entropy``) needs torch alone.
"""

from pepo import _extras

_extras.require("pepo.training")
