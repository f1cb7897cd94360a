"""What the post-training tests (TRL's DPO, GRPO and reward trainers) share: a word-level tokenizer and tiny datasets
made here, with no download.

The "language" is counting: a prompt ``up 3 4 5`` continues ``6 7 .``; ``down 9 8`` continues ``7 6 .``. A
preference pair prefers the right continuation to a wrong one, so DPO has a signal; GRPO's reward function scores how
many tokens of a completion continue the count. Test modules import it as ``from trl_helpers import ...`` (tests/ is
on sys.path); so do the scripts under tests/scripts/.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ["<pad>", ".", "<unk>", "up", "down", *(str(i) for i in range(20))]
#: a multiple of 8, so every tensor of the tiny models splits evenly over 1, 2, 4 or 8 devices
VOCAB_SIZE = 32


def tiny_tokenizer():
    """A word-level tokenizer over :data:`WORDS` (``.`` is end of sequence, ``<pad>`` padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=".", pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=64)


def _count(rng: random.Random) -> tuple[str, list[int], int]:
    step = rng.choice((1, -1))
    start = rng.randint(4, 15) if step > 0 else rng.randint(4, 15)
    length = rng.randint(2, 4)
    prompt = ["up" if step > 0 else "down", *(str(start + step * i) for i in range(length))]
    return " ".join(prompt), [start + step * i for i in range(length, length + 2)], step


def preference_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompt / chosen / rejected rows (the right next two numbers vs two wrong ones)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, nxt, _ = _count(rng)
        good = [x for x in nxt if 0 <= x < 20]
        bad = [rng.randint(0, 19) for _ in nxt]
        rows.append({"prompt": prompt, "chosen": " " + " ".join(map(str, good)),
                     "rejected": " " + " ".join(map(str, bad))})
    return rows


def prompt_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows of ``prompt`` only (GRPO), of varying lengths."""
    rng = random.Random(seed)
    return [{"prompt": _count(rng)[0]} for _ in range(n)]


def counting_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """GRPO reward: how many leading tokens of each completion continue its prompt's count, plus a tenth per number
    token (so that an untrained model's completions already differ in reward, and GRPO's advantages are not zero)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        words = prompt.split()
        step = 1 if words[0] == "up" else -1
        expected, score = int(words[-1]) + step, 0.0
        for token in completion.split():
            if token != str(expected):
                break
            score, expected = score + 1.0, expected + step
        rewards.append(score + 0.1 * sum(token.isdigit() for token in completion.split()))
    return rewards


def save_tiny_model(out: Path, family: str = "llama", seed: int = 0, classifier: bool = False) -> Path:
    """A randomly initialised tiny Llama or Qwen2 (seeded) with the tokenizer, saved as a from_pretrained directory;
    ``classifier``: the sequence classification model (one label: a reward model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

    tokenizer = tiny_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    if classifier:
        config.num_labels = 1
    torch.manual_seed(seed)
    model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
