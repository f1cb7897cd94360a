"""Named model shapes for planning and benchmarks: the one table of presets (configs only, never weights).

The Llama-2 entries copy the published ``config.json`` of ``meta-llama/Llama-2-{7b,13b,70b}-hf``; the ViT
entries follow PyTorch/XLA's FSDP ViT-10B example (48 blocks of width 4096, MLP 16384, 14 px patches).
"""

from __future__ import annotations

from typing import Any

_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
               architectures=["LlamaForCausalLM"])

#: preset name -> (transformers config class, its keyword arguments)
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2-7b": ("LlamaConfig", dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=32)),
    "llama-2-13b": ("LlamaConfig", dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                        num_attention_heads=40, num_key_value_heads=40)),
    "llama-2-70b": ("LlamaConfig", dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                        num_attention_heads=64, num_key_value_heads=8)),
    # 48 x 201M-parameter blocks = 9.7B, at 224 px with 14 px patches
    "vit-10b": ("ViTConfig", dict(hidden_size=4096, num_hidden_layers=48, num_attention_heads=32, intermediate_size=16384,
                                  image_size=224, patch_size=14, num_labels=1000,
                                  architectures=["ViTForImageClassification"])),
    "vit-1b": ("ViTConfig", dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, intermediate_size=8192,
                                 image_size=224, patch_size=14, num_labels=1000,
                                 architectures=["ViTForImageClassification"])),
    "vit-small": ("ViTConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                                    image_size=224, patch_size=16, num_labels=1000,
                                    architectures=["ViTForImageClassification"])),
    "vit-tiny": ("ViTConfig", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                                   image_size=32, patch_size=4, num_labels=1000,
                                   architectures=["ViTForImageClassification"])),
}


def preset_config(name: str, **overrides: Any) -> Any:
    """The ``PretrainedConfig`` of preset ``name`` (``overrides`` replace its fields)."""
    import transformers

    from ..errors import ConfigError

    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(MODEL_PRESETS)}")
    cls_name, kwargs = MODEL_PRESETS[name]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def is_preset(name: Any) -> bool:
    """True when ``name`` is a preset name."""
    return isinstance(name, str) and name in MODEL_PRESETS
