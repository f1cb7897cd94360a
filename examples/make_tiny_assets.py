"""Regenerate the bundled tiny corpus and tokenizer (already committed; run only to change them).

    python examples/make_tiny_assets.py

The corpus is made of simple templated English sentences (deterministic, seed 0), so a tiny model
learns it quickly; the tokenizer is a byte-level BPE with 512 tokens trained on it locally.
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = ["the cat", "a dog", "the old farmer", "my sister", "the small bird", "a young teacher", "the river",
            "our neighbour", "the red fox", "a tired student", "the baker", "the north wind"]
VERBS = ["sees", "likes", "follows", "paints", "finds", "carries", "watches", "helps", "remembers", "counts"]
OBJECTS = ["the green hill", "a wooden boat", "the quiet garden", "three apples", "the long road", "a paper kite",
           "the morning bread", "an empty house", "the bright moon", "seven stones", "the open window"]
PLACES = ["in the village", "near the sea", "after the rain", "before dinner", "every morning", "at the market",
          "under the bridge", "on a cold day"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(PLACES)}"
    return s[0].upper() + s[1:] + "."


def main() -> None:
    rng = random.Random(0)
    lines = [" ".join(sentence(rng) for _ in range(rng.randint(2, 4))) for _ in range(3000)]
    corpus = HERE / "data" / "tiny_corpus.txt"
    corpus.parent.mkdir(exist_ok=True)
    corpus.write_text("\n".join(lines) + "\n")

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=512, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(HERE / "tiny_tokenizer")
    print(f"wrote {corpus} ({len(lines)} lines) and {HERE / 'tiny_tokenizer'} (vocab {len(tok)})")


if __name__ == "__main__":
    main()
