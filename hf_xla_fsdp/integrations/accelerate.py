"""XLA FSDP through accelerate: :class:`XlaFsdpAccelerator`, an ``Accelerator`` whose models are XLA FSDP models,
so a script written for ``Accelerator`` runs with one swapped import (settings: :mod:`hf_xla_fsdp.config.accelerate_args`).

The work is its session's (:class:`~hf_xla_fsdp.session.XlaFsdpSession`): ``prepare`` wraps models and re-points
optimizers built before it; gradients are never all-reduced again after FSDP's reduce-scatter and clipping spans every
shard; ``save_state`` / ``load_state`` write and read sharded rank checkpoints; ``get_state_dict``,
``unwrap_model(model).save_pretrained`` and ``save_model`` give full weights; ``gather_object`` works on XLA
(:func:`hf_xla_fsdp.runtime.all_gather_objects`). docs/accelerate.md has the details.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from accelerate import Accelerator

from .. import runtime, upstream
from ..checkpoint.layout import ACCELERATE_PREFIX
from ..config.accelerate_args import accelerate_fsdp_off, accelerator_settings
from ..engines import is_wrapped, unit_classes
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin
from ..session import AsyncMode, XlaFsdpSession, throughput
from . import patches

upstream.require("accelerate")  # the Accelerator internals overridden below (see hf_xla_fsdp.upstream)
logger = logging.getLogger(__name__)


class XlaFsdpAccelerator(Accelerator):
    """An ``Accelerator`` whose models are XLA FSDP models configured by the accelerate YAML."""

    def __init__(self, *args: Any, fsdp_plugin: Optional[XlaFsdpPlugin] = None,
                 session: Optional[XlaFsdpSession] = None, **kwargs: Any) -> None:
        own = session is None
        if own:  # settings first: a bad fsdp_config must fail before anything else starts
            session = XlaFsdpSession(accelerator_settings(fsdp_plugin, kwargs.get("mixed_precision")))
        # mixed precision is the engine's compute dtype; accelerate's autocast stays off (it breaks SDPA on XLA)
        kwargs["mixed_precision"] = "no"
        accelerate_fsdp_off()  # the session's engine shards the models, accelerate's own FSDP would shard them again
        session.setup_runtime()  # before accelerate's state looks at the devices (FSDP v2: one process, every device)
        super().__init__(*args, **kwargs)
        patches.patch_gather_object(runtime.all_gather_objects)  # upstream raises NotImplementedError on XLA
        patches.patch_extract_model()  # accelerate's is_peft_model (TRL's LoRA reference) sees through our units
        self.xla_fsdp_session = session
        session.checkpoints.barrier = lambda tag: self.wait_for_everyone()
        if own:  # a Trainer's session has its progress setting already
            session.checkpoints.progress = self.is_main_process
        self._xla_fsdp_own_session = own  # a Trainer's accelerator: the Trainer measures throughput itself
        self._xla_fsdp_meter: Optional[throughput.Throughput] = None

    @property
    def xla_fsdp_plugin(self) -> XlaFsdpPlugin:
        """The settings of this accelerator's session."""
        return self.xla_fsdp_session.plugin

    # ----------------------------------------------------------------- preemption
    @property
    def preempted(self) -> bool:
        """True once SIGTERM has arrived (``save_on_preemption``, on by default): save_state() and stop.

        Read it at a step boundary (after ``optimizer.step()``). The first read installs the SIGTERM handler
        (main thread only), so a script that never reads it keeps SIGTERM's usual effect; a second SIGTERM
        has it too. ``end_training()`` restores the previous handler.
        """
        session = self.xla_fsdp_session
        if session.preemption is None:
            session.watch_preemption()
        return session.preempted

    def end_training(self) -> None:
        """accelerate's ``end_training`` (trackers); also waits for a checkpoint still being written in the background
        (``async_save``) and gives SIGTERM its previous handler back."""
        self.xla_fsdp_session.stop_watching_preemption()
        self.xla_fsdp_session.checkpoints.wait()
        super().end_training()

    def gather(self, tensor: Any) -> Any:
        """accelerate's ``gather``, each result held whole by every device (under SPMD a gathered tensor would stay
        sharded, and each host read of it compiles an uncached replication program)."""
        from accelerate.utils import recursively_apply

        return recursively_apply(self.xla_fsdp_session.whole, super().gather(tensor))

    # ----------------------------------------------------------------- models and optimizers
    def build_model(self, source: Any, **kwargs: Any) -> torch.nn.Module:
        """Build ``source`` (config, config.json or local model dir) on meta, block by block, wrapped."""
        return self.xla_fsdp_session.build_model(source, progress=self.is_main_process, **kwargs)

    def prepare(self, *args: Any, device_placement: Optional[list[bool]] = None) -> Any:
        """accelerate's ``prepare``; afterwards every prepared optimizer must hold only prepared models' parameters."""
        result = super().prepare(*args, device_placement=device_placement)
        self.xla_fsdp_session.ready_optimizers(self._models, [o.optimizer for o in self._optimizers])
        return result

    def _get_named_parameters(self, *args: Any, drop_refs: bool = False) -> dict[str, Any]:
        # accelerate re-maps optimizer parameters by name after XLA device placement; FSDP renames and shards
        # them (and ties share one), so that map would fail: this class re-points optimizers itself
        return {}

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Wrap ``model`` with XLA FSDP unless it already is (e.g. from :meth:`build_model`); re-point optimizers.

        ``evaluation_mode=True`` (how TRL prepares reference, teacher and reward models) shards the model for inference
        only (:meth:`hf_xla_fsdp.session.XlaFsdpSession.wrap_model`): frozen, no fp32 master copies, stored in the
        compute dtype, and never given to an optimizer (it is not one of the prepared training models).
        """
        prepared = any(m is model for m in self._models)  # Trainer prepares the same model again for eval
        if evaluation_mode:  # whole, or blocks built for inference: wrapped, or the root added
            wrapped = prepared or isinstance(model, unit_classes())  # a training model stays what it is
            return model if wrapped else self.xla_fsdp_session.finish_wrapping(model, evaluation_mode=True)
        if not is_wrapped(model):
            model = self.xla_fsdp_session.wrap_for_optimizers(model)
        if not prepared:
            self._models.append(model)
        self.xla_fsdp_session.repoint_optimizers([o.optimizer for o in self._optimizers], self._models)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """accelerate's optimizer wrapper around ``optimizer``, re-pointed at the sharded parameters where known."""
        self.xla_fsdp_session.repoint_optimizers([optimizer], self._models)
        return super().prepare_optimizer(optimizer, device_placement=False)

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's loader, adjusted by the engine (FSDP v2: every batch split over all devices on its way in), its
        batches padded to the ``pad_to_buckets`` lengths, and new graphs after warm-up logged (one line each)."""
        data_loader = self.xla_fsdp_session.pad_batches(data_loader, models=lambda: self._models)  # pad_to_buckets
        loader = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                             slice_fn_for_dispatch=slice_fn_for_dispatch)
        return throughput.observe_loader(self.xla_fsdp_session.prepare_loader(loader), self._training_meter)

    # ----------------------------------------------------------------- throughput
    def _training_meter(self) -> Optional[throughput.Throughput]:
        if self._xla_fsdp_meter is None and len(self._models) == 1 and self._xla_fsdp_own_session:
            self._xla_fsdp_meter = self.xla_fsdp_session.throughput_meter(self._models[0])
        # an evaluation loop's batches (the model in eval mode) are not training tokens
        return self._xla_fsdp_meter if self._xla_fsdp_meter is not None and self._models[0].training else None

    def throughput(self) -> dict[str, float]:
        """Tokens per second (global and per device), TFLOP/s per device, MFU where the device's peak is known, and
        the seconds per batch and the host's part of them, over the batches of the prepared data loaders since the
        previous call (:mod:`hf_xla_fsdp.session.throughput`). :meth:`log` adds them to what it logs."""
        self._training_meter()  # made on first use
        return self._xla_fsdp_meter.logs() if self._xla_fsdp_meter is not None else {}

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """accelerate's ``log`` with :meth:`throughput`'s keys added."""
        super().log({**values, **self.throughput()}, step=step, log_kwargs=log_kwargs)

    def _fsdp_model(self) -> torch.nn.Module:
        if len(self._models) != 1:
            raise ConfigError(f"expected exactly one prepared FSDP model, found {len(self._models)}")
        return self._models[0]

    # ----------------------------------------------------------------- gradients
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled for accumulation); FSDP has reduce-scattered the gradients."""
        super().backward(loss, **kwargs)
        # accelerate's XLA path would all-reduce the (already reduced) gradient shards again
        self.gradient_state.is_xla_gradients_synced = True

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip over the whole model: the norm spans the shards of every rank (see :func:`hf_xla_fsdp.train.clip_grad_norm`)."""
        model = self.xla_fsdp_session.model_of(parameters, self._models, "clip_grad_norm_")
        self.gradient_state.is_xla_gradients_synced = True
        return self.xla_fsdp_session.clip_grad_norm(model, max_norm, norm_type)

    # ----------------------------------------------------------------- checkpoints
    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self._optimizers[0].optimizer if self._optimizers else None

    def _scheduler(self) -> Any:
        return self._schedulers[0].scheduler if self._schedulers else None

    def _checkpoints_dir(self) -> Path:
        if self.project_dir is None:  # accelerate names automatic checkpoints under project_dir only
            raise ConfigError("automatic checkpoint naming needs a project directory: "
                              "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
        return Path(self.project_dir) / "checkpoints"

    def save_state(self, output_dir: Union[str, os.PathLike, None] = None, safe_serialization: bool = True, *,
                   step: Optional[int] = None, extra: Optional[dict[str, Any]] = None, **_: Any) -> str:
        """Sharded rank checkpoint of model, optimizer, scheduler, RNG, registered objects and ``extra``.

        Every process calls it. Without ``output_dir``, ``ProjectConfiguration(automatic_checkpoint_naming=True)``
        names it ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps at most ``total_limit`` of them,
        as accelerate does.
        """
        checkpoints = self.xla_fsdp_session.checkpoints
        checkpoints.wait()  # the previous save is published (and rotated) before this one is named
        config = self.project_configuration
        # naming, latest, rotation: only automatic naming has a series (an explicit output_dir stands alone)
        series = (checkpoints.series(self._checkpoints_dir(), ACCELERATE_PREFIX)
                  if config.automatic_checkpoint_naming else None)
        if output_dir is None:
            if series is None:
                raise ConfigError("save_state needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
            output_dir = series.path(self.save_iteration)
            if output_dir.exists():
                raise ConfigError(f"checkpoint directory {output_dir} already exists; set accelerator.project_configuration"
                                  ".iteration to the iteration to continue from")
        output_dir = Path(output_dir)
        step = self.step if step is None else step
        preempted = self.xla_fsdp_session.preempted

        def published(path: Path) -> None:
            if preempted:
                logger.warning("SIGTERM received: saved checkpoint %s at step %s; stop now and resume with "
                               "accelerator.load_state(%s)", path, step,
                               "" if config.automatic_checkpoint_naming else f"'{path}'")
            if series is not None and config.total_limit is not None and self.is_main_process:
                series.rotate(config.total_limit)

        # SIGTERM: this save is the last one, so it is written before save_state returns
        checkpoints.save(output_dir, self._fsdp_model(), self._optimizer(), self._scheduler(), step=step, extra=extra,
                         objects=self._custom_objects, on_published=published,
                         mode=AsyncMode.SYNC if preempted else None)
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return str(output_dir)

    def load_state(self, input_dir: Union[str, os.PathLike, None] = None, **_: Any) -> dict[str, Any]:
        """Restore what :meth:`save_state` saved (any world size); without ``input_dir``, the latest automatic one.

        Returns ``step``, ``extra``, ...; ``accelerator.step`` is restored too.
        """
        checkpoints = self.xla_fsdp_session.checkpoints
        checkpoints.wait()  # the latest automatic checkpoint may still be being written
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ConfigError("load_state needs the checkpoint directory to resume from (or automatic checkpoint naming)")
            # the highest complete one (a save killed midway is skipped); the next save never over an incomplete one
            input_dir, self.project_configuration.iteration = checkpoints.series(
                self._checkpoints_dir(), ACCELERATE_PREFIX).resume_point()
        input_dir = Path(input_dir)
        info = checkpoints.load(input_dir, self._fsdp_model(), self._optimizer(), self._scheduler(),
                                objects=self._custom_objects)
        self.step = info["step"]
        return info

    # ----------------------------------------------------------------- full weights
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict with the original parameter names, on the main process (``{}`` elsewhere).

        Every process must call it (see :meth:`hf_xla_fsdp.session.CheckpointManager.full_state_dict`).
        """
        if not is_wrapped(model):
            return super().get_state_dict(model, unwrap=unwrap)
        return self.xla_fsdp_session.checkpoints.full_state_dict(model, is_main=self.is_main_process)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The transformers model inside the FSDP units.

        Its parameters stay sharded; its ``save_pretrained`` is replaced (on this instance only) by one
        that gathers the full weights first, so the usual final save of accelerate scripts writes a
        correct ``from_pretrained``-ready directory.
        """
        if not is_wrapped(model):
            return model
        inner = self.xla_fsdp_session.unwrap(model)  # an engine that shards in place (fsdp2): the model, its shards
        self.xla_fsdp_session.checkpoints.gather_on_save_pretrained(model, inner, lambda: self.step)
        return inner

    def save_model(self, model: torch.nn.Module, save_directory: Union[str, os.PathLike],
                   max_shard_size: Union[int, str, None] = None, safe_serialization: bool = True,
                   dtype: Optional[str] = None, overwrite: bool = True, extra: Optional[dict[str, Any]] = None,
                   step: Optional[int] = None) -> None:
        """A ``from_pretrained``-ready directory: sharded save, then streaming consolidation on the main process.

        The same path as ``XlaFsdpTrainer.save_model`` (:meth:`hf_xla_fsdp.session.CheckpointManager.save_pretrained`):
        the weights of an earlier save in ``save_directory`` are replaced as a whole, other files stay
        (``overwrite`` is accepted for compatibility and changes nothing). ``extra`` (e.g.
        ``{"eval_loss": ..., "losses": {...}}``) is kept in the directory's training record, which
        ``hf-xla-fsdp export`` turns into the model card's numbers. ``dtype`` and ``max_shard_size``
        default to the plugin's ``consolidate_dtype`` / ``consolidate_max_shard_size``.
        """
        if not safe_serialization:
            raise ConfigError("hf_xla_fsdp writes safetensors only; call save_model with safe_serialization=True")
        self.xla_fsdp_session.checkpoints.save_pretrained(
            model, save_directory, is_main=self.is_main_process, step=self.step if step is None else step, extra=extra,
            dtype=dtype, max_shard_size=max_shard_size, progress=self.is_main_process)
