"""Bucketed batch lengths (pad_to_buckets), the one-line report of a new graph after warm-up, and the settings of
both and of the compilation cache."""

from __future__ import annotations

import inspect
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
    padded = BucketPadder(stock, True, keep_first=False)(feats)
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
    assert BucketPadder(wrapped, 64, keep_first=False)(features([3, 4]))["input_ids"].shape == (2, 64)

    def collate(feats):  # no tokenizer anywhere: the model config's pad token
        return {"input_ids": torch.tensor([f["input_ids"] for f in feats])}

    class Model(torch.nn.Module):
        config = LlamaConfig(pad_token_id=7, max_position_embeddings=100)

    batch = BucketPadder(collate, True, models=lambda: [Model()], keep_first=False)(features([90, 90]))
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
        padded = BucketPadder(stock, True, keep_first=False)(feats)
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

    batch = BucketPadder(collate, True, keep_first=False)(features([24, 24]))  # no tokenizer, no model: 0
    assert batch["input_ids"].shape == (2, 64) and (batch["input_ids"][:, 24:] == 0).all()
    assert (batch["labels"][:, 24:] == -100).all() and batch["attention_mask"][:, 24:].sum() == 0

    class Model(torch.nn.Module):
        config = GPT2Config(eos_token_id=9, n_positions=50)

    batch = BucketPadder(collate, True, models=lambda: [Model()], keep_first=False)(features([24, 24]))
    assert batch["input_ids"].shape == (2, 50) and (batch["input_ids"][:, 24:] == 9).all()  # the model's eos id
    tok = word_tokenizer()
    tok.pad_token, tok.eos_token = None, "w5"

    class Blocks:  # a collator with a tokenizer that has no pad token (GPT-2's): its eos id
        tokenizer = tok

        def __call__(self, feats):
            return collate(feats)

    batch = BucketPadder(Blocks(), True, keep_first=False)(features([24, 24]))
    assert (batch["input_ids"][:, 24:] == tok.eos_token_id).all() and (batch["labels"][:, 24:] == -100).all()


def test_a_field_without_a_known_padding_leaves_its_batches_unpadded_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(shapes, "compile_count", lambda: 0)
    monkeypatch.setattr(shapes, "_WARNED", set())

    def collate(feats):
        ids = torch.tensor([f["input_ids"] for f in feats])
        return {"weights": torch.ones(ids.shape), "input_ids": ids}

    loader = torch.utils.data.DataLoader(features([5, 5, 7, 7, 9, 9]), batch_size=2, collate_fn=collate)
    shapes.pad_loader(loader, True, errors=(errors := []))
    shapes.watch_loader(loader, RecompileWatch(True, errors=errors))
    with caplog.at_level(logging.WARNING, logger=shapes.__name__):
        lengths = [b["input_ids"].shape[1] for b in loader]  # never an error, in any thread
    assert lengths == [5, 7, 9] and not errors  # as the collator made them
    warned = [r.getMessage() for r in caplog.records if "pad_to_buckets" in r.getMessage()]
    assert len(warned) == 1 and "'weights' unpadded" in warned[0] and "compiles the training step again" in warned[0]


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


# ----------------------------------------------------------------------------- every collator of the HF stack
# For each collator transformers and TRL ship, a batch it makes and the same batch bucketed give the same loss: float32
# on the CPU, the padding hidden by the attention mask (or, for padding-free batches, a sequence of its own after the
# last), -100 labels or a causal mask; the difference is summation order in the longer rows only (1e-5 covers it: the
# losses are ~5 and differ by < 1e-6 here). Padding-free batches also keep every real token's logits.
LOSS_TOLERANCE = 1e-5


def _llama():
    from helpers import tiny_llama
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama(max_position_embeddings=256)).eval()


def _same_loss(model, batch, padded, *, logits_of_real_tokens=False):
    with torch.no_grad():
        out, out_b = model(**batch), model(**padded)
    assert out_b.loss.item() == pytest.approx(out.loss.item(), abs=LOSS_TOLERANCE)
    if logits_of_real_tokens:
        n = batch["input_ids"].shape[1]
        assert torch.allclose(out_b.logits[:, :n], out.logits, atol=LOSS_TOLERANCE), \
            (out_b.logits[:, :n] - out.logits).abs().max()


