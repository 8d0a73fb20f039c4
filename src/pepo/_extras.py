"""What each layer above the core needs installed, and the error that says how to install it.

``pip install .`` (in pepo's source directory) is the core (``pepo.weighting``,
``estimators``, ``loss``, ``entropy``): torch alone. The training recipe, its machinery
(``pepo.training``) and the study tools (``pepo.study``) need the recipe stack,
``pip install -e ".[recipe]"``. Each of those packages
calls :func:`require` first, so importing one without its extra fails with an ``ImportError``
that names the extra and the missing modules, not with a bare ``No module named 'torchtune'``
from deep inside.
"""

from __future__ import annotations

import importlib.util
import logging

__all__: list[str] = []

# The import names of the `recipe` extra's packages (pyproject.toml), in its order.
RECIPE_MODULES = (
    "torchtune",
    "torchao",
    "transformers",
    "tokenizers",
    "safetensors",
    "math_verify",
    "omegaconf",
    "tqdm",
    "matplotlib",
    "gguf",
    "accelerate",
    "scipy",
    "pyarrow",
)

# pepo is installed from its source tree, not from the package index
INSTALL_HINT = {"recipe": 'pip install -e ".[recipe]" in pepo\'s source directory'}


def missing(modules: tuple[str, ...]) -> list[str]:
    """The names in ``modules`` that cannot be imported here (looked up, not imported)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a blocking import hook, or a broken partial install
            found = False
        if not found:
            out.append(name)
    return out


def require(package: str, extra: str = "recipe", modules: tuple[str, ...] = RECIPE_MODULES) -> None:
    """Raises ``ImportError`` naming ``extra`` unless every module of it is installed.

    Args:
        package: the pepo package being imported (named in the message).
        extra: the pyproject extra that installs ``modules``.
        modules: import names the package needs.
    """
    quiet_torchao()
    absent = missing(modules)
    if absent:
        raise ImportError(
            f"{package} needs pepo's {extra!r} extra, which is not installed (missing: "
            f"{', '.join(absent)}). Install it with: {INSTALL_HINT[extra]}. The core "
            f"(pepo.weighting, pepo.estimators, pepo.loss, pepo.entropy) needs torch alone.",
            name=absent[0],
        )


class _TorchaoAbiNotice(logging.Filter):
    """Drops the one line torchao 0.15.0 logs when imported with torch 2.13 ("Skipping import of
    cpp extensions due to incompatible torch version ..."). torchao 0.15.0 is the newest
    release torchtune 0.6.1 works with (0.16 breaks ``torchtune.training``), and it ships C++
    kernels built for torch 2.9, which it then rightly does not load; neither the recipe nor
    torchtune's code paths it runs use them. Every other torchao message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            "Skipping import of cpp extensions due to incompatible torch version")


def quiet_torchao() -> None:
    """Installs :class:`_TorchaoAbiNotice` on the ``torchao`` logger (once, before torchao is
    imported by a recipe-layer module). ``tune run`` imports torchao (through torchtune)
    before any pepo code runs, so there the line is printed once, before the run's own output."""
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, _TorchaoAbiNotice) for f in logger.filters):
        logger.addFilter(_TorchaoAbiNotice())
