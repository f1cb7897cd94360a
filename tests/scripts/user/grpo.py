"""Online RL (GRPO) the way TRL's docs write it, with one swapped import when USE_HF_XLA_FSDP=1.

    python tests/scripts/user/grpo.py --model_name_or_path DIR --output_dir OUT [--use_peft]
        [GRPOConfig flags: --fsdp full_shard --fsdp_config '{"xla": true}', --max_steps, --num_generations, ...]

Data: counting prompts (tests/trl_helpers.py); the reward is a Python function (how many tokens continue the count).
The model is given as its path. With --record_dir, the graphs XLA compiled in each step (torch_xla's metrics, in a
callback) go into OUT/results.json beside the log history.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for trl_helpers

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, HfArgumentParser, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl_helpers import counting_reward, prompt_rows  # noqa: E402

if os.environ.get("USE_HF_XLA_FSDP") == "1":
    from hf_xla_fsdp import XlaFsdpGRPOTrainer as GRPOTrainer
else:
    from trl import GRPOTrainer


class CompilesPerStep(TrainerCallback):
    """Test instrumentation, per step: everything XLA compiled (torch_xla's CompileTime metric) and the graphs of the
    computation among it (the UncachedCompile counter: graphs not found in the graph cache). The two differ by the
    small programs torch_xla compiles, uncached, whenever an SPMD-sharded tensor is read to the host
    (ReplicateShardedData). A step's count runs from the end of the step before: a step's optimizer update runs
    (and compiles) at the next sync, when the Trainer fetches the next batch, between two steps' callbacks."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.graphs: list[int] = []
        self.seen: tuple[int, int] | None = None

    @staticmethod
    def count() -> tuple[int, int]:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0, int(met.counter_value("UncachedCompile") or 0)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.seen is None:
            self.seen = self.count()
        if os.environ.get("GRPO_MARK_STEPS"):
            print(f"=== step {state.global_step + 1}", file=sys.stderr, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        now = self.count()
        self.per_step.append(now[0] - self.seen[0])
        self.graphs.append(now[1] - self.seen[1])
        self.seen = now


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local pretrained model directory"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters"})
    record_dir: str = field(default="", metadata={"help": "test instrumentation: count the graphs of every step"})


def main() -> None:
    ns, args = HfArgumentParser((ScriptArguments, GRPOConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(ns.model_name_or_path)
    tokenizer.padding_side = "left"
    train = Dataset.from_list(prompt_rows(64))
    peft_config = None
    if ns.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    counter = CompilesPerStep() if ns.record_dir else None
    trainer = GRPOTrainer(model=ns.model_name_or_path, reward_funcs=counting_reward, args=args, train_dataset=train,
                          processing_class=tokenizer, peft_config=peft_config,
                          callbacks=[counter] if counter is not None else None)
    trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        steps = [e for e in trainer.state.log_history if "loss" in e]
        out = {"steps": steps, "compiles": counter.per_step if counter is not None else None,
               "graphs": counter.graphs if counter is not None else None}
        Path(args.output_dir, "results.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
