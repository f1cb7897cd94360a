"""Bounded graph shapes: batches padded to a few bucket lengths, and one line when a new graph compiles anyway.

XLA compiles one graph per distinct set of input shapes. A collator that pads each batch to its own longest text
(transformers' ``DataCollatorForLanguageModeling``, ``DataCollatorWithPadding``) gives a new sequence length, so a
new compile, for nearly every batch of varied text. :class:`BucketPadder` wraps a data loader's ``collate_fn`` and
pads the sequence dimension further, up to the next bucket length (``pad_to_buckets``), with each per-token field's
own padding value (:data:`PAD_VALUES`), on the side the collator padded; so a run compiles at most one graph per
bucket. Padding-free batches (several sequences flattened into one row, with ``position_ids`` that restart and no
attention mask: TRL's packing and ``padding_free``, transformers' ``DataCollatorWithFlattening``) get the padding as
one more sequence after the last (``position_ids`` from 0, ``seq_idx`` + 1, ``cu_seq_lens_*`` extended), so no real
token sees it. A default never breaks a batch the model takes: batches that already have a fixed length pass untouched
(rows of one length, or a loader's first length when its rows cannot be seen), and a field whose padding value is
unknown leaves its batches unpadded with one warning (per field and process) naming the field and the recompiles it
costs.

:func:`watch_loader` makes a prepared (device) loader count the runtime's compiles between two batches
(``UncachedCompile``, a counter read: no hashing) and, after warm-up, log one line naming the batch, the input shapes
that changed (old -> new) and the fix.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch

from ..errors import ConfigError
from ..settings import MIN_BUCKET

logger = logging.getLogger(__name__)

Buckets = Union[bool, int, list[int]]

#: batches of a loader that may compile freely (the first steps compile the step, the optimizer's lazy state ...)
WARMUP_BATCHES = 3
#: warning lines per loader; later new graphs are counted, not logged
MAX_REPORTS = 5
PAD_TOKEN = object()  # stands for the pad token id in PAD_VALUES
NEXT_SEQUENCE = object()  # stands for "a sequence index after the row's last" (seq_idx)
#: what each per-token key of a batch is padded with: the fields of transformers' collators (DataCollatorFor-
#: LanguageModeling, -WithPadding, -ForSeq2Seq, -WithFlattening) and TRL's (SFT with packing and padding_free, DPO's
#: prompt/completion pairs, vision-language: mm_token_type_ids)
PAD_VALUES: dict[str, Any] = {
    "input_ids": PAD_TOKEN, "decoder_input_ids": PAD_TOKEN, "labels": -100, "attention_mask": 0,
    "decoder_attention_mask": 0, "token_type_ids": 0, "decoder_token_type_ids": 0, "mm_token_type_ids": 0,
    "position_ids": 0, "decoder_position_ids": 0, "special_tokens_mask": 1, "completion_mask": 0,
    "assistant_masks": 0, "loss_mask": 0, "seq_idx": NEXT_SEQUENCE,
}
#: per-batch values of padding-free batches: the boundaries of the flattened sequences (1-D) and the longest one
CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTHS = ("max_length_q", "max_length_k")
_FIX_BUCKETS = ("set pad_to_buckets: true (off here), or pad every batch to a few fixed lengths yourself (the "
                "tokenizer's padding='max_length' with a max_length, or the collator's pad_to_multiple_of=64)")


# --------------------------------------------------------------------------- bucket lengths
def bucket_length(length: int, buckets: Buckets, cap: Optional[int] = None) -> int:
    """The padded length of a ``length``-token batch under ``buckets`` (see ``XlaFsdpPlugin.pad_to_buckets``).

    ``cap``: the longest sequence the model takes; a bucket past it is cut to it (a batch already longer is only
    padded by the rule, the model will say what is wrong with it).
    """
    if buckets is False or length <= 0:
        return length
    if buckets is True:
        out = max(MIN_BUCKET, 1 << (length - 1).bit_length())
    elif isinstance(buckets, int):
        out = -(-length // buckets) * buckets
    else:
        out = next((b for b in buckets if b >= length), -(-length // buckets[-1]) * buckets[-1])
    if cap is not None and length <= cap < out:
        out = cap
    return out


def bucket_lengths(buckets: Buckets, cap: int) -> list[int]:
    """Every length a batch of at most ``cap`` tokens can be padded to (how many graphs a run compiles at most)."""
    if buckets is False:
        return list(range(1, cap + 1))
    return sorted({bucket_length(n, buckets, cap) for n in range(1, cap + 1)})


# --------------------------------------------------------------------------- padding
def _inner_collators(fn: Any) -> Iterator[Any]:
    """``fn`` and the collators it wraps (the Trainer's RemoveColumnsCollator, functools.partial, ours)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        fn = getattr(fn, "data_collator", None) or getattr(fn, "collate_fn", None) or getattr(fn, "func", None)


def _collator_settings(fn: Any) -> tuple[Optional[int], Optional[str], Optional[int]]:
    """Pad token id (the eos id when there is no pad token), padding side and the tokenizer's max length, from the
    collator's tokenizer or its own fields."""
    for inner in _inner_collators(fn):
        tok = getattr(inner, "tokenizer", None) or getattr(inner, "processing_class", None)
        tok = getattr(tok, "tokenizer", tok)  # a processor holds its tokenizer
        if tok is not None and hasattr(tok, "pad_token_id"):
            longest = getattr(tok, "model_max_length", None)
            longest = longest if isinstance(longest, int) and 0 < longest < 1_000_000 else None
            pad = tok.pad_token_id if tok.pad_token_id is not None else _one_id(getattr(tok, "eos_token_id", None))
            return pad, getattr(tok, "padding_side", None), longest
        if getattr(inner, "pad_token_id", None) is not None:  # e.g. TRL's collators
            return inner.pad_token_id, getattr(inner, "padding_side", None), None
    return None, None, None


def _config_settings(models: Callable[[], Iterable[Any]]) -> tuple[Optional[int], Optional[int]]:
    """Pad token id and longest sequence from the configs of the (unwrapped) prepared models."""
    for model in models():
        config = getattr(model, "config", None)
        if config is None:
            continue
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        longest = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
                        if isinstance(getattr(config, k, None), int)), None)
        pad = getattr(config, "pad_token_id", None)
        return (pad if pad is not None else _one_id(getattr(config, "eos_token_id", None))), longest
    return None, None


