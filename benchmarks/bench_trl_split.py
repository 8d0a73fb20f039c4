"""Where the TRL adapter's share of a step goes: the CPU seconds of recording the entropies while
``generate()`` samples, of the weighting (strategy and ``pepo/`` metrics), and of the no-grad
forward over the generation batch that the recording replaced, against the whole step; and how
far the recorded entropies are from that forward's.

    python benchmarks/bench_trl_split.py [--steps 8] [--strategies global_topk gtpo ...]

The model and batch are ``bench_trl.py``'s (a 2.37M-parameter random Qwen3, 32 completions of up
to 64 tokens a step). The forward is run to be measured and compared, its result unused; its time
is left out of the step. Needs TRL (``pip install trl==1.16.0``).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from importlib.resources import files

import torch
import transformers
from datasets import Dataset
from trl import GRPOConfig

import pepo.weighting as pw
from pepo.integrations import trl as pepo_trl
from pepo.tasks import modsum_dataset


def reward(completions, answer, **kwargs):
    return [float(next((ch for ch in c if ch.isdigit()), None) == a)
            for c, a in zip(completions, answer)]


class Split(pepo_trl.PepoGRPOTrainer):
    """Adds up the CPU seconds of each part, and compares the recorded entropies with the
    forward's."""

    def _pepo_weigh(self, *args, **kwargs):
        start = time.process_time()
        out = super()._pepo_weigh(*args, **kwargs)
        self.cpu["weighting"] += time.process_time() - start
        return out

    def pepo_rollout_entropies(self, output):
        recorded = super().pepo_rollout_entropies(output)
        if self._pepo_recorder is None:
            return recorded
        saved, self._pepo_recorder = self._pepo_recorder, None
        start = time.process_time()
        forward = super().pepo_rollout_entropies(output)  # the adapter's former no-grad forward
        self.cpu["forward"] += time.process_time() - start
        self._pepo_recorder = saved
        mask = output["completion_mask"].bool()
        ones = torch.ones(mask.size(0))
        top = pw.get_strategy("global_topk")
        self.gap = max(self.gap, float((recorded - forward).abs()[mask].max()))
        chosen = [top(ones, e, mask) != 0 for e in (recorded, forward)]
        self.flips += int((chosen[0] != chosen[1]).sum())
        return recorded

    def training_step(self, *args, **kwargs):
        start = time.process_time()
        out = super().training_step(*args, **kwargs)
        self.cpu["step"] += time.process_time() - start
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--strategies", nargs="+", default=["global_topk", "gtpo", "proximal_softmax"])
    a = ap.parse_args()

    recorder_cpu = [0.0]
    record = pepo_trl.EntropyRecorder.__call__

    def timed_record(self, input_ids, scores):
        start = time.process_time()
        out = record(self, input_ids, scores)
        recorder_cpu[0] += time.process_time() - start
        return out

    pepo_trl.EntropyRecorder.__call__ = timed_record
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(files("pepo") / "assets" / "tiny" / "tokenizer.json"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer}
                              for p in modsum_dataset(256, seed=0)])
    print(f"{torch.get_num_threads()} threads; {a.steps} steps each; CPU shares of a step "
          f"(the measuring forward left out)")
    for strategy in a.strategies:
        recorder_cpu[0] = 0.0
        with tempfile.TemporaryDirectory() as out:
            args = GRPOConfig(
                output_dir=out, per_device_train_batch_size=32, num_generations=8,
                max_completion_length=64, max_steps=a.steps, learning_rate=1e-4, beta=0.0,
                logging_steps=a.steps, report_to="none", use_cpu=True, bf16=False,
                save_strategy="no", disable_tqdm=True, seed=0)
            trainer = Split(model=copy.deepcopy(base), reward_funcs=reward, args=args,
                            train_dataset=data, processing_class=tok, pepo_strategy=strategy)
            trainer.cpu = {"weighting": 0.0, "forward": 0.0, "step": 0.0}
            trainer.gap, trainer.flips = 0.0, 0
            trainer.train()
        step = trainer.cpu["step"] - trainer.cpu["forward"]
        line = (f"  {strategy:18s} step {step / a.steps:.3f} s: recording "
                f"{recorder_cpu[0] / step:.2%}, weighting {trainer.cpu['weighting'] / step:.2%}")
        if trainer.cpu["forward"]:
            line += (f"; the forward it replaced {trainer.cpu['forward'] / step:.1%} (entropies "
                     f"at most {trainer.gap:.1e} apart, {trainer.flips} global_topk tokens "
                     f"selected differently)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
