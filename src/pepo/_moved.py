"""The old names of the modules that moved out of the flat ``pepo`` package in 0.2.

``import pepo.generation`` still works and gives ``pepo.training.generation`` (one
``FutureWarning`` naming the new place); ``python -m pepo.analysis`` runs
``pepo.study.analysis``. These names go away in 0.3. The finder only maps names: nothing above
the core is imported unless an old name is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional

__all__: list[str] = []

_TRAINING = ("checkpointing", "distributed", "engines", "evaluation", "generation", "hf",
             "models", "prior_cache", "reporting", "tokenizers", "weights")

MOVED = {
    "pepo.recipe_config": "pepo.training.config",
    **{f"pepo.{m}": f"pepo.training.{m}" for m in _TRAINING},
    "pepo.datasets": "pepo.tasks.datasets",
    "pepo.rewards": "pepo.tasks.rewards",
    "pepo.analysis": "pepo.study.analysis",
    "pepo.intervention": "pepo.study.intervention",
}


def _warn(old: str) -> str:
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new} in pepo 0.2; the old name goes away in 0.3",
                  FutureWarning, stacklevel=3)
    return new


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 (importlib protocol)
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(_warn(spec.name))
        self._own_spec = module.__spec__  # the import system overwrites it with the alias's
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec

    def get_code(self, fullname: str):
        """For ``python -m OLD``: the moved module's code, its package imported first (so its
        missing-extra error speaks before anything else)."""
        new = _warn(fullname)
        importlib.import_module(new.rpartition(".")[0])
        spec: Optional[importlib.machinery.ModuleSpec] = importlib.util.find_spec(new)
        return spec.loader.get_code(new)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
