"""Streaming consolidation of rank files into a ``from_pretrained``-ready safetensors checkpoint.

Every output tensor is assembled from only the bytes of each rank file it needs (rows of flat
FSDP v1 shards, or the pieces of FSDP v2 slices) and written straight into its safetensors shard,
so peak host memory stays near one tensor, however large the model or the output shards. No XLA
runtime is needed: torch_xla is never imported here. The session's
:meth:`~hf_xla_fsdp.session.CheckpointManager.save_pretrained` is the one save-then-consolidate path of the
Trainer and accelerate glue.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ..errors import CheckpointError, ConfigError
from ..settings import parse_dtype
from .layout import MODEL_PREFIX, SIDE_FILES, check_side_files, merge_into, prepare_output, publish, write_bytes_atomic
from .readers import (
    LAYOUT_PIECES,
    RankSet,
    buffer_dtypes,
    clean_name,
    gather_rows,
    merge_pieces,
    open_checkpoint,
    read_pieces,
)
from .safetensors_io import dtype_from_name, write_safetensors_streaming

logger = logging.getLogger(__name__)



@dataclass
class OutputTensor:
    """One tensor of the consolidated model and where its elements live in the rank files."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str            # FSDP state-dict key in every rank file
    sharded: bool
    dim0: bool = False  # sharded along dim 0 (shard_param_on_dim_0) instead of flattened
    offset: int = 0     # first element inside a flattened (possibly multi-parameter) flat shard

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def read(self, ranks: RankSet) -> torch.Tensor:
        """Assemble this tensor from the rank files, reading only what it needs."""
        files = ranks.files
        if not self.sharded:
            return files[0].get(MODEL_PREFIX + self.key).to(self.dtype)
        if self.dim0:
            return gather_rows(files, MODEL_PREFIX + self.key, 0, self.shape[0]).to(self.dtype)
        flat = gather_rows(files, MODEL_PREFIX + self.key, self.offset, self.offset + self.numel)
        return flat.view(self.shape).to(self.dtype)


@dataclass
class SpmdOutputTensor:
    """One tensor of the consolidated model saved by FSDP v2: its pieces, with their offsets, in the rank files."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    entry: dict[str, Any]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def read(self, ranks: RankSet) -> torch.Tensor:
        """Assemble this tensor from its pieces (only those bytes are read)."""
        return read_pieces(self.entry).to(self.dtype)


def plan_outputs(ranks: RankSet) -> list[Any]:
    """Every tensor of the full model, in rank 0's order, from the shard metadata alone."""
    if ranks.layout == LAYOUT_PIECES:
        return [SpmdOutputTensor(name[len(MODEL_PREFIX):], tuple(e["shape"]), dtype_from_name(e["dtype"]), e)
                for name, e in merge_pieces(ranks.files).items() if name.startswith(MODEL_PREFIX)]
    md = ranks.shard_metadata
    first = ranks.files[0]
    buffer_info = buffer_dtypes(md)
    out: list[OutputTensor] = []
    for key in first.model_keys():
        parts = key.split(".")
        idx = next((i for i, p in enumerate(parts) if p.startswith("_fsdp_shard")), None)
        if idx is None:  # a buffer: replicated, rank 0's copy, cast back to the dtype it had
            dtype = buffer_info.get(key, first.dtype(MODEL_PREFIX + key))
            out.append(OutputTensor(clean_name(key), first.shape(MODEL_PREFIX + key), dtype, key, sharded=False))
            continue
        prefix, suffix = ".".join(parts[:idx]), ".".join(parts[idx:])
        try:
            info = md["shard_info"][prefix][suffix]
        except KeyError:
            raise CheckpointError(f"{first.path.name}: {key} has no entry in shard_metadata['shard_info']") from None
        full_name = f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]
        dtype = first.dtype(MODEL_PREFIX + key)
        dim0 = len(first.shape(MODEL_PREFIX + key)) > 1
        if "_fsdp_wrapped_module.flat_param_" in full_name:
            names, shapes, numels = md["flatten_info"][full_name]
            base = full_name.rsplit(".", 1)[0]
            offset = 0
            for n, shape, numel in zip(names, shapes, numels):
                out.append(OutputTensor(clean_name(f"{base}.{n}"), tuple(shape), dtype, key, True, False, offset))
                offset += numel
        else:
            out.append(OutputTensor(clean_name(full_name), tuple(info["_orig_size"]), dtype, key, True, dim0))
    return out


