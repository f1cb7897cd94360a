"""Bucketed batch lengths (pad_to_buckets), the one-line report of a new graph after warm-up, and the settings of
both and of the compilation cache."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.session import shapes
from hf_xla_fsdp.session.shapes import BucketPadder, RecompileWatch, bucket_length, bucket_lengths, pad_batch, signature


def word_tokenizer(padding_side: str = "right"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(126)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", padding_side=padding_side)


def features(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": (torch.randint(2, 128, (n,), generator=gen)).tolist()} for n in lengths]


# ----------------------------------------------------------------------------- bucket lengths
def test_bucket_lengths_powers_of_two_multiples_and_lists():
    assert [bucket_length(n, True) for n in (1, 63, 64, 65, 200, 513)] == [64, 64, 64, 128, 256, 1024]
    assert bucket_length(300, True, cap=400) == 400  # cut to the model's longest sequence
    assert bucket_length(500, True, cap=400) == 512  # already too long: the model reports it
    assert [bucket_length(n, 64) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]
    assert [bucket_length(n, [128, 256]) for n in (5, 128, 200, 300)] == [128, 128, 256, 512]
    assert bucket_length(37, False) == 37
    assert bucket_lengths(True, 2048) == [64, 128, 256, 512, 1024, 2048]  # 6 graphs at most for any text


@pytest.mark.parametrize("value, parsed", [(True, True), ("false", False), ("none", False), (0, False), ("64", 64),
                                           (128, 128), ("256,128", [128, 256]), ([512, 64], [64, 512])])
def test_pad_to_buckets_spellings(value, parsed):
    assert XlaFsdpPlugin(pad_to_buckets=value).pad_to_buckets == parsed


@pytest.mark.parametrize("value", [3, "sometimes", [64, "x"], -8])
def test_bad_pad_to_buckets_is_one_line(value):
    with pytest.raises(ConfigError, match=r"pad_to_buckets=.* use true \(powers of two\), false, a multiple"):
        XlaFsdpPlugin(pad_to_buckets=value)


def test_cache_dir_spellings_and_config_sources(tmp_path):
    assert XlaFsdpPlugin().compilation_cache_dir == "auto"
    for off in (None, "", False, "none", "false"):
        assert XlaFsdpPlugin(compilation_cache_dir=off).compilation_cache_dir is None
    assert XlaFsdpPlugin(compilation_cache_dir="~/c").compilation_cache_dir.endswith("/c")
    with pytest.raises(ConfigError, match="compilation cache needs a local or mounted folder, not a URL"):
        XlaFsdpPlugin(compilation_cache_dir="gs://bucket/cache")
    plugin = XlaFsdpPlugin.from_fsdp_config({"xla": True, "compilation_cache_dir": str(tmp_path), "pad_to_buckets": 64})
    assert (plugin.compilation_cache_dir, plugin.pad_to_buckets) == (str(tmp_path), 64)
    yaml = tmp_path / "acc.yaml"
    yaml.write_text("distributed_type: XLA\nfsdp_config:\n  fsdp_compilation_cache_dir: none\n  fsdp_pad_to_buckets: false\n")
    plugin = XlaFsdpPlugin.from_accelerate_config(yaml)
    assert (plugin.compilation_cache_dir, plugin.pad_to_buckets) == (None, False)


# ----------------------------------------------------------------------------- padding
@pytest.mark.parametrize("side", ["right", "left"])
def test_stock_collator_batches_are_padded_with_pad_ids_masked_and_ignored_labels(side):
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer(side)
    stock = DataCollatorForLanguageModeling(tok, mlm=False)
    feats = features([5, 70, 33])
    plain = stock(feats)
    padded = BucketPadder(stock, True)(feats)
    assert type(padded) is type(plain) and plain["input_ids"].shape == (3, 70)
    assert {k: tuple(v.shape) for k, v in padded.items()} == {k: (3, 128) for k in ("input_ids", "attention_mask",
                                                                                     "labels")}
    real = slice(0, 70) if side == "right" else slice(58, 128)
    pads = slice(70, 128) if side == "right" else slice(0, 58)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(padded[key][:, real], plain[key]), key
    assert (padded["input_ids"][:, pads] == tok.pad_token_id).all()
    assert (padded["attention_mask"][:, pads] == 0).all() and (padded["labels"][:, pads] == -100).all()


def test_padding_reads_the_pad_id_through_the_trainers_column_remover_and_from_the_model_config():
    from transformers import DataCollatorForLanguageModeling, LlamaConfig
    from transformers.trainer_utils import RemoveColumnsCollator

    stock = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)
    wrapped = RemoveColumnsCollator(stock, ["input_ids"], logger=logging.getLogger("t"))
    assert BucketPadder(wrapped, 64)(features([3, 4]))["input_ids"].shape == (2, 64)

    def collate(feats):  # no tokenizer anywhere: the model config's pad token
        return {"input_ids": torch.tensor([f["input_ids"] for f in feats])}

    class Model(torch.nn.Module):
        config = LlamaConfig(pad_token_id=7, max_position_embeddings=100)

    batch = BucketPadder(collate, True, models=lambda: [Model()])(features([90, 90]))
    assert batch["input_ids"].shape == (2, 100)  # the next power of two (128) cut to the model's 100 positions
    assert (batch["input_ids"][:, 90:] == 7).all() and batch["attention_mask"][:, 90:].sum() == 0
    assert batch["attention_mask"][:, :90].all()  # added: padded and unpadded batches share one graph


def test_pad_batch_without_a_pad_id_or_with_an_unknown_per_token_key_is_one_line():
    ids = torch.ones(2, 10, dtype=torch.long)
    with pytest.raises(ConfigError, match="pad_to_buckets needs a pad token id to pad input_ids: set tokenizer.pad_token"):
        pad_batch({"input_ids": ids}, True, pad_token_id=None)
    with pytest.raises(ConfigError, match="pad_to_buckets cannot pad the batch's 'weights'"):
        pad_batch({"input_ids": ids, "weights": torch.ones(2, 10)}, True, pad_token_id=0)
    same = pad_batch({"input_ids": torch.ones(2, 64, dtype=torch.long)}, True, pad_token_id=None)
    assert same["input_ids"].shape == (2, 64)  # nothing to pad: no pad token needed


@pytest.mark.parametrize("side", ["right", "left"])
def test_bucketed_batch_gives_the_same_loss_and_per_example_losses(side):
    """A causal LM on the padded batch: the loss and each example's mean token loss equal the unpadded batch's
    within 2e-5 (float32; padding is masked in attention and ignored in the labels)."""
    from helpers import tiny_llama
    from transformers import DataCollatorForLanguageModeling, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(max_position_embeddings=128)).eval()
    stock = DataCollatorForLanguageModeling(word_tokenizer(side), mlm=False)
    feats = features([9, 41, 23], seed=1)

    def per_example(batch):
        out = model(**batch)
        logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
        token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
        counted = (labels != -100).sum(1)
        return out.loss, token.sum(1) / counted

    with torch.no_grad():
        loss, each = per_example(stock(feats))
        padded = BucketPadder(stock, True)(feats)
        assert padded["input_ids"].shape == (3, 64)
        loss_b, each_b = per_example(padded)
    if side == "right":
        assert loss_b.item() == pytest.approx(loss.item(), abs=2e-5)
        assert torch.allclose(each_b, each, atol=2e-5), (each_b - each).abs().max()
    else:
        # left padding: a causal LM's shifted loss predicts a row's first token from the pad before it, as the stock
        # collator's left padding already does for every row shorter than the longest; those rows are unchanged, and
        # the longest one gains exactly that one prediction
        longest = 1
        shorter = [0, 2]
        assert torch.allclose(each_b[shorter], each[shorter], atol=2e-5), (each_b - each).abs().max()
        assert not torch.isclose(each_b[longest], each[longest], atol=2e-5)


def test_loader_collate_fn_is_wrapped_once_and_stays_picklable():
    import pickle

    from transformers import DataCollatorForLanguageModeling

    loader = torch.utils.data.DataLoader(features([5, 9, 70, 3]), batch_size=2,
                                         collate_fn=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    shapes.pad_loader(loader, True)
    shapes.pad_loader(loader, True)
    assert isinstance(loader.collate_fn, BucketPadder) and not isinstance(loader.collate_fn.collate_fn, BucketPadder)
    assert [b["input_ids"].shape[1] for b in loader] == [64, 128]
    assert pickle.loads(pickle.dumps(loader.collate_fn))(features([3]))["input_ids"].shape == (1, 64)
    off = torch.utils.data.DataLoader(features([5]), collate_fn=loader.collate_fn.collate_fn)
    assert shapes.pad_loader(off, False).collate_fn is loader.collate_fn.collate_fn


# ----------------------------------------------------------------------------- new graphs after warm-up
def sig(length, batch=4):
    return signature({"input_ids": torch.zeros(batch, length, dtype=torch.long),
                      "attention_mask": torch.zeros(batch, length, dtype=torch.long)})


def test_a_new_shape_after_warm_up_is_one_line_with_step_change_and_fix(caplog):
    watch = RecompileWatch(False, step=lambda: 7)
    with caplog.at_level(logging.INFO, logger="hf_xla_fsdp.session.shapes"):
        for length in (10, 20, 30):  # warm-up: compiles are expected
            watch.stepped(sig(length), 2)
        watch.stepped(sig(20), 0)  # seen before, nothing compiled
        watch.stepped(sig(20), 1)  # a compile with known inputs (e.g. the Trainer's logging): not a shape problem
        assert caplog.records == []
        watch.stepped(sig(45), 2)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert record.getMessage() == (
        "step 7 (batch 6 of this data loader) compiled a new XLA graph after warm-up: input_ids (4, 20) -> (4, 45), "
        "attention_mask (4, 20) -> (4, 45); fix: set pad_to_buckets: true (off here), or pad every batch to a few fixed "
        "lengths yourself (the tokenizer's padding='max_length' with a max_length, or the collator's "
        "pad_to_multiple_of=64)")


def test_with_buckets_a_new_bucket_is_info_and_a_smaller_last_batch_names_drop_last(caplog):
    watch = RecompileWatch(True, warmup=1)
    with caplog.at_level(logging.INFO, logger="hf_xla_fsdp.session.shapes"):
        watch.stepped(sig(64), 1)
        watch.stepped(sig(128), 1)
        watch.stepped(sig(128, batch=3), 1)
    info, warning = caplog.records
    assert info.levelno == logging.INFO and "a bucket length not seen before" in info.getMessage()
    assert warning.levelno == logging.WARNING and "input_ids (4, 128) -> (3, 128)" in warning.getMessage()
    assert "dataloader_drop_last=True" in warning.getMessage()


def test_reports_stop_after_a_few_lines(caplog):
    watch = RecompileWatch(False, warmup=0)
    with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp.session.shapes"):
        for length in range(1, 20):
            watch.stepped(sig(length), 1)
    assert len(caplog.records) == shapes.MAX_REPORTS and watch.new_graphs == 19
    assert caplog.records[-1].getMessage().endswith("later new graphs of this data loader are not logged")


def test_a_watched_loader_keeps_its_class_and_counts_compiles_per_batch(monkeypatch):
    counts = iter([0, 0, 3, 3, 5])  # compile_count at the start and after each next()
    monkeypatch.setattr(shapes, "compile_count", lambda: next(counts))
    seen = []

    class Watch(RecompileWatch):
        def stepped(self, s, compiled):
            seen.append((s[0][1], compiled))

    loader = torch.utils.data.DataLoader([torch.zeros(2)] * 3, batch_size=1)
    assert shapes.watch_loader(loader, Watch(False)) is loader and isinstance(loader, torch.utils.data.DataLoader)
    assert len(list(loader)) == 3
    # the compiles found while fetching a batch belong to the step of the batch before; the last one's at the end
    assert seen == [((1, 2), 3), ((1, 2), 0), ((1, 2), 2)]


def test_default_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    from hf_xla_fsdp.session.compile_cache import ENV_CACHE, default_dir

    monkeypatch.setenv(ENV_CACHE, "none")
    assert default_dir() is None
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "c"))
    assert default_dir() == str(tmp_path / "c")
    monkeypatch.delenv(ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == str(tmp_path / "hf_xla_fsdp" / "xla_cache")


def test_without_a_pad_token_input_ids_are_padded_with_eos_or_0_under_a_zero_mask():
    """GPT-2 / Llama tokenizers have no pad token: the padded positions' id is hidden by the 0 mask and -100 labels."""
    from transformers import GPT2Config

    def collate(feats):  # fixed-length blocks, as run_clm's default_data_collator gives them
        ids = torch.tensor([f["input_ids"] for f in feats])
        return {"input_ids": ids, "labels": ids.clone()}

    batch = BucketPadder(collate, True)(features([24, 24]))  # no tokenizer, no model: 0
    assert batch["input_ids"].shape == (2, 64) and (batch["input_ids"][:, 24:] == 0).all()
    assert (batch["labels"][:, 24:] == -100).all() and batch["attention_mask"][:, 24:].sum() == 0

    class Model(torch.nn.Module):
        config = GPT2Config(eos_token_id=9, n_positions=50)

    batch = BucketPadder(collate, True, models=lambda: [Model()])(features([24, 24]))
    assert batch["input_ids"].shape == (2, 50) and (batch["input_ids"][:, 24:] == 9).all()  # the model's eos id
    tok = word_tokenizer()
    tok.pad_token, tok.eos_token = None, "w5"

    class Blocks:  # a collator with a tokenizer that has no pad token (GPT-2's): its eos id
        tokenizer = tok

        def __call__(self, feats):
            return collate(feats)

    batch = BucketPadder(Blocks(), True)(features([24, 24]))
    assert (batch["input_ids"][:, 24:] == tok.eos_token_id).all() and (batch["labels"][:, 24:] == -100).all()


