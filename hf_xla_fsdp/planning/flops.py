"""Model FLOPs of training, per token: the numerator of model FLOPs utilization (MFU).

Per token of a training step, with ``N`` the parameters that take part in matrix multiplies, ``N_t`` those of them
that are trained, and ``L`` layers of ``H`` attention heads of size ``Q`` over sequences of ``T`` tokens:

    2 N (forward) + 2 N (backward, gradients of the activations) + 2 N_t (backward, gradients of the weights)
    + 12 L H Q T (attention scores and their weighted sum: 4 L H Q T forward, twice that backward)

With every parameter trained this is ``6 N + 12 L H Q T``, the formula of PaLM (Chowdhery et al. 2022,
"PaLM: Scaling Language Modeling with Pathways", appendix B, "Model FLOPs utilization"), which MaxText's and
torchtitan's MFU use as well. Conventions: model FLOPs, not hardware FLOPs (activation checkpointing's
recomputation is not counted, so MFU does not reward it); the attention term counts the full ``T x T`` score
matrix (no causal-mask discount, as PaLM); ``N`` leaves out the input embedding table, a lookup (a tied table is
counted, as the output layer's matrix multiply); the small elementwise work (norms, activations, softmax,
the optimizer) is left out. For a LoRA run ``N_t`` is the adapters: ``4 N + 2 N_t`` per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

#: where the formula comes from, for reports and docs
SOURCE = "PaLM (Chowdhery et al. 2022), appendix B: 6N + 12LHQT per token"


@dataclass(frozen=True)
class ModelFlops:
    """What a model's training FLOPs per token depend on (see the module docstring)."""

    matmul_params: int  # N
    trained_params: int  # N_t (of N)
    layers: int  # L
    heads: int  # H
    head_dim: int  # Q

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a batch whose sequences are ``seq_len`` tokens long."""
        return (4 * self.matmul_params + 2 * self.trained_params
                + 12 * self.layers * self.heads * self.head_dim * seq_len)


def attention_dims(config: Any) -> Optional[tuple[int, int, int]]:
    """``(layers, heads, head_dim)`` of a transformer config, None when it names no attention layout."""
    def get(*names: str) -> Optional[int]:
        return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), None)

    layers, heads = get("num_hidden_layers", "n_layer", "num_layers"), get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd", "d_model")
    if not (layers and heads and hidden):
        return None
    return layers, heads, get("head_dim") or hidden // heads


def matmul_params(model: nn.Module) -> int:
    """Parameters of ``model`` that take part in matrix multiplies: every distinct parameter but the input
    embedding table when the output layer does not share it. ``model`` holds whole parameters (a plain or a
    ``meta`` model, not a sharded one)."""
    params = {id(p): p.numel() for p in model.parameters()}
    total = sum(params.values())
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table = getattr(embeddings, "weight", None)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if table is not None and getattr(output, "weight", None) is not table:
        total -= table.numel()
    return total


def model_flops(config: Any, trained_fraction: float = 1.0) -> Optional[ModelFlops]:
    """The :class:`ModelFlops` of the model ``config`` describes, from its skeleton on ``meta`` (no memory, about a
    second for a 7B model); ``trained_fraction`` of its parameters are trained. None for a model without a
    transformer attention layout."""
    from ..modeling.meta_init import build_skeleton, resolve_source

    dims = attention_dims(config)
    if dims is None:
        return None
    model = build_skeleton(resolve_source(config), record_init=False).model
    n = matmul_params(model)
    return ModelFlops(n, round(n * trained_fraction), *dims)


def flops_from_counts(config: Any, total_params: int) -> Optional[ModelFlops]:
    """:class:`ModelFlops` from a config and the model's distinct parameter count (the planner's skeleton count),
    every parameter trained: the input embedding table (``vocab_size x hidden``) is left out unless tied."""
    dims = attention_dims(config)
    if dims is None:
        return None
    vocab, hidden = getattr(config, "vocab_size", None), getattr(config, "hidden_size", None) or getattr(
        config, "n_embd", None)
    tied = getattr(config, "tie_word_embeddings", True)
    n = total_params - (int(vocab) * int(hidden) if vocab and hidden and not tied else 0)
    return ModelFlops(n, n, *dims)


#: the MFU band ``hf-xla-fsdp plan --tpu`` turns into expected tokens per second per chip. An assumption, not a
#: measurement: 45 % is what MaxText publishes for a tuned Llama 3.1 8B run on v6e-256 (7,207 tokens/s/chip); 20 %
#: is taken as what a first, untuned run may reach. A run's own figure is its logged ``mfu_percent``.
MFU_BAND = (0.20, 0.45)


def expected_tokens_per_second(flops: ModelFlops, seq_len: int, peak_flops: float,
                               band: tuple[float, float] = MFU_BAND) -> dict[str, Any]:
    """Tokens per second per chip at each end of ``band`` (MFU x peak FLOP/s / FLOPs per token), with what it rests on."""
    per_token = flops.per_token(seq_len)
    low, high = (round(mfu * peak_flops / per_token, 1) for mfu in band)
    return {"tokens_per_second_per_chip": [low, high], "mfu_band": list(band), "flops_per_token": per_token,
            "peak_bf16_flops_per_chip": peak_flops, "formula": SOURCE,
            "how": "MFU x peak bf16 FLOP/s / model FLOPs per token, for an MFU band (an assumption: 45 % is MaxText's "
                   "published Llama 3.1 8B on v6e-256, 20 % a first untuned run); compare with a run's mfu_percent"}


__all__ = ["MFU_BAND", "SOURCE", "ModelFlops", "attention_dims", "expected_tokens_per_second", "flops_from_counts",
           "matmul_params", "model_flops"]