def _one_id(token_id: Any) -> Optional[int]:
    """A token id, or the first of a list of them (configs may list several eos ids)."""
    if isinstance(token_id, (list, tuple)):
        token_id = token_id[0] if token_id else None
    return token_id if isinstance(token_id, int) else None


class UnpaddableField(ConfigError):
    """A per-token field whose padding value is unknown (:class:`BucketPadder` leaves such batches unpadded)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"pad_to_buckets cannot pad the batch's {key!r} (its padding value is unknown); pad it "
                         "yourself to fixed lengths and set pad_to_buckets: false")
        self.key = key


#: fields already warned about in this process (one warning per field, not per batch)
_WARNED: set[str] = set()


def _warn_unpadded(key: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning("pad_to_buckets leaves batches with %r unpadded (its padding value is unknown): each new sequence "
                   "length of them compiles the training step again (a new XLA graph: seconds here, minutes on large "
                   "models); pad %r to a few fixed lengths yourself to avoid that (then pad_to_buckets: false)", key, key)


class BucketPadder:
    """A ``collate_fn`` that pads what ``collate_fn`` returns up to the bucket lengths (picklable for workers).

    Each per-token tensor of the batch (2-D, ``[batch, tokens]``; the keys of ``PAD_VALUES``) is padded along its
    token dimension to ``bucket_length`` of its own length (see :func:`pad_batch`). With ``keep_first`` (the default;
    :func:`pad_loader` turns it off for a dataset whose rows vary in length) the loader's first lengths are kept as
    they are, so batches that already have a fixed length pass untouched (a loader of varied lengths it cannot see
    compiles that one length more); without it every batch is bucketed. An
    ``attention_mask`` is added to a padded batch with ``input_ids`` and none (not to a padding-free one), and from
    then on to every batch, so padded and unpadded batches share a graph. A batch holding another 2-D tensor as long
    as a padded field is left unpadded,
    with one warning per field and process. Batches that are not mappings of tensors pass unchanged.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], buckets: Buckets, *,
                 models: Optional[Callable[[], Iterable[Any]]] = None, errors: Optional[list] = None,
                 keep_first: bool = True) -> None:
        self.collate_fn = collate_fn
        self.keep_first = keep_first
        self.buckets = buckets
        self._models = models
        self._resolved: Optional[tuple[Optional[int], Optional[str], Optional[int]]] = None
        #: the per-token lengths of the loader's first batch: kept, never padded
        self.first_lengths: Optional[dict[str, int]] = None
        #: an attention mask was added to a padded batch: every later batch without one gets one too
        self.adds_mask = False
        #: a refusal raised in a loader thread is lost there: it is kept here for the training thread to raise
        self.errors = errors if errors is not None else []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        self._resolve()
        state["_resolved"], state["_models"] = self._resolved, None  # resolved before a worker gets a copy
        state["errors"] = []  # a worker process's refusals surface as its own exception
        return state

    def _resolve(self) -> tuple[Optional[int], Optional[str], Optional[int]]:
        if self._resolved is None:
            pad_id, side, longest = _collator_settings(self.collate_fn)
            config_pad, config_longest = _config_settings(self._models) if self._models else (None, None)
            # no pad token (GPT-2, Llama): any id will do under a 0 attention mask and -100 labels; eos, else 0
            pad_id = pad_id if pad_id is not None else config_pad if config_pad is not None else 0
            caps = [n for n in (longest, config_longest) if n]
            self._resolved = (pad_id, side, min(caps) if caps else None)
        return self._resolved

    def __call__(self, features: list[Any]) -> Any:
        batch = self.collate_fn(features)
        if not isinstance(batch, Mapping):
            return batch
        lengths = token_lengths(batch)
        if not lengths:
            return batch
        if self.first_lengths is None:
            self.first_lengths = lengths if self.keep_first else {}
        pad_id, side, cap = self._resolve()
        try:
            out = pad_batch(batch, self.buckets, pad_token_id=pad_id, padding_side=side, cap=cap,
                            keep_lengths=self.first_lengths, add_mask=self.adds_mask)
        except UnpaddableField as err:
            _warn_unpadded(err.key)
            return batch
        except ConfigError as err:
            self.errors.append(err)
            return batch
        if out is not batch and "attention_mask" in out and "attention_mask" not in batch:
            self.adds_mask = True
        return out


