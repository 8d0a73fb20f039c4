"""One rank of a 2-process CPU (gloo) PepoGRPOTrainer run, launched by ``torch.distributed.run``
from ``test_trl.py``: trains one step of each scenario below and saves, for each generation
batch, exactly what the strategy was given and what it returned on this rank, and the rewards
this rank's reward function returned.

Scenarios:

- ``global_topk``: its threshold must cover both ranks' tokens;
- ``row_wise``: ``proximal_softmax`` (weighted inside TRL's loss) with a reward that depends on
  the rank, so each rank's success flags differ from the other's by construction;
- ``gtpo``: 6 completions per rank in groups of 4, so the middle group spans both ranks (with
  the rank-dependent reward, which gives that group both outcomes here);
- ``unscored_row_wise`` / ``unscored_topk``: ``proximal_softmax`` / ``global_topk`` with a
  reward that abstains (None) on a third of rank 0's completions and on none of rank 1's, so
  each rank's unscorable rows differ from the other's by construction.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 \
           trl_two_process_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from datasets import Dataset
from trl import GRPOConfig

from pepo.integrations.trl import PepoGRPOTrainer

FRACTION = 0.2
ROW_WISE_PARAMS = {"window": 5, "temperature": 0.5}


def even_first_char(completions, **kwargs):
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


def by_rank(completions, **kwargs):
    """Rank 0 rewards an even first character, rank 1 an odd one."""
    odd = int(os.environ["RANK"]) == 1
    return [float(len(c) > 0 and (ord(c[0]) % 2 == 0) != odd) for c in completions]


def none_on_rank0(completions, **kwargs):
    """even_first_char, but None (unscorable) for a third of rank 0's completions."""
    rank0 = int(os.environ["RANK"]) == 0
    return [None if rank0 and len(c) > 0 and ord(c[0]) % 3 == 0 else r
            for c, r in zip(completions, even_first_char(completions))]


SCENARIOS = {  # name: (strategy, params, reward, per_device_train_batch_size)
    "global_topk": ("global_topk", {"fraction": FRACTION}, even_first_char, 16),
    "row_wise": ("proximal_softmax", ROW_WISE_PARAMS, by_rank, 16),
    "gtpo": ("gtpo", {}, by_rank, 6),
    "unscored_row_wise": ("proximal_softmax", ROW_WISE_PARAMS, none_on_rank0, 16),
    "unscored_topk": ("global_topk", {"fraction": FRACTION}, none_on_rank0, 16),
}


class Recorder(PepoGRPOTrainer):
    def _pepo_weigh(self, batch, entropies, positive, **kwargs):
        out = super()._pepo_weigh(batch, entropies, positive, **kwargs)
        self.weighed.append({
            "advantages": batch["advantages"].detach().clone(),
            "entropies": entropies.detach().clone(),
            "mask": batch["completion_mask"].bool().clone(),
            "completion_ids": batch["completion_ids"].clone(),
            "positive": positive.clone(),
            "token_advantages": out.detach().clone(),
        })
        return out


def run(name: str, model_dir: str, out_dir: str) -> None:
    strategy, params, reward, batch = SCENARIOS[name]
    rewarded = []  # (completion ids, reward) in this rank's order, as its reward function saw them

    def recording_reward(completions, completion_ids, **kwargs):
        values = reward(completions)
        rewarded.extend(zip([list(c) for c in completion_ids], values))
        return values

    recording_reward.__name__ = reward.__name__
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(Path(out_dir) / f"trl_{name}"), per_device_train_batch_size=batch,
        num_generations=4, max_completion_length=16, max_steps=1, learning_rate=5e-2,
        report_to="none", use_cpu=True, seed=0, save_strategy="no", temperature=0.7, beta=0.0,
        disable_tqdm=True, bf16=False, logging_steps=1,
    )
    data = Dataset.from_list([{"prompt": f"Say a number near {i}:"} for i in range(8)])
    trainer = Recorder(model=model, reward_funcs=recording_reward, args=args, train_dataset=data,
                       processing_class=tok, pepo_strategy=strategy, pepo_params=params)
    trainer.weighed = []
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({"world_size": trainer.accelerator.num_processes, "weighed": trainer.weighed,
                "rewarded": rewarded, "log_history": trainer.state.log_history},
               Path(out_dir) / f"{name}_rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    for scenario in SCENARIOS:
        run(scenario, sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # leave without tearing the gloo group down (a deadlock on some torch releases)
