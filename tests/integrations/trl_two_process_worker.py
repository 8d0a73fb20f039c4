"""One rank of a 2-process CPU (gloo) PepoGRPOTrainer run, launched by ``torch.distributed.run``
from ``test_trl.py``: trains one step with ``global_topk`` and saves, for the generation batch,
exactly what the strategy was given and what it returned on this rank.

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


def reward(completions, **kwargs):
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


class Recorder(PepoGRPOTrainer):
    def _pepo_weigh(self, batch, entropies, positive):
        out = super()._pepo_weigh(batch, entropies, positive)
        self.weighed.append({
            "advantages": batch["advantages"].detach().clone(),
            "entropies": entropies.detach().clone(),
            "mask": batch["completion_mask"].bool().clone(),
            "positive": positive.clone(),
            "token_advantages": out.detach().clone(),
        })
        return out


def main(model_dir: str, out_dir: str) -> None:
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(Path(out_dir) / "trl"), per_device_train_batch_size=16, num_generations=4,
        max_completion_length=16, max_steps=1, learning_rate=5e-2, report_to="none",
        use_cpu=True, seed=0, save_strategy="no", temperature=0.7, beta=0.0,
        disable_tqdm=True, bf16=False,
    )
    data = Dataset.from_list([{"prompt": f"Say a number near {i}:"} for i in range(8)])
    trainer = Recorder(model=model, reward_funcs=reward, args=args, train_dataset=data,
                       processing_class=tok, pepo_strategy="global_topk",
                       pepo_params={"fraction": FRACTION})
    trainer.weighed = []
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({"world_size": trainer.accelerator.num_processes,
                "weighed": trainer.weighed}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # leave without tearing the gloo group down (a deadlock on some torch releases)