# --------------------------------------------------------------------------- config
def load_config(config: Union[str, os.PathLike, None], ranks: RankSet) -> Any:
    """The model config: ``config`` (a model dir or config.json) or the one saved in the rank files."""
    from transformers import AutoConfig

    if config is not None:
        path = Path(config)
        if not path.exists():
            raise ConfigError(f"--config {config} does not exist")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ConfigError(f"--config {config} is a directory without config.json")
        try:
            return AutoConfig.from_pretrained(str(path))
        except Exception as err:  # transformers raises OSError/ValueError/KeyError variants
            raise ConfigError(f"--config {config} is not a valid transformers config ({err})".splitlines()[0]) from None
    saved = ranks.meta.get("model_config")
    if not saved:
        raise ConfigError("the rank files carry no model config; pass --config MODEL_DIR_OR_CONFIG_JSON")
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[saved["model_type"]].from_dict(saved)


def write_config(config: Any, directory: Path, dtype: Optional[torch.dtype]) -> None:
    """``config.json`` in ``directory``: a transformers config through ``save_pretrained``, or the dict a
    checkpoint saved (``config.to_dict()``) as the full JSON ``from_pretrained`` reads, with ``dtype`` set."""
    if not isinstance(config, dict):
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(str(directory))
        return
    from importlib.metadata import version

    values = {k: v for k, v in config.items() if k != "_name_or_path"}  # a path on the machine that trained it
    if dtype is not None:
        values["dtype"] = str(dtype).removeprefix("torch.")
    values["transformers_version"] = version("transformers")
    write_bytes_atomic(directory / "config.json", (json.dumps(values, indent=2, sort_keys=True) + "\n").encode())