def token_lengths(batch: Mapping[str, Any]) -> dict[str, int]:
    """The length of each per-token field (a key of ``PAD_VALUES`` holding a 2-D tensor) of ``batch``."""
    return {k: int(v.shape[1]) for k, v in batch.items()
            if k in PAD_VALUES and isinstance(v, torch.Tensor) and v.dim() == 2}


def is_padding_free(batch: Mapping[str, Any]) -> bool:
    """Sequences flattened into rows (TRL's packing / ``padding_free``, ``DataCollatorWithFlattening``): position ids
    and no attention mask (how transformers recognizes packed sequences), or the varlen boundaries."""
    return ("attention_mask" not in batch and isinstance(batch.get("position_ids"), torch.Tensor)) or any(
        k in batch for k in (*CU_SEQ_LENS, "seq_idx"))


def _padded_side(batch: Mapping[str, Any], default: Optional[str]) -> str:
    """The side the collator padded on, read from the attention mask's zeros; else ``default`` (else right)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        left, right = bool((mask[:, 0] == 0).any()), bool((mask[:, -1] == 0).any())
        if left != right:
            return "left" if left else "right"
    return default or "right"


def _bounded_boundaries(bounds: Any, total: Optional[int]) -> Optional[torch.Tensor]:
    """``cu_seq_lens_*`` of a padding-free batch whose rows were padded to ``total`` tokens (None: not padded): the
    padding ends one more sequence, and the entry count goes up to a power of two (at least 64) by repeating the last
    boundary (empty sequences), since the count changes with every batch and activation checkpointing passes every
    tensor argument of a block into the graph (a recompile per count). None when nothing changes."""
    if not (isinstance(bounds, torch.Tensor) and bounds.dim() == 1 and bounds.numel()):
        return None
    out = bounds
    if total is not None and int(out[-1]) < total:
        out = torch.cat([out, out.new_tensor([total])])
    count = bucket_length(out.numel(), True)
    if count > out.numel():
        out = torch.cat([out, out[-1:].expand(count - out.numel())])
    return None if out is bounds else out


def pad_batch(batch: Mapping[str, Any], buckets: Buckets, *, pad_token_id: Optional[int],
              padding_side: Optional[str] = "right", cap: Optional[int] = None,
              keep_lengths: Optional[Mapping[str, int]] = None, add_mask: bool = False) -> Any:
    """``batch`` (a mapping; the same type is returned) with its per-token tensors padded to the bucket lengths.

    ``batch`` itself is returned when nothing needs padding: each field's length is its ``keep_lengths`` or a bucket
    length already (with ``add_mask``, a missing attention mask is added all the same, see :class:`BucketPadder`).
    Padding goes on the side the collator padded (``padding_side`` when the batch does not tell), right for
    padding-free batches, where it becomes one more sequence: ``position_ids`` count from 0, ``seq_idx`` is the next
    index, ``cu_seq_lens_*`` end at the new length (their entry count bucketed too) and ``max_length_*`` cover it.
    Raises :class:`UnpaddableField` for another 2-D tensor as long as a padded one, ``ConfigError`` when
    ``input_ids`` need a pad token and there is none.
    """
    ids = batch.get("input_ids")
    ids_len = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
    flat = is_padding_free(batch)
    keep = keep_lengths or {}
    targets: dict[str, int] = {}
    for key, length in token_lengths(batch).items():
        target = length if length == keep.get(key) else bucket_length(length, buckets, cap)
        if target != length:
            targets[key] = target
    wants_mask = ids_len is not None and "attention_mask" not in batch and not flat
    total = max(targets.values()) if targets else None
    boundaries = {key: new for key in CU_SEQ_LENS
                  if flat and (new := _bounded_boundaries(batch.get(key), total)) is not None}
    if not targets and not boundaries and not (add_mask and wants_mask):
        return batch
    padded_lengths = {batch[k].shape[1] for k in targets}
    for key, value in batch.items():
        if key not in PAD_VALUES and isinstance(value, torch.Tensor) and value.dim() == 2 \
                and value.shape[1] in padded_lengths:
            raise UnpaddableField(key)
    side = "right" if flat else _padded_side(batch, padding_side)
    out = dict(batch)
    if wants_mask:  # so padded and unpadded batches share a graph
        out["attention_mask"] = torch.ones_like(ids, dtype=torch.long)
        if "input_ids" in targets:
            targets["attention_mask"] = targets["input_ids"]
    for key, target in targets.items():
        value = out[key]
        rows, length = value.shape[0], value.shape[1]
        fill = PAD_VALUES[key]
        if fill is PAD_TOKEN:
            if pad_token_id is None:
                raise ConfigError("pad_to_buckets needs a pad token id to pad input_ids: set tokenizer.pad_token (e.g. "
                                  "tokenizer.pad_token = tokenizer.eos_token) or model.config.pad_token_id, or set "
                                  "pad_to_buckets: false")
            fill = pad_token_id
        if fill is NEXT_SEQUENCE:
            after = value.amax(dim=1, keepdim=True) + 1 if length else value.new_zeros((rows, 1))
            pad = after.expand(rows, target - length).to(value.dtype)
        elif key == "position_ids" and flat:  # the padding is a sequence of its own, from position 0
            pad = torch.arange(target - length, dtype=value.dtype).expand(rows, -1)
        else:
            pad = value.new_full((rows, target - length), fill)
        out[key] = torch.cat([pad, value] if side == "left" else [value, pad], dim=1)
    out.update(boundaries)
    if flat and targets:
        padding = total - (ids_len if ids_len is not None else min(batch[k].shape[1] for k in targets))
        for key in MAX_LENGTHS:
            if isinstance(out.get(key), int):
                out[key] = max(out[key], padding)
    if isinstance(batch, dict) and type(batch) is dict:
        return out
    try:  # BatchEncoding and other mapping types keep their type
        new = type(batch)(out)
        return new
    except Exception:  # noqa: BLE001 - a mapping we cannot rebuild: a plain dict works for every model call
        return out


def rows_vary_in_length(dataset: Any) -> bool:
    """True when ``dataset``'s rows are known to have different token counts, so a collator that pads to the longest
    row makes a new length nearly every batch: a ``datasets.Dataset`` with an ``input_ids`` column (read from the
    Arrow lengths, nothing decoded), or a list of rows. False when they all have one length or it cannot tell (an
    iterable or streaming dataset: :class:`BucketPadder` then keeps the loader's first length, see ``keep_first``)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency of the package
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        import pyarrow.compute as pc

        try:
            lengths = pc.min_max(pc.list_value_length(dataset.data.column("input_ids")))
        except Exception:  # noqa: BLE001 - not a list column: nothing to tell
            return False
        return lengths["min"].as_py() != lengths["max"].as_py()
    if isinstance(dataset, (list, tuple)) and 0 < len(dataset) <= 100_000:
        rows = [r.get("input_ids") if isinstance(r, Mapping) else r for r in dataset]
        lengths = {len(r) for r in rows if isinstance(r, (list, tuple, torch.Tensor))}
        return len(lengths) > 1
    return False


def pad_loader(loader: Any, buckets: Buckets, *, models: Optional[Callable[[], Iterable[Any]]] = None,
               errors: Optional[list] = None) -> Any:
    """``loader`` with its ``collate_fn`` wrapped in a :class:`BucketPadder` (once); unchanged when off or when it
    has no ``collate_fn``. Rows of varied length (:func:`rows_vary_in_length`) are bucketed from the first batch on;
    otherwise the first batch's lengths are kept (rows of one length pass untouched). ``errors`` collects refusals
    for the training thread to raise (see :func:`watch_loader`)."""
    fn = getattr(loader, "collate_fn", None)
    if buckets is False or fn is None or isinstance(fn, BucketPadder):
        return loader
    keep_first = not rows_vary_in_length(getattr(loader, "dataset", None))
    loader.collate_fn = BucketPadder(fn, buckets, models=models, errors=errors, keep_first=keep_first)
    return loader


# --------------------------------------------------------------------------- new graphs after warm-up
def compile_count() -> int:
    """Graphs this process has compiled so far (torch_xla's ``UncachedCompile`` counter)."""
    import torch_xla.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)