def test_transformers_mlm_collator_pads_and_keeps_the_loss():
    from helpers import tiny_bert
    from transformers import BertForMaskedLM, DataCollatorForLanguageModeling

    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_bert()).eval()
    tok = word_tokenizer()
    tok.mask_token = "w125"
    stock = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3, seed=0)
    batch = stock(features([9, 30, 17], seed=2))
    padded = pad_batch(batch, True, pad_token_id=0)
    assert padded["input_ids"].shape == (3, 64) and (padded["labels"][:, 30:] == -100).all()
    _same_loss(model, batch, padded)


def test_transformers_padding_collator_with_token_type_ids_and_sequence_labels():
    from helpers import tiny_bert
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert(num_labels=3)).eval()
    feats = [{**f, "token_type_ids": [0] * 4 + [1] * (len(f["input_ids"]) - 4), "labels": i % 3}
             for i, f in enumerate(features([9, 30, 17], seed=3))]
    batch = DataCollatorWithPadding(word_tokenizer())(feats)
    padded = BucketPadder(DataCollatorWithPadding(word_tokenizer()), True, keep_first=False)(feats)
    assert padded["token_type_ids"].shape == (3, 64) and (padded["token_type_ids"][:, 30:] == 0).all()
    assert padded["labels"].shape == (3,)  # one label per example: not a per-token field
    _same_loss(model, batch, padded)


def test_transformers_seq2seq_collator_pads_inputs_labels_and_decoder_inputs():
    from transformers import DataCollatorForSeq2Seq, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_heads=4, pad_token_id=0, decoder_start_token_id=0)).eval()
    feats = [{"input_ids": f["input_ids"], "labels": g["input_ids"]}
             for f, g in zip(features([9, 30, 17], seed=4), features([5, 12, 3], seed=5))]
    stock = DataCollatorForSeq2Seq(word_tokenizer(), model=model)
    batch = stock(feats)
    padded = BucketPadder(stock, True, keep_first=False)(feats)
    assert {k: tuple(v.shape) for k, v in padded.items()} == {
        "input_ids": (3, 64), "attention_mask": (3, 64), "labels": (3, 64), "decoder_input_ids": (3, 64)}
    assert (padded["decoder_input_ids"][:, 12:] == 0).all() and (padded["labels"][:, 12:] == -100).all()
    _same_loss(model, batch, padded)


def test_transformers_flattening_collator_pads_a_sequence_of_its_own():
    from transformers import DataCollatorWithFlattening

    stock = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    batch = stock(features([9, 30, 17], seed=6))  # 56 tokens in one row, positions restarting, no attention mask
    padded = BucketPadder(stock, True, keep_first=False)(features([9, 30, 17], seed=6))
    assert "attention_mask" not in padded  # a mask would hide the sequence boundaries from the model
    assert padded["input_ids"].shape == (1, 64)
    assert padded["position_ids"][0, 56:].tolist() == list(range(8))
    assert padded["seq_idx"][0, 56:].tolist() == [3] * 8 and padded["seq_idx"].dtype == batch["seq_idx"].dtype
    # the padding ends one more sequence; the entry count goes to 64 with empty sequences (a bounded shape)
    assert padded["cu_seq_lens_q"].tolist() == [0, 9, 39, 56] + [64] * 60 and padded["max_length_q"] == 30
    _same_loss(_llama(), {k: v for k, v in batch.items() if not k.startswith(("cu_", "max_", "seq_"))},
               {k: v for k, v in padded.items() if not k.startswith(("cu_", "max_", "seq_"))},
               logits_of_real_tokens=True)


