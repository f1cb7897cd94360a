"""The session's checkpointing: one place for what every entry point does around the file protocol.

:mod:`hf_xla_fsdp.checkpoint` writes and reads rank files (the protocol, the storage backends, consolidation);
:class:`CheckpointManager` decides how a run uses them: synchronous or background saves (:class:`AsyncMode`), who
waits for whom, publication hooks, the checkpoint policy (naming, the latest complete checkpoint, rotation:
:class:`~hf_xla_fsdp.checkpoint.layout.CheckpointSeries`), the final ``from_pretrained``-ready save (streaming
consolidation, or peft's adapter files for a PEFT model) and the full state dict. ``XlaFsdpTrainer`` and
``XlaFsdpAccelerator`` both go through it.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence, Union

import torch
from torch import nn

from ..checkpoint import load_checkpoint, restore_rng_state, save_checkpoint, wait_for_pending_save
from ..checkpoint.layout import CheckpointSeries
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..engines.base import Engine
    from ..plugin import XlaFsdpPlugin


class Owner(Protocol):
    """What the checkpoint side reads of the session that owns it (an ``XlaFsdpSession``, which holds this object:
    typed by what is read, so this module never names the session's)."""

    plugin: "XlaFsdpPlugin"
    engine: "Engine"

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the FSDP units."""

PathLike = Union[str, os.PathLike]
_OBJECT_PREFIX = "custom_checkpoint_"  # accelerate's file names for registered objects' states
_OWN_SAVE = "_hf_xla_fsdp_save_pretrained"  # marks a model whose save_pretrained gathers first


class AsyncMode(enum.Enum):
    """How a save shares time with training."""

    #: the step waits until the checkpoint is published
    SYNC = "sync"
    #: the step waits only for the copy of this rank's state to host memory; writing and publishing run in a
    #: background thread, and the next save, a load and the end of training wait for it
    ASYNC = "async"


class CheckpointManager:
    """Saves, loads, rotates and exports the checkpoints of one session's models (see the module docstring).

    ``barrier(tag)`` is how the processes of a synchronous save meet (an accelerator's ``wait_for_everyone``); a
    background save never uses it (XLA collectives belong to the training thread) and meets through
    torch.distributed instead.
    """

    def __init__(self, session: Owner, barrier: Optional[Callable[[str], None]] = None) -> None:
        self.session = session
        self.barrier = barrier
        self.mode = AsyncMode.ASYNC if session.plugin.async_save else AsyncMode.SYNC
        #: progress bars for consolidations (the integrations set it from ``disable_tqdm`` / the main process)
        self.progress = True
        self._full_state_dicts = 0  # names each full_state_dict's temporary checkpoint alike on every process

    # ----------------------------------------------------------------- sharded checkpoints
    def save(self, directory: PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             scheduler: Any = None, *, step: int, extra: Optional[dict[str, Any]] = None,
             side_files: Optional[Callable[[Path], None]] = None, on_published: Optional[Callable[[Any], None]] = None,
             mode: Optional[AsyncMode] = None, adapters: bool = False, objects: Sequence[Any] = ()) -> Union[str, Path]:
        """A sharded checkpoint of ``model`` (and optimizer, scheduler) in ``directory``, published atomically.

        Every process calls it. ``side_files(dir)`` adds files beside the rank files before publication (rank 0);
        ``on_published(path)`` runs on the calling thread once the checkpoint is in place: at once for a synchronous
        save, when it is waited for otherwise. ``mode`` overrides the plugin's (e.g. the last save before a
        preemption is always synchronous). ``adapters``: for a PEFT model, peft's adapter files join the rank
        files, so ``PeftModel.from_pretrained(base, directory)`` loads the checkpoint as it loads a stock
        Trainer's ``checkpoint-N`` (the rank files stay for an exact resume). With ``checkpoint_format
        "sharded+consolidated"`` a PEFT model's consolidated copy is its adapter files, even with ``merge_adapters``
        (which applies to the final save): a merged model beside adapter files would have ``from_pretrained(dir)``
        apply the adapters a second time. ``objects``: anything with ``state_dict()`` (accelerate's registered objects),
        their states taken now and written as ``custom_checkpoint_<i>.pkl``, accelerate's names.
        """
        from ..checkpoint.consolidate import consolidate_into

        mode = mode or self.mode
        plugin = self.session.plugin
        peft = self.is_peft(model)
        consolidated = plugin.checkpoint_format == "sharded+consolidated"
        progress = self.progress and mode is AsyncMode.SYNC
        states = copy.deepcopy([obj.state_dict() for obj in objects])  # as of now, even if written later

        def before_commit(stage: Path) -> None:
            """Rank 0, every rank file marked complete: side files (adapter files, a consolidated copy) join
            before publication."""
            if side_files is not None:
                side_files(stage)
            for index, state in enumerate(states):  # read back with weights_only=True
                torch.save(state, stage / f"{_OBJECT_PREFIX}{index}.pkl")
            if peft and (adapters or consolidated):
                self._write_peft(stage, stage, progress, merge=False)
            elif consolidated:
                consolidate_into(stage, stage, dtype=plugin.consolidate_dtype,
                                 max_shard_size=plugin.consolidate_max_shard_size, progress=progress)

        return save_checkpoint(directory, model, optimizer, scheduler, step=step, plugin=plugin, extra=extra,
                               barrier=self.barrier if mode is AsyncMode.SYNC else None, before_commit=before_commit,
                               async_save=mode is AsyncMode.ASYNC, after_commit=on_published,
                               storage=plugin.checkpoint_storage)

    def _save_shards(self, directory: Path, model: nn.Module, *, step: int,
                     extra: Optional[dict[str, Any]] = None) -> None:
        """A temporary sharded save (of the final weights, of a state dict): synchronous, the plain layout."""
        save_checkpoint(directory, model, step=step, plugin=self.session.plugin, extra=extra, barrier=self.barrier)

    def load(self, directory: PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             scheduler: Any = None, *, restore_rng: bool = True, objects: Sequence[Any] = ()) -> dict[str, Any]:
        """Restore this rank's model shard (optimizer, scheduler, RNG) from ``directory``, any saved world size, and
        the states of ``objects`` (as :meth:`save` wrote them)."""
        info = load_checkpoint(directory, model, optimizer, scheduler, restore_rng=restore_rng)
        for index, obj in enumerate(objects):
            path = Path(directory) / f"{_OBJECT_PREFIX}{index}.pkl"
            if not path.is_file():
                raise ConfigError(f"{directory} holds no state for registered object {index} ({type(obj).__name__})")
            obj.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return info

    @staticmethod
    def restore_rng(directory: PathLike, model: nn.Module) -> None:
        """Restore the RNG states this rank saved in ``directory``."""
        restore_rng_state(directory, model)

    @staticmethod
    def wait() -> Optional[Union[str, Path]]:
        """Wait for the background save in flight (if any) and raise its failure; its directory, or None."""
        return wait_for_pending_save()

    @contextlib.contextmanager
    def pending_saves_end(self) -> Iterator[None]:
        """On leaving, a checkpoint still being written in the background is published (or its failure raised); if
        the body failed, that failure is the one raised and the save's is logged."""
        import logging

        try:
            yield
        except BaseException:
            try:
                self.wait()
            except Exception as err:
                logging.getLogger(__name__).error("%s", err)
            raise
        self.wait()

    @staticmethod
    def series(root: PathLike, prefix: str) -> CheckpointSeries:
        """The numbered checkpoints ``<root>/<prefix><N>`` of a run: naming, the latest complete one, rotation (one
        policy for the Trainer and accelerate, see :class:`~hf_xla_fsdp.checkpoint.layout.CheckpointSeries`)."""
        return CheckpointSeries(root, prefix)

    @staticmethod
    def numbered(root: PathLike, prefix: str) -> list[Path]:
        """``<prefix><N>`` directories under ``root``, complete or not, oldest (lowest N) first."""
        return CheckpointSeries(root, prefix).numbered()

    def rotate(self, root: PathLike, prefix: str, keep: Optional[int], protect: Any = ()) -> list[Path]:
        """Keep at most ``keep`` complete ``<prefix><N>`` checkpoints under ``root`` (never the newest one, nor those in
        ``protect``; incomplete ones neither count nor go); call on the main process. Returns what it deleted."""
        return CheckpointSeries(root, prefix).rotate(keep, protect)

    # ----------------------------------------------------------------- from_pretrained-ready outputs
    def save_pretrained(self, model: nn.Module, output: PathLike, *, is_main: bool, step: int = 0,
                        extra: Optional[dict[str, Any]] = None, side_files: Optional[Callable[[Path], None]] = None,
                        dtype: Optional[str] = None, max_shard_size: Union[int, str, None] = None,
                        progress: bool = True) -> Path:
        """A ``from_pretrained``-ready directory from a wrapped model: every process saves its shard, then the main
        process streams them into safetensors merged into ``output`` (for a PEFT model: peft's adapter files, or the
        merged model with the plugin's ``merge_adapters``). Every process calls it.

        ``output`` may already hold other things (``checkpoint-*`` directories, logs): they stay; weight files of an
        earlier save are replaced as a whole. ``side_files(dir)`` adds files (config, tokenizer, ...) next to the
        shards before consolidation, which copies them. ``dtype`` and ``max_shard_size`` default to the plugin's
        ``consolidate_dtype`` / ``consolidate_max_shard_size``.
        """
        from ..checkpoint.consolidate import consolidate_into

        plugin = self.session.plugin
        output = Path(output)
        shards = output.parent / f".{output.name}.sharded-{step}"  # the same name on every rank, no coordination
        self._save_shards(shards, model, step=step, extra=extra)
        if is_main:
            try:
                if side_files is not None:
                    side_files(shards)
                if self.is_peft(model):
                    self._write_peft(shards, output, progress, merge=plugin.merge_adapters)
                else:
                    consolidate_into(shards, output, dtype=dtype or plugin.consolidate_dtype,
                                     max_shard_size=max_shard_size or plugin.consolidate_max_shard_size,
                                     progress=progress)
            finally:
                shutil.rmtree(shards, ignore_errors=True)
        if self.barrier is not None:
            self.barrier("hf_xla_fsdp.save_consolidated.done")
        return output

    def write_model_files(self, directory: Path, model: nn.Module, processor: Any = None) -> None:
        """What a stock save writes beside the weights: ``config.json`` (not for a PEFT model, as peft's own save:
        beside adapter files it would make ``from_pretrained(dir)`` look for the full model's weights there),
        ``generation_config.json`` of a model that generates, and the tokenizer or processor."""
        inner = self.session.unwrap(model)
        config = getattr(inner, "config", None)
        if config is not None and not self.is_peft(model):
            config.save_pretrained(str(directory))
        generation_config = getattr(inner, "generation_config", None)
        if generation_config is not None and getattr(inner, "can_generate", lambda: False)():
            generation_config.save_pretrained(str(directory))
        if processor is not None:
            processor.save_pretrained(str(directory))

    def is_peft(self, model: nn.Module) -> bool:
        """True for a PEFT model (adapters inside the FSDP units)."""
        from ..export.peft import is_peft_model

        return is_peft_model(self.session.engine.unwrap(model))

    def _write_peft(self, ckpt: Path, output: Path, progress: bool, *, merge: bool) -> None:
        """A PEFT model's ``from_pretrained``-ready files from the sharded checkpoint ``ckpt``, merged into ``output``:
        peft's adapter files (only the adapter tensors are read), or with ``merge`` the merged full model."""
        from ..checkpoint.consolidate import consolidate_into, load_config
        from ..checkpoint.readers import open_checkpoint
        from ..export.peft import consolidate_adapters, merged_outputs

        plugin = self.session.plugin
        if merge:
            consolidate_into(ckpt, output, dtype=plugin.consolidate_dtype, max_shard_size=plugin.consolidate_max_shard_size,
                             progress=progress, plan_transform=merged_outputs)
        else:
            ranks = open_checkpoint(ckpt)
            # the side files (tokenizer, ...) are already there when the adapters join their own checkpoint
            consolidate_adapters(ranks, load_config(None, ranks), output,
                                 side_sources=[] if output == ckpt else [ckpt])

    def full_state_dict(self, model: nn.Module, *, is_main: bool) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict with the original names on the main process (``{}`` elsewhere).

        Every process calls it, as many times as the others. Each rank's shard goes to a temporary sharded
        checkpoint that the main process reads back tensor by tensor (``HF_XLA_FSDP_TMPDIR`` picks where; it must
        be visible to every process of the run).
        """
        from ..checkpoint.consolidate import read_full_state_dict

        self._full_state_dicts += 1
        call = self._full_state_dicts
        root = Path(os.environ.get("HF_XLA_FSDP_TMPDIR") or tempfile.gettempdir())
        # the same name on every process of this run without communication: the launcher's pid and a counter
        launcher = os.getppid() if self.session.engine.multi_process() else os.getpid()
        tmp = root / f"hf_xla_fsdp-state-{launcher}-{call}"
        try:
            self._save_shards(tmp, model, step=0)
            return read_full_state_dict(tmp) if is_main else {}
        finally:
            if self.barrier is not None:
                self.barrier("hf_xla_fsdp.state_dict.read")
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)

    def save_pretrained_through(self, model: nn.Module, write: Callable[[Path, dict[str, torch.Tensor]], None],
                                save_directory: PathLike, *, is_main: bool, step: int,
                                state_dict: Optional[dict[str, torch.Tensor]] = None) -> None:
        """The model class's own ``save_pretrained`` for a wrapped model (accelerate scripts' final save):
        ``write(stage, full_state_dict)`` into a staging directory merged into ``save_directory``. Every process
        calls it. A PEFT model without a ``state_dict`` saves its adapters only (the base is never read back); a
        ``state_dict`` of another model, or an empty one on the main process, is refused before anything is written.
        """
        if state_dict is None and self.is_peft(model):
            self.save_pretrained(model, save_directory, is_main=is_main, step=step)
            return
        if state_dict is None:
            state_dict = self.full_state_dict(model, is_main=is_main)  # every process takes part
        elif is_main and not state_dict:
            raise ConfigError("save_pretrained got an empty state_dict on the main process; pass "
                              "state_dict=accelerator.get_state_dict(model) from every process")
        if is_main:
            if not self.is_peft(model):  # peft selects its own tensors from the full state dict
                self.check_state_dict(self.session.unwrap(model), state_dict)
            self.staged_directory(save_directory, lambda stage: write(stage, state_dict))
        if self.barrier is not None:
            self.barrier("hf_xla_fsdp.save_pretrained.done")

    def gather_on_save_pretrained(self, model: nn.Module, inner: nn.Module, step: Callable[[], int]) -> None:
        """``inner.save_pretrained`` (``inner``: the transformers model inside the wrapped ``model``, its parameters
        shards) replaced, on this instance only, by :meth:`save_pretrained_through` with the class's own method, so an
        accelerate script's usual final save writes a correct ``from_pretrained``-ready directory."""
        if not hasattr(inner, "save_pretrained") or getattr(inner, _OWN_SAVE, False):
            return
        original = type(inner).save_pretrained

        def save_pretrained(save_directory: PathLike, *args: Any, is_main_process: bool = True,
                            state_dict: Optional[dict[str, torch.Tensor]] = None, **kwargs: Any) -> None:
            self.save_pretrained_through(
                model, lambda stage, full: original(inner, str(stage), *args, is_main_process=True, state_dict=full,
                                                    **kwargs),
                save_directory, is_main=is_main_process, step=step(), state_dict=state_dict)

        inner.save_pretrained = save_pretrained
        setattr(inner, _OWN_SAVE, True)

    @staticmethod
    def staged_directory(save_directory: PathLike, write: Callable[[Path], None]) -> None:
        """``write(stage)`` into a staging directory beside ``save_directory``, then merged into it (the main
        process only): a failed save leaves ``save_directory`` as it was."""
        from ..checkpoint.layout import merge_into

        save_directory = Path(save_directory)
        save_directory.parent.mkdir(parents=True, exist_ok=True)
        stage = save_directory.parent / f".{save_directory.name}.save-{uuid.uuid4().hex[:8]}"
        try:
            write(stage)
            merge_into(stage, save_directory)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    @staticmethod
    def check_state_dict(inner: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Refuse a state dict of another model before anything is written."""
        from ..checkpoint.consolidate import expected_tensors

        config = getattr(inner, "config", None)
        if config is None:
            return
        expected, tied = expected_tensors(config)
        problems = [f"{k} is not in {type(inner).__name__}" for k in state_dict if k not in expected]
        problems += [f"{k} is missing" for k in expected if k not in state_dict and k not in tied]
        problems += [f"{k} has shape {list(v.shape)}, the model {list(expected[k])}" for k, v in state_dict.items()
                     if k in expected and tuple(v.shape) != tuple(expected[k])]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ConfigError(f"the state_dict does not belong to this model: {'; '.join(problems[:3])}{more}")
