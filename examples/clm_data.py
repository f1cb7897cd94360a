"""The causal-LM data pipeline shared by the examples (transformers' run_clm: tokenize, then group into blocks)."""

from __future__ import annotations

from itertools import chain
from typing import Any

from datasets import load_dataset


def build_datasets(train_file: str, tokenizer: Any, *, block_size: int = 64, validation_split_percentage: int = 5,
                   seed: int = 0, validation_file: str | None = None) -> tuple[Any, Any]:
    """Train / validation sets of ``block_size``-token blocks (``labels`` = ``input_ids``) from local text files.

    Without ``validation_file`` the validation set is ``validation_split_percentage`` % of the lines
    of ``train_file``. The train set is shuffled with ``seed``.
    """
    if validation_file:
        raw = load_dataset("text", data_files={"train": train_file, "test": validation_file})
        split = {"train": raw["train"], "test": raw["test"]}
    else:
        raw = load_dataset("text", data_files={"train": train_file})["train"]
        split = raw.train_test_split(test_size=validation_split_percentage / 100, seed=seed, shuffle=True)

    def tokenize(batch: dict[str, list]) -> Any:
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    def group(batch: dict[str, list]) -> dict[str, list]:
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = len(joined["input_ids"]) // block_size * block_size
        out = {k: [v[i:i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    blocks = {}
    for name, ds in (("train", split["train"]), ("validation", split["test"])):
        ds = ds.map(tokenize, batched=True, remove_columns=["text"], desc=f"tokenize {name}")
        blocks[name] = ds.map(group, batched=True, desc=f"group {name}")
    return blocks["train"].shuffle(seed=seed), blocks["validation"]
