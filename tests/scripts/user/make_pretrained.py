"""Build the local "pretrained" inputs that tests/scripts/user/clm_no_trainer.py is run on (no network).

    python tests/scripts/user/make_pretrained.py OUT_DIR

Writes OUT_DIR/train.txt and OUT_DIR/validation.txt (a deterministic English-like corpus), a byte-level
BPE tokenizer trained on it, and two tiny models saved with ``save_pretrained``, each with the
tokenizer next to it, so ``AutoConfig/AutoTokenizer/AutoModelForCausalLM.from_pretrained(dir)`` work
exactly as they would on a downloaded checkpoint:

- OUT_DIR/gpt2:  GPT-2, tied input/output embeddings;
- OUT_DIR/llama: Llama with grouped-query attention (4 query heads, 2 key/value heads), untied head.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

# building on the host only: keep transformers from importing torch_xla (and its runtime) for nothing
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

SPECIAL = "<|endoftext|>"
TRAIN_LINES = 2000
VALIDATION_LINES = 80
VOCAB_SIZE = 512

SUBJECTS = ["the miller", "a grey cat", "the old sailor", "my brother", "the little owl", "a quiet student",
            "the shepherd", "our teacher", "the brown horse", "a young painter", "the fisherman", "the west wind"]
VERBS = ["carries", "finds", "watches", "builds", "mends", "follows", "remembers", "draws", "opens", "cleans"]
OBJECTS = ["a heavy basket", "the wooden gate", "two silver spoons", "the narrow bridge", "a blue lantern",
           "the broken fence", "an old map", "the tall ladder", "five white shells", "the kitchen door"]
PLACES = ["by the river", "in the morning", "after the storm", "near the mill", "before supper",
          "on the hill", "at the harbour", "under the trees"]


def sentence(rng: random.Random) -> str:
    """One templated sentence: subject, verb, object and sometimes a place."""
    words = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        words += f" {rng.choice(PLACES)}"
    return words[0].upper() + words[1:] + "."


def corpus_lines(rng: random.Random, n_lines: int) -> list[str]:
    """``n_lines`` lines of two to four sentences each."""
    return [" ".join(sentence(rng) for _ in range(rng.randint(2, 4))) for _ in range(n_lines)]


def write_corpus(out: Path) -> tuple[Path, Path]:
    """train.txt and validation.txt from one seeded generator (validation continues the same stream)."""
    rng = random.Random(0)
    train, validation = out / "train.txt", out / "validation.txt"
    train.write_text("\n".join(corpus_lines(rng, TRAIN_LINES)) + "\n")
    validation.write_text("\n".join(corpus_lines(rng, VALIDATION_LINES)) + "\n")
    return train, validation


def train_tokenizer(train_file: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on ``train_file``, wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(train_file)], vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[SPECIAL], show_progress=False)
    # a round trip through tokenizer.json gives a plain `tokenizers.Tokenizer`, what from_pretrained reloads
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        bpe.save(str(path))
        return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=SPECIAL, eos_token=SPECIAL,
                                       unk_token=SPECIAL, pad_token=SPECIAL, model_max_length=128)


def gpt2_config(tokenizer: PreTrainedTokenizerFast) -> GPT2Config:
    """Tiny GPT-2 with tied embeddings."""
    eos = tokenizer.eos_token_id
    # dropout off: a resumed run must reproduce the uninterrupted run's losses step for step
    return GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128,
                      bos_token_id=eos, eos_token_id=eos, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def llama_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """Tiny Llama with grouped-query attention and an untied LM head."""
    eos = tokenizer.eos_token_id
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)


def save_model(config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast, out: Path, seed: int) -> Path:
    """Randomly initialised weights (seeded), saved with the tokenizer as a from_pretrained directory."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    train, _ = write_corpus(out)
    tokenizer = train_tokenizer(train)
    for name, config in (("gpt2", gpt2_config(tokenizer)), ("llama", llama_config(tokenizer))):
        path = save_model(config, tokenizer, out / name, seed=0)
        print(f"wrote {path} ({config.model_type}, vocab {config.vocab_size})")
    print(f"wrote {out / 'train.txt'} and {out / 'validation.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