Signature = tuple[tuple[str, tuple[int, ...], str], ...]


def signature(batch: Any) -> Signature:
    """Names, shapes and dtypes of a batch's tensors (shape metadata only: nothing is synced)."""
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch if isinstance(batch, (list, tuple))
                                                                        else [batch])
    return tuple((str(k), tuple(v.shape), str(v.dtype).removeprefix("torch."))
                 for k, v in items if isinstance(v, torch.Tensor))


def describe_change(old: Optional[Signature], new: Signature) -> str:
    """``input_ids (8, 87) -> (8, 93), ...``: what differs between two signatures."""
    before = {k: (s, d) for k, s, d in (old or ())}
    parts = []
    for key, shape, dtype in new:
        if key not in before:
            parts.append(f"{key} {shape} {dtype} (new input)")
        elif before[key] != (shape, dtype):
            (s0, d0) = before[key]
            parts.append(f"{key} {s0}{'' if d0 == dtype else ' ' + d0} -> {shape}{'' if d0 == dtype else ' ' + dtype}")
    parts += [f"{key} removed" for key in before if key not in {k for k, _, _ in new}]
    return ", ".join(parts) or "no input changed shape (something else in the step changed)"


class RecompileWatch:
    """Counts compiles per batch of one loader and reports those after warm-up that new input shapes caused."""

    def __init__(self, buckets: Buckets, *, step: Optional[Callable[[], Optional[int]]] = None,
                 after_compile: Optional[Callable[[], None]] = None, warmup: int = WARMUP_BATCHES,
                 errors: Optional[list] = None) -> None:
        self.buckets = buckets
        #: refusals of the padding collator (which may run in a loader thread), raised here in the training thread
        self.errors = errors if errors is not None else []
        self.step = step
        self.after_compile = after_compile
        self.warmup = warmup
        self.batches = 0
        self.new_graphs = 0  # after warm-up, caused by new input shapes
        self.seen: set[Signature] = set()
        self.last: Optional[Signature] = None

    def stepped(self, sig: Signature, compiled: int) -> None:
        """Batch ``sig`` has been used and ``compiled`` graphs were compiled meanwhile."""
        self.batches += 1
        new_shape = sig not in self.seen
        self.seen.add(sig)
        previous, self.last = self.last, sig
        if compiled and self.after_compile is not None:
            self.after_compile()
        if not compiled or not new_shape or self.batches <= self.warmup:
            return
        self.new_graphs += 1
        step = self.step() if self.step is not None else None
        where = f"step {step} (batch {self.batches} of this data loader)" if step else f"batch {self.batches}"
        change = describe_change(previous, sig)
        level, fix = self._fix(previous, sig)
        if self.new_graphs > MAX_REPORTS:
            return
        tail = "; later new graphs of this data loader are not logged" if self.new_graphs == MAX_REPORTS else ""
        logger.log(level, "%s compiled a new XLA graph after warm-up: %s; %s%s", where, change, fix, tail)

    def _fix(self, old: Optional[Signature], new: Signature) -> tuple[int, str]:
        """Log level and the fix for a change from ``old`` to ``new``."""
        before = {k: s for k, s, _ in (old or ())}
        changed = [(before[k], s) for k, s, _ in new if k in before and before[k] != s]
        if changed and any(a and b and a[0] != b[0] for a, b in changed):
            return logging.WARNING, ("the batch size changed (a last, smaller batch): set dataloader_drop_last=True "
                                     "(TrainingArguments) or drop_last=True (DataLoader)")
        if changed and self.buckets is not False and all(len(a) == len(b) and a[0] == b[0] for a, b in changed):
            return logging.INFO, "a bucket length not seen before (expected once per bucket, pad_to_buckets)"
        if self.buckets is False:
            return logging.WARNING, f"fix: {_FIX_BUCKETS}"
        return logging.WARNING, "fix: keep every batch's shapes and dtypes the same (pad to fixed lengths)"


