"""Rollouts of TRL's online trainers (GRPO, RLOO) on XLA: ``model.generate`` on the sharded policy, in fixed shapes.

XLA compiles one graph per distinct computation. TRL's own generation path pads each batch of prompts to its longest
prompt, stops when every sequence has ended, pads the completions to the longest one, and lets the decode loop's
pending work pile up between the host reads of its stop check: on FSDP v2 that compiled 82, 21, 12 and 13 graphs in
steps 1-4. :class:`StaticShapeRollout` is the same generation with the static-shape discipline of training:

* prompts left-padded to a bucket (a multiple of the trainer's ``pad_to_multiple_of``, which TRL also pads the
  training batch to), completions generated to ``max_completion_length`` exactly (no early stop: TRL keeps a
  completion up to its first end-of-sequence token anyway, so the tokens after it change nothing), with a static
  KV cache (``cache_implementation="static"``) sized bucket + ``max_completion_length``;
* the lazy graph is cut after every decode step (:class:`StepSync`), so each step runs the same small graph;
* ``pad_to_multiple_of`` defaults to ``max_completion_length`` (:func:`fix_shapes`), so the training step sees
  prompts of a bucket length and completions of exactly ``max_completion_length``.

The first rollout of a bucket compiles its graphs (a prefill and one per decode position); later ones compile none.
(Under SPMD, torch_xla 2.9 compiles a small replication program, uncached, for each host read of a sharded tensor;
the completions are read through the session's ``whole``, gathered in a cached graph instead, and so are TRL's reads
of what it gathers with ``accelerator.gather``.)
The policy is called through ``accelerator.unwrap_model``: its inner module runs through the root unit
(:mod:`hf_xla_fsdp.modeling.routing`), which gathers the root's shards on FSDP v1. Tokens per second of every rollout
go into the trainer's logged metrics (``generation/tokens_per_second``), with the graphs it compiled
(``generation/graphs_compiled``).

This is TRL's ``rollout_func`` (the trainer's own seam for other generation backends): the mixin installs it when the
script gave none and does not use vLLM. A vLLM-TPU backend would be another ``rollout_func`` (out of scope here).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ..errors import ConfigError

logger = logging.getLogger(__name__)


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _bucket(length: int, multiple: Optional[int]) -> int:
    return -(-length // multiple) * multiple if multiple else length


class StepSync:
    """A stopping criterion that never stops: it cuts the lazy graph after each decode step (``generate`` reads only
    its stop flag back, which alone would keep every other step's work pending and growing)."""

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        from ..runtime import sync

        sync()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def fix_shapes(trainer: Any) -> None:
    """Give an online TRL trainer fixed training shapes: ``pad_to_multiple_of`` = ``max_completion_length`` when the
    script left it unset (TRL's "auto" pads only on Neuron), so completions pad to exactly that length and prompts
    to its multiples."""
    length = getattr(trainer, "max_completion_length", None)
    if length and getattr(trainer, "pad_to_multiple_of", "missing") is None:
        trainer.pad_to_multiple_of = length
    elif length and trainer.pad_to_multiple_of and length % trainer.pad_to_multiple_of:
        logger.warning("pad_to_multiple_of=%s does not divide max_completion_length=%s: completions of different "
                       "lengths compile different training graphs", trainer.pad_to_multiple_of, length)


def warm_completion_metrics(trainer: Any, rows: int) -> None:
    """Compile now every graph of TRL's completion-length metrics that a later step could need.

    GRPO's ``_generate`` averages the lengths of the completions that ended with EOS:
    ``agg_completion_lengths[~agg_is_truncated]``, a shape that is the number of such completions. Each new count
    compiles three small graphs (mean, min, max), data-dependent, for as long as training runs. The graphs depend on
    that count only (not on which rows), so running the same operations once for every count from 0 to ``rows`` (per
    process, gathered over the processes as TRL gathers) in the first rollout leaves nothing for later steps.
    Mirrors TRL 1.x's metric code; if TRL computes them otherwise, those graphs simply compile when first met.
    """
    device, gather = trainer.accelerator.device, trainer.accelerator.gather
    processes, index = trainer.accelerator.num_processes, trainer.accelerator.process_index
    for total in range(rows * processes + 1):
        lengths = gather(torch.tensor([1] * rows, device=device))
        for reduce in (torch.mean, torch.min, torch.max):
            reduce(lengths.float()).item()
        ended = min(max(total - index * rows, 0), rows)  # this process's share of `total` ended completions
        truncated = gather(torch.tensor([i >= ended for i in range(rows)], device=device))
        truncated.float().mean().item()
        ended_lengths = lengths[~truncated]
        if len(ended_lengths) == 0:
            ended_lengths = torch.zeros(1, device=device)
        for reduce in (torch.mean, torch.min, torch.max):
            reduce(ended_lengths.float()).item()


@contextlib.contextmanager
def _no_default_eos(model: Any) -> Iterator[None]:
    """``generate`` without the model's default end-of-sequence token for the duration of one call.

    ``generate`` fills every field the given config leaves ``None`` from the model's own ``generation_config``, so
    ``config.eos_token_id = None`` alone brings the EOS back, and with it ``EosTokenCriteria``: a ``torch.isin`` per
    decode step, which XLA runs on the host (the step's tokens read back each time; under SPMD, a replication program
    compiled per read), and an early stop once every row has ended (another shape)."""
    defaults = getattr(model, "generation_config", None)
    eos = getattr(defaults, "eos_token_id", None)
    if eos is None:
        yield
        return
    defaults.eos_token_id = None
    try:
        yield
    finally:
        defaults.eos_token_id = eos


class StaticShapeRollout:
    """TRL's ``rollout_func`` for a trainer on XLA FSDP (see the module)."""

    def __init__(self) -> None:
        self._warm: set[int] = set()

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Generate ``max_completion_length`` tokens for each prompt; TRL's output: prompt and completion ids."""
        from transformers import StoppingCriteriaList

        tokenize = getattr(trainer, "_tokenize_prompts", None)
        if tokenize is not None:  # TRL's own tokenization (chat template, tools)
            prompt_ids, images, fields = tokenize(prompts)
            if images is not None or fields:
                raise ConfigError("hf_xla_fsdp's XLA rollouts generate from text prompts; multimodal prompts need "
                                  "another rollout_func")
        else:
            prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        tokenizer = getattr(trainer, "_tokenizer", trainer.processing_class)
        pad = tokenizer.pad_token_id
        length = _bucket(max(len(ids) for ids in prompt_ids), trainer.pad_to_multiple_of)
        batch = torch.full((len(prompt_ids), length), pad, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left-padded, as TRL pads prompts
            if ids:
                batch[row, length - len(ids):] = torch.tensor(ids)
                mask[row, length - len(ids):] = 1
        new = trainer.max_completion_length
        config = copy.deepcopy(trainer.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.max_length = new, None, None
        config.cache_implementation = "static"
        config.eos_token_id = None  # every row generates `new` tokens; TRL keeps each up to its first EOS below
        config.pad_token_id = pad
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        device = trainer.accelerator.device
        compiled, start = _compiles(), time.perf_counter()
        with torch.no_grad(), _no_default_eos(model):
            out = model.generate(input_ids=batch.to(device), attention_mask=mask.to(device), generation_config=config,
                                 stopping_criteria=StoppingCriteriaList([StepSync()]))
        completions = trainer.xla_fsdp_session.whole(out[:, length:]).cpu()
        seconds = time.perf_counter() - start
        eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        completion_ids = []
        for row in completions.tolist():
            end = next((i for i, token in enumerate(row) if token in eos), len(row) - 1)
            completion_ids.append(row[:end + 1])
        if len(prompts) not in self._warm:
            self._warm.add(len(prompts))
            warm_completion_metrics(trainer, len(prompts))
        metrics = getattr(trainer, "_metrics", None)
        if isinstance(metrics, dict):
            mode = "train" if trainer.model.training else "eval"
            metrics[mode]["generation/tokens_per_second"].append(completions.numel() / seconds)
            metrics[mode]["generation/graphs_compiled"].append(float(_compiles() - compiled))
        return {"prompt_ids": [list(ids) for ids in prompt_ids], "completion_ids": completion_ids, "logprobs": None}


def install(trainer: Any) -> None:
    """Make ``trainer`` (a TRL trainer with a ``rollout_func`` seam, e.g. GRPO) generate in fixed shapes on XLA, unless
    the script gave its own ``rollout_func`` or uses vLLM."""
    if not hasattr(trainer, "rollout_func") or not hasattr(trainer, "max_completion_length"):
        return
    fix_shapes(trainer)
    if trainer.rollout_func is None and not getattr(trainer, "use_vllm", False):
        trainer.rollout_func = StaticShapeRollout()
