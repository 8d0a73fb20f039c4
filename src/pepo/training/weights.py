"""Loading model weights from a checkpoint directory, whichever format it holds.

* this project's own checkpoints (``model.safetensors`` with torchtune key names, as
  :class:`pepo.training.checkpointing.AtomicCheckpointer` writes them; checked against the
  sha256 in their ``checksums.json`` first, when they have one), and
* Hugging Face checkpoints (``config.json`` with ``model.safetensors`` or sharded files),
  converted by :mod:`pepo.training.hf`.

Loading is strict: every key and shape must match the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from pepo.training import hf
from pepo.training.checkpointing import MODEL_FILE, verify_weights
from pepo.training.models import check_state_matches

__all__ = ["load_model_weights"]


def load_model_weights(model: torch.nn.Module, checkpoint_dir: Union[str, Path]) -> None:
    """Loads the weights of ``checkpoint_dir`` into ``model`` (strict).

    Raises:
        ValueError: no weights, weights that differ from the sha256 their checkpoint's
            ``checksums.json`` recorded, or keys or shapes that do not match the model.
    """
    d = Path(checkpoint_dir)
    if (d / "config.json").is_file():
        state, source = hf.read_tune_state(d), d
    else:
        source = d / MODEL_FILE
        if not source.is_file():
            raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} has no {MODEL_FILE}")
        verify_weights(d)  # a flipped bit would load silently: safetensors has no checksum
        state = hf.read_safetensors(source)
    check_state_matches(model, state, source)
    model.load_state_dict(state)