@pytest.mark.parametrize("mode", ["packing", "padding_free", "padded", "padded_position_ids"])
def test_trl_sft_collator_batches_pad_and_keep_the_loss(mode):
    """TRL's SFT collator: packing (bfd: padding-free rows of packed sequences), padding_free, and padded batches
    with and without position_ids."""
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    feats = features([9, 30, 17, 12], seed=7)
    if mode == "packing":  # what TRL's bfd packing makes: rows of several sequences, with their lengths
        feats = [{"input_ids": feats[0]["input_ids"] + feats[1]["input_ids"], "seq_lengths": [9, 30]},
                 {"input_ids": feats[2]["input_ids"] + feats[3]["input_ids"], "seq_lengths": [17, 12]}]
    kwargs = {"pad_token_id": 0, "padding_free": mode in ("packing", "padding_free")}
    if mode == "padded_position_ids":
        if "return_position_ids" not in inspect.signature(DataCollatorForLanguageModeling).parameters:
            pytest.skip("this TRL's collator has no return_position_ids (TRL 1.0 gives position ids padding-free only)")
        kwargs["return_position_ids"] = True
    stock = DataCollatorForLanguageModeling(**kwargs)
    batch = stock(feats)
    padded = BucketPadder(stock, True, keep_first=False)(feats)
    length = padded["input_ids"].shape[1]
    assert length == 128 if mode in ("packing", "padding_free") else length == 64
    if mode in ("packing", "padding_free"):
        assert "attention_mask" not in padded and padded["position_ids"].shape == (1, length)
    if "cu_seq_lens_k" in batch:  # newer TRL adds the flash-attention fields (TRL 1.0 only position_ids)
        assert padded["cu_seq_lens_k"][-1] == length
        assert padded["cu_seq_lens_k"].shape == (64,) and padded["cu_seq_lens_k"].dtype == torch.int32
        assert padded["seq_idx"][0, -1] == batch["seq_idx"][0, -1] + 1
    model = _llama()
    model_inputs = ("input_ids", "labels", "attention_mask", "position_ids")
    _same_loss(model, {k: v for k, v in batch.items() if k in model_inputs},
               {k: v for k, v in padded.items() if k in model_inputs}, logits_of_real_tokens=True)


def test_per_token_masks_of_trl_and_transformers_pad_with_their_neutral_value():
    ids = torch.ones(2, 10, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids),
             "assistant_masks": torch.ones_like(ids), "special_tokens_mask": torch.zeros_like(ids),
             "mm_token_type_ids": torch.ones_like(ids), "decoder_attention_mask": torch.ones(2, 5, dtype=torch.long)}
    padded = pad_batch(batch, True, pad_token_id=0)
    for key, fill in (("completion_mask", 0), ("assistant_masks", 0), ("special_tokens_mask", 1),
                      ("mm_token_type_ids", 0), ("attention_mask", 0)):
        assert padded[key].shape == (2, 64) and (padded[key][:, 10:] == fill).all(), key
    assert padded["decoder_attention_mask"].shape == (2, 64) and padded["decoder_attention_mask"][:, 5:].sum() == 0


def test_batches_of_a_fixed_length_pass_untouched():
    """run_clm's blocks (default_data_collator), padding to max_length, TRL's wrapped packing: a loader over rows of
    one length gives the collator's own batches, never padded to a bucket (32 -> 64 would double the step's work);
    rows of varied length are bucketed from the first batch; rows it cannot see keep the loader's first length."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    def loader(rows, collate, **kw):
        return shapes.pad_loader(torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate, **kw), True)

    blocks = Dataset.from_list([{"input_ids": f["input_ids"], "labels": f["input_ids"]}
                                for f in features([32] * 6, seed=8)])
    for got, made in zip(loader(blocks, default_data_collator),
                         torch.utils.data.DataLoader(blocks, batch_size=2, collate_fn=default_data_collator)):
        assert set(got) == set(made) and all(torch.equal(got[k], made[k]) for k in made)  # no mask added either
    stock = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)
    varied = Dataset.from_list(features([5, 9, 70, 3]))
    assert shapes.rows_vary_in_length(varied) and not shapes.rows_vary_in_length(blocks)
    assert [b["input_ids"].shape[1] for b in loader(varied, stock)] == [64, 128]

    class Stream(torch.utils.data.IterableDataset):  # rows it cannot see: the first length is kept
        def __iter__(self):
            yield from features([32, 32, 20, 20], seed=9)

    padder = BucketPadder(stock, True)
    out = [padder(list(pair)) for pair in zip(*[iter(Stream())] * 2)]
    assert [b["input_ids"].shape[1] for b in out] == [32, 64]
    assert out[1]["attention_mask"][:, 20:].sum() == 0
    assert padder(features([32, 32]))["attention_mask"].all()  # the first length again: unpadded, masked like the rest