def test_a_refusal_in_the_loader_thread_is_raised_in_the_training_thread(monkeypatch):
    monkeypatch.setattr(shapes, "compile_count", lambda: 0)
    errors: list = []

    def collate(feats):
        ids = torch.tensor([f["input_ids"] for f in feats])
        return {"weights": torch.ones(ids.shape), "input_ids": ids}

    loader = torch.utils.data.DataLoader(features([5, 5]), batch_size=2, collate_fn=collate)
    shapes.pad_loader(loader, True, errors=errors)
    batch = next(iter(loader))  # the collator itself never raises (a loader thread would lose the error) ...
    assert batch["input_ids"].shape == (2, 5) and len(errors) == 1
    shapes.watch_loader(loader, RecompileWatch(True, errors=errors))
    with pytest.raises(ConfigError, match="pad_to_buckets cannot pad the batch's 'weights'"):
        list(loader)  # ... the watched loader raises it where the training loop runs


@pytest.mark.parametrize("kind", ["torch_xla", "accelerate"])
@pytest.mark.xla
def test_a_failure_of_the_host_loader_in_the_device_loaders_thread_is_raised_not_taken_for_the_end_of_data(kind):
    # torch_xla's device loader reads the host loader in a thread; an exception there ended the data silently
    # (a Trainer trained 0 steps and exited 0, e.g. with a pinned DataLoader under a renamed PrivateUse1 backend)
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    from hf_xla_fsdp.runtime import xla_device

    class Failing(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict:
            if i == 5:
                raise RuntimeError("row 5 is unreadable")
            return {"input_ids": torch.tensor([i, i])}

    if kind == "accelerate":  # what accelerator.prepare gives on XLA (its DataLoaderShard's __class__ is read-only)
        from accelerate.data_loader import DataLoaderShard, MpDeviceLoaderWrapper

        host = DataLoaderShard(Failing(), batch_size=2)
        loader = MpDeviceLoaderWrapper(host, xla_device())
    else:
        host = torch.utils.data.DataLoader(Failing(), batch_size=2)
        loader = MpDeviceLoader(host, xla_device())
    shapes.watch_loader(loader, RecompileWatch(False))
    for _ in range(2):  # every epoch
        seen = []
        with pytest.raises(RuntimeError, match="row 5 is unreadable"):
            for batch in loader:
                seen.append(batch["input_ids"].shape[0])
        # the batches read before the failure were used (accelerate's loader reads one batch ahead)
        assert seen == ([2] if kind == "accelerate" else [2, 2])
    assert loader._loader is host and len(loader) == 4  # the user's loader, unchanged