def expected_tensors(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes of the tensors ``from_pretrained`` expects for ``config``, and its tied names."""
    from ..modeling.meta_init import model_class

    cls = model_class(config)
    with torch.device("meta"):  # transformers skips weight init on meta; nothing is allocated
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return shapes, tied


def check_against_config(plan: list[OutputTensor], config: Any) -> None:
    """Refuse a config whose model does not have exactly the checkpoint's tensors."""
    shapes, tied = expected_tensors(config)
    have = {t.name: t.shape for t in plan}
    problems = [f"{n} is in the checkpoint but not in {type(config).__name__}'s model" for n in have if n not in shapes]
    problems += [f"{n} is missing from the checkpoint" for n in shapes if n not in have and n not in tied]
    problems += [f"{n} has shape {list(s)} in the checkpoint but {list(shapes[n])} in the config"
                 for n, s in have.items() if n in shapes and tuple(shapes[n]) != tuple(s)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(f"the config does not match the checkpoint: {'; '.join(problems[:3])}{more}")


# --------------------------------------------------------------------------- training record
TRAINING_INFO = "xla_fsdp_training.json"


def training_record(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """What :func:`training_info` reads back, from a Trainer's ``log_history``: the losses by step, the last eval loss."""
    record: dict[str, Any] = {"losses": {str(e["step"]): float(e["loss"]) for e in log_history
                                         if "loss" in e and "step" in e}}
    evals = [e for e in log_history if "eval_loss" in e]
    if evals:
        record["eval_loss"] = float(evals[-1]["eval_loss"])
    return record


#: the engines' names and titles, for rank files written before they recorded their engine (``engine_name`` /
#: ``engine_title``, 2026-12): told apart by layout and plugin record as they were then; a newer engine records itself
_RECORDED_BEFORE = {"flat": ("xla_fsdp_v1", "FSDP v1 (XlaFullyShardedDataParallel)"),
                    "pieces": ("xla_fsdp_v2", "FSDP v2 (SPMD, SpmdFullyShardedDataParallel)"),
                    "torch": ("fsdp2", "FSDP2 (torch fully_shard, DTensor)")}


def _engine_of_record(meta: dict[str, Any], pieces: bool) -> tuple[str, str]:
    """``(name, title)`` of the engine that wrote a rank file: as it recorded them, else as older files tell."""
    if meta.get("engine_name"):
        return meta["engine_name"], meta.get("engine_title") or meta["engine_name"]
    plugin = meta.get("plugin") or {}
    # fsdp2 wrote the same piece layout as FSDP v2: the plugin record named the engine
    return _RECORDED_BEFORE["torch" if plugin.get("engine") == "fsdp2" else "pieces" if pieces else "flat"]


def engine_title(info: dict[str, Any]) -> str:
    """The title of the engine a training record (:func:`training_info`, or an older ``training_info.json`` that
    holds the name only) names; ``"unknown"`` when it names none."""
    if info.get("engine_title"):
        return str(info["engine_title"])
    return next((title for name, title in _RECORDED_BEFORE.values() if name == info.get("engine")), "unknown")


def training_info(ranks: RankSet) -> dict[str, Any]:
    """How the checkpoint was trained (engine name and title, sharding, world size, dtype, steps, last losses), for
    model cards."""
    meta = ranks.meta
    if not meta:
        name, title = _RECORDED_BEFORE["flat"]
        return {"engine": name, "engine_title": title, "world_size": ranks.world_size}
    pieces = ranks.layout == LAYOUT_PIECES  # FSDP v2 saves one file per process; its world is the device count
    engine, title = _engine_of_record(meta, pieces)
    world = meta.get("devices", ranks.world_size) if pieces else ranks.world_size
    extra = meta.get("extra") or {}
    losses = extra.get("losses") or {}
    metrics = {}
    if losses:
        metrics["train_loss"] = float(losses[max(losses, key=int)])
    for key in ("eval_loss", "eval_dataset"):
        if key in extra:
            metrics[key] = extra[key]
    return {"engine": engine, "engine_title": title, "world_size": world, "step": meta.get("step"),
            "plugin": meta.get("plugin"), "metrics": metrics}


# --------------------------------------------------------------------------- side files
def copy_side_files(sources: list[Path], dest: Path) -> list[str]:
    """Copy tokenizer / generation-config files found in the first of ``sources`` that has each."""
    copied = []
    for name in SIDE_FILES:
        for src in sources:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)
                copied.append(name)
                break
    return copied


def side_file_sources(ckpt: Union[str, os.PathLike], config: Union[str, os.PathLike, None]) -> list[Path]:
    """Where a consolidated directory's tokenizer / generation config come from: the checkpoint, its parent, the config's dir."""
    sources = [Path(ckpt), Path(ckpt).parent] if Path(ckpt).is_dir() else []
    if config is not None:
        sources.append(Path(config) if Path(config).is_dir() else Path(config).parent)
    return sources


# --------------------------------------------------------------------------- the job
def consolidate(
    ckpt: Union[str, os.PathLike],
    output: Union[str, os.PathLike],
    *,
    ckpt_suffix: Optional[str] = None,
    config: Union[str, os.PathLike, None] = None,
    dtype: str = "auto",
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    progress: bool = True,
    plan_transform: Optional[Callable[[RankSet, list[Any]], list[Any]]] = None,
) -> dict[str, Any]:
    """Consolidate the rank files of ``ckpt`` into ``output`` (safetensors, ``from_pretrained``-ready).

    ``ckpt`` is one of our checkpoint directories, a Trainer checkpoint directory, or a torch_xla
    prefix matched with ``ckpt_suffix``. Validation happens before anything is written, and the
    output appears only when complete. ``plan_transform(ranks, tensors)`` may rewrite the output
    tensors (e.g. LoRA adapters merged into their base weights). Returns a summary (files, tensors, bytes).
    ``ckpt`` and ``output`` may be fsspec URLs (``memory://``, ``gs://`` with the ``[cloud]`` extra): the input is
    read from a local copy of the files its marker lists, the output written locally and then uploaded.
    """
    from huggingface_hub import split_state_dict_into_shards_factory
    from tqdm.auto import tqdm

    from .storage import is_url, local_path

    if not is_url(ckpt):  # file:// is a plain path; a torch_xla prefix stays a string (its trailing slash matters)
        ckpt = local_path(ckpt) if ckpt_suffix is None else os.fspath(ckpt).removeprefix("file://")
    if is_url(output):
        return _consolidate_to_url(ckpt, str(output), overwrite=overwrite, ckpt_suffix=ckpt_suffix, config=config,
                                   dtype=dtype, max_shard_size=max_shard_size, progress=progress,
                                   plan_transform=plan_transform)
    out_dtype = None if dtype == "auto" else parse_dtype(dtype, "dtype")
    ranks = open_checkpoint(ckpt, ckpt_suffix)
    if ranks.marker:  # the side files this copies are checked before anything is written
        fetched = getattr(ranks, "fetched", None)
        check_side_files(fetched.path if fetched else Path(ranks.source), ranks.marker, SIDE_FILES)
    plan = plan_outputs(ranks)
    if plan_transform is not None:
        plan = plan_transform(ranks, plan)
    elif (ranks.meta or {}).get("peft"):
        raise CheckpointError(f"{ckpt} is a checkpoint of a PEFT model: `hf-xla-fsdp consolidate` writes its adapter "
                              "files, and --merge-adapters the full model with the adapters merged in")
    saved = (ranks.meta or {}).get("model_config")
    if config is None and plan_transform is None and saved:
        # the rank files' own config describes the very model their tensors were saved from, so the check
        # would compare the model with itself; written back as JSON it needs no transformers import, whose
        # config classes pull in torch._dynamo (~190 MiB, more than the rest of a consolidation)
        cfg: Any = dict(saved)
    else:
        cfg = load_config(config, ranks)
        check_against_config(plan, cfg)
    if out_dtype is not None:
        for t in plan:
            if t.dtype.is_floating_point:
                t.dtype = out_dtype
    placeholders = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in plan}
    split = split_state_dict_into_shards_factory(
        placeholders, get_storage_size=lambda t: t.numel() * t.element_size(),
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
    )
    by_name = {t.name: t for t in plan}
    output = local_path(output)
    try:
        stage = prepare_output(output, overwrite)
    except OSError as err:
        if err.errno is None:  # check_output's own one-line refusals (an existing output)
            raise
        raise CheckpointError(f"cannot write the consolidated model beside {output}: {err}") from None
    try:
        bar = tqdm(total=sum(t.numel * t.dtype.itemsize for t in plan), unit="B", unit_scale=True,
                   desc="consolidate", disable=not progress)
        for filename, names in split.filename_to_tensors.items():
            tmp = stage / (filename + ".tmp")
            entries = [by_name[n] for n in names]
            write_safetensors_streaming(
                tmp, [(t.name, t.shape, t.dtype) for t in entries], lambda name: by_name[name].read(ranks),
                {"format": "pt"}, lambda name: bar.update(by_name[name].numel * by_name[name].dtype.itemsize))
            os.replace(tmp, stage / filename)
        bar.close()
        ranks.finish_verification(MODEL_PREFIX)  # the padding of partly read shards too: nothing unchecked is published
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel * t.dtype.itemsize for t in plan)},
                     "weight_map": split.tensor_to_filename}
            write_bytes_atomic(stage / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True).encode())
        float_dtypes = {t.dtype for t in plan if t.dtype.is_floating_point}
        write_config(cfg, stage, float_dtypes.pop() if len(float_dtypes) == 1 else None)
        fetched = getattr(ranks, "fetched", None)  # a URL's local copy holds its side files
        side = copy_side_files(side_file_sources(fetched.path if fetched else ckpt, config), stage)
        info = training_info(ranks)
        if info:
            write_bytes_atomic(stage / TRAINING_INFO, json.dumps(info, indent=2).encode())
        publish(stage, output)
    except OSError as err:  # a full disk, a size limit, a read-only mount: the staging files go, the output stays
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(f"cannot write the consolidated model to {output}: {err}; "
                              f"{'the existing ' + str(output) + ' is unchanged' if output.exists() else 'nothing was written'}"
                              ) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return {
        "output": str(output), "world_size": ranks.world_size, "tensors": len(plan),
        "files": sorted(split.filename_to_tensors), "total_bytes": sum(t.numel * t.dtype.itemsize for t in plan),
        "side_files": side,
    }