def _watched_iter(inner: Iterator[Any], watch: RecompileWatch, failures: Optional[list] = None) -> Iterator[Any]:
    """Yield ``inner``'s batches; the compiles between two ``next`` calls belong to the step of the batch before
    (an XLA device loader cuts and runs the previous step's graph when the next batch is asked for)."""
    count = compile_count()
    sig: Optional[Signature] = None
    while True:
        try:
            batch = next(inner)
        except StopIteration:
            if failures:  # the host loader failed in the device loader's thread, which ended the data silently
                raise failures.pop(0) from None
            if sig is not None:
                watch.stepped(sig, compile_count() - count)
            return
        if watch.errors:
            raise watch.errors.pop(0)
        now = compile_count()
        if sig is not None:
            watch.stepped(sig, now - count)
        count, sig = now, signature(batch)
        yield batch


class _ReportingLoader:
    """A host data loader as an XLA device loader's thread reads it: a failure is kept in ``failures`` instead of
    dying with the thread (torch_xla's thread then closes its queue, so the training loop saw the data end: 0 steps,
    exit code 0); :func:`_watched_iter` raises it in the training thread after the batches read before it."""

    def __init__(self, loader: Any, failures: list) -> None:
        self._inner, self._failures = loader, failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._inner
        except Exception as err:  # noqa: BLE001 - any failure: the training thread raises it
            self._failures.append(err)