def _consolidate_to_url(ckpt: Union[str, os.PathLike], output: str, *, overwrite: bool, **kwargs: Any) -> dict[str, Any]:
    """:func:`consolidate` into a local temporary directory, then uploaded to ``output`` (config.json last, so a
    directory with a config has its weights); a failed upload removes what it wrote."""
    import tempfile

    from .storage import check_remote_output, upload_directory

    check_remote_output(output, overwrite)  # before the work
    with tempfile.TemporaryDirectory(prefix="hf_xla_fsdp-consolidate-", dir=os.environ.get("HF_XLA_FSDP_SPOOL")) as tmp:
        summary = consolidate(ckpt, Path(tmp) / "out", **kwargs)
        upload_directory(Path(tmp) / "out", output, overwrite=overwrite)
    return {**summary, "output": output}


# --------------------------------------------------------------------------- into an existing directory
def consolidate_into(ckpt: Path, output: Path, *, dtype: str = "auto", max_shard_size: Union[int, str] = "5GB",
                     progress: bool = True, plan_transform: Optional[Callable[[RankSet, list[Any]], list[Any]]] = None,
                     ) -> None:
    """Consolidate the complete (marked) checkpoint ``ckpt`` and merge the result into ``output``."""
    tmp = output.parent / f".{output.name}.consolidated-{uuid.uuid4().hex[:8]}"
    try:
        consolidate(ckpt, tmp, dtype=dtype, max_shard_size=max_shard_size, progress=progress,
                    plan_transform=plan_transform)
        merge_into(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_full_state_dict(ckpt: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """Every tensor of the model saved in ``ckpt``, full and with the original names, read one at a time."""
    ranks = open_checkpoint(ckpt)
    out = {t.name: t.read(ranks) for t in plan_outputs(ranks)}
    ranks.finish_verification(MODEL_PREFIX)
    return out