@functools.cache
def _watched_class(cls: type) -> type:
    def __iter__(self: Any) -> Iterator[Any]:
        failures: list = []
        host = self.__dict__.get("_loader")  # an XLA device loader's host loader, read in a background thread
        if host is None:
            return _watched_iter(iter(super(watched, self).__iter__()), self._hf_xla_fsdp_watch, failures)
        # the device loader's thread keeps the reference it is given now: only that thread reads through the wrapper
        self._loader = _ReportingLoader(host, failures)
        try:
            inner = iter(super(watched, self).__iter__())
        finally:
            self._loader = host
        return _watched_iter(inner, self._hf_xla_fsdp_watch, failures)

    watched = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
    return watched


def watch_loader(loader: Any, watch: RecompileWatch) -> Any:
    """``loader`` itself (same object, same class for ``isinstance``) whose iteration reports new graphs to
    ``watch``; unchanged when its class cannot take a subclass."""
    if getattr(loader, "_hf_xla_fsdp_watch", None) is not None:
        return loader
    try:
        loader.__class__ = _watched_class(type(loader))
        loader._hf_xla_fsdp_watch = watch
    except (TypeError, AttributeError):  # accelerate's DataLoaderShard makes __class__ a read-only property
        logger.debug("%s cannot be watched for new graphs", type(loader).__name__)
    return loader


__all__ = ["BucketPadder", "RecompileWatch", "UnpaddableField", "bucket_length", "bucket_lengths", "compile_count",
           "is_padding_free", "pad_batch", "pad_loader", "rows_vary_in_length", "signature", "token_lengths",
           "watch_loader"]
