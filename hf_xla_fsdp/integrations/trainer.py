"""XLA FSDP through transformers' ``Trainer``: :class:`XlaFsdpTrainerMixin` (put first in any Trainer subclass's
bases, or :func:`xla_fsdp_trainer`) and :class:`XlaFsdpTrainer`.

The same ``TrainingArguments`` (``--fsdp --fsdp_config``: transformers' XLA keys or any plugin setting) drive it; the
work is its session's (:class:`~hf_xla_fsdp.session.XlaFsdpSession`, shared with its ``XlaFsdpAccelerator``): a model
given as a config, directory or Hub id (or loaded lazily by the launch) is built block by block; ``save_steps`` write
sharded rank checkpoints that resume on any world size; ``save_model`` streams a ``from_pretrained``-ready model. The
private ``Trainer`` methods it overrides are listed in :mod:`hf_xla_fsdp.upstream` (docs/trainer.md has the rest).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from .. import upstream
from ..checkpoint import read_marker
from ..checkpoint.consolidate import training_record
from ..checkpoint.layout import TRAINER_PREFIX
from ..config.training_args import trainer_settings, unfuse_optimizer
from ..engines import is_wrapped
from ..errors import ConfigError
from ..modeling.lazy import lazy_state
from ..plugin import XlaFsdpPlugin
from ..process import process_state
from ..session import XlaFsdpSession
from ..session.throughput import Throughput
from . import patches
from .trl_hooks import is_trl_trainer, model_init_sources, trl_trainer_init

upstream.require("trainer")  # the Trainer internals overridden below are there, as this module expects them
logger = logging.getLogger(__name__)


class XlaFsdpCallback(TrainerCallback):
    """The session's part of each optimizer step: the step timed for the throughput keys every training log gets
    (:mod:`hf_xla_fsdp.session.throughput`) and, once SIGTERM has arrived during a ``train()`` that watches it
    (``save_on_preemption``, checkpoints on), a checkpoint saved at the end of that step and training stopped. The
    trainer puts it last among its callbacks at each ``train()``, so its save-and-stop is a step's final word."""

    def __init__(self, session: XlaFsdpSession):
        self.session = session
        self.meter: Optional[Throughput] = None
        self.watching = False  # set by train(): SIGTERM is watched during it
        self.preempted_at: Optional[int] = None  # the step whose end saw the signal

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        """The model is wrapped: size its FLOPs, read the devices."""
        self.meter, self.preempted_at = self.session.throughput_meter(model), None

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        """The host starts tracing a step."""
        if self.meter is not None:
            self.meter.step_begin()

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        """The step is traced (the device runs it while the next one is traced); after SIGTERM: save, then stop."""
        if self.meter is not None:
            self.meter.step_end()
        if self.watching and self.session.preempted and self.preempted_at is None:
            self.preempted_at = state.global_step
            logger.warning("%s received: saving a checkpoint at step %d, then stopping",
                           self.session.preemption.signal_name, state.global_step)
        if self.preempted_at is not None:
            control.should_save = control.should_training_stop = True
        return control


class XlaFsdpTrainerMixin:
    """XLA FSDP for a ``transformers.Trainer`` or any subclass of it (TRL's trainers included).

    Put it first in the bases (``class MyTrainer(XlaFsdpTrainerMixin, SFTTrainer)``) or use
    :func:`xla_fsdp_trainer` (``xla_fsdp_trainer(SFTTrainer)``). ``model`` may be an ``nn.Module``,
    a model already built with ``XlaFsdpPlugin.build``, or a ``PretrainedConfig`` / ``config.json``
    path / local model directory, which is built on meta block by block when the fsdp_config's
    ``meta_init`` is true (the default). The outer FSDP unit is added only after the subclass's own
    ``__init__`` has finished, so whatever it does to the model (attach adapters, patch its forward,
    as TRL's fused LM head does) happens inside the unit. The settings are resolved by the one conflict rule
    (:mod:`hf_xla_fsdp.config.resolve`) from ``fsdp_plugin``, ``args`` (``fsdp_config``, ``bf16``/``fp16``,
    ``gradient_checkpointing``) and, in a launched script, the launch's settings.
    """

    def __init__(self, *args: Any, fsdp_plugin: Optional[XlaFsdpPlugin] = None, **kwargs: Any) -> None:
        # the arguments as the subclass's own __init__ takes them (DPOTrainer(model, ref_model, args, ...),
        # GRPOTrainer(model, reward_funcs, args, ...)), bound by name: the model and the arguments are found wherever
        # that signature puts them, and everything is handed on in the same form
        bound = trainer_arguments(type(self), args, kwargs)
        params = bound.arguments
        training_args, model = params.get("args"), params.get("model")
        if training_args is None:
            raise ConfigError(f"{type(self).__name__} needs TrainingArguments (or a TRL config) with --fsdp and "
                              "--fsdp_config (\"xla\": true)")
        trl = is_trl_trainer(type(self))
        by_path = model is not None and not isinstance(model, nn.Module)
        # TRL's model_init_kwargs dtype is one more settings source when TRL builds the policy (by the one rule)
        extra = model_init_sources(training_args) if trl and by_path else []
        session = self.xla_fsdp_session = XlaFsdpSession(trainer_settings(training_args, fsdp_plugin, extra))
        if not session.engine.fused_optimizers:
            unfuse_optimizer(training_args)
        session.checkpoints.progress = not training_args.disable_tqdm
        session.step_source = lambda: self.state.global_step  # named when a new graph compiles late
        session.setup_runtime(
            counted_processes=training_args.world_size,
            what=f"TrainingArguments (accelerate's PartialState, {training_args.world_size} process(es) counted)")
        if model is not None and not (trl and by_path):  # TRL builds a policy given by path itself (trl_hooks)
            # a peft_config with a model path (or a model loaded lazily): adapters attached on meta, the base read block
            # by block (never whole on the host); the subclass then receives a PeftModel and attaches nothing itself
            peft = params.get("peft_config") if by_path or lazy_state(model) is not None else None
            params["model"] = session.materialize(model, seed=training_args.seed, progress=training_args.should_log,
                                                  wrap_root=False, peft_config=peft)
            if peft is not None:
                params["peft_config"] = None
        self._xla_fsdp_callback = XlaFsdpCallback(session)  # tokens/s, MFU and host time in every training log
        # the models a TRL trainer builds by path (the policy, reference, reward models) are built by the session
        with trl_trainer_init(self, bound, session, training_args, by_path=by_path) if trl \
                else contextlib.nullcontext():
            super().__init__(*bound.args, **bound.kwargs)
        if self.model is not None:
            self.model = self.model_wrapped = session.finish_wrapping(self.model)
        if trl:  # GRPO / RLOO: rollouts generate in fixed shapes (integrations/rollout.py)
            from .rollout import install

            install(self)
        self._inspect_inner_model()
        # the stock XLA FSDP paths (v1 wrap in _wrap_model, v2's own ("fsdp", "tensor") mesh and batch sharding)
        # stay off: our session wraps the model, and our accelerator shards the batches in the dataloaders
        self.is_fsdp_xla_v2_enabled = self.is_fsdp_xla_v1_enabled = False

    @property
    def xla_fsdp_plugin(self) -> XlaFsdpPlugin:
        """The settings of this trainer's session."""
        return self.xla_fsdp_session.plugin

    # ----------------------------------------------------------------- training, preemption-aware
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``save_on_preemption`` (and checkpoints on), SIGTERM saves ``checkpoint-N`` at the
        next step boundary, stops training, logs where it saved and exits the process with code 0."""
        session = self.xla_fsdp_session
        if kwargs.get("resume_from_checkpoint") is True or (args and args[0] is True):
            # transformers picks the highest checkpoint-N; only a marked one is complete (object storage writes in place)
            latest = session.checkpoints.series(self.args.output_dir, TRAINER_PREFIX).latest()
            if latest is not None:
                kwargs["resume_from_checkpoint"], args = str(latest), args[1:]
        callback = self._xla_fsdp_callback
        self.pop_callback(callback)  # last in line (see XlaFsdpCallback)
        self.add_callback(callback)
        save_strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        callback.watching = save_strategy != "no" and session.watch_preemption()
        try:
            with session.checkpoints.pending_saves_end():
                result = super().train(*args, **kwargs)
        finally:
            if callback.watching:
                session.stop_watching_preemption()
        if callback.preempted_at is None:
            return result
        session.checkpoints.wait()
        saved = getattr(self, "_xla_fsdp_last_checkpoint", None)
        logger.warning("%s received: saved checkpoint %s at step %d and stopped training; resume with "
                       "resume_from_checkpoint=%s", session.preemption.signal_name, saved, self.state.global_step, saved)
        raise SystemExit(0)

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Trainer.training_step``. The running loss ``_tr_loss`` the Trainer adds each step's loss to is made
        before training as a plain device tensor; annotated like a step's output, step 2 runs step 1's graph."""
        running = getattr(self, "_tr_loss", None)
        if isinstance(running, torch.Tensor):
            self.xla_fsdp_session.like_step_output(running)
        if self._xla_fsdp_callback.meter is not None:
            self._xla_fsdp_callback.meter.batch(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``; a training log (one with the running ``loss``) gets the throughput keys of the steps since
        the previous one (:mod:`hf_xla_fsdp.session.throughput`)."""
        meter = self._xla_fsdp_callback.meter
        if meter is not None and "loss" in logs:
            logs.update(meter.logs())
        super().log(logs, *args, **kwargs)

    def _inspect_inner_model(self) -> None:
        """Label names and loss support from the transformers model, not from its FSDP wrapper's class."""
        from transformers.utils import can_return_loss, find_labels

        if self.model is None:
            return
        inner = type(self.xla_fsdp_session.transformers_model(self.model))
        if self.args.label_names is None:
            self.label_names = find_labels(inner)
        self.can_return_loss = can_return_loss(inner)

    def _set_signature_columns_if_needed(self) -> None:
        if _defined_below(type(self), "_set_signature_columns_if_needed") is not Trainer:
            return super()._set_signature_columns_if_needed()  # the subclass's own columns (TRL's: its datasets')
        if self._signature_columns is None:
            # FSDP's forward(*args, **kwargs) hides the columns the model really takes
            inner = self.xla_fsdp_session.transformers_model(self.model)
            self._signature_columns = list(inspect.signature(inner.forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    # ----------------------------------------------------------------- the model
    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init()``'s model (module, config or path), built and wrapped like ``model``."""
        return self.xla_fsdp_session.materialize(super().call_model_init(trial), seed=self.args.seed,
                                                 progress=self.args.should_log)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if is_wrapped(model):
            return model  # never a second FSDP wrap (the stock path would wrap again here)
        return self.xla_fsdp_session.wrap_model(model) if training else model

    # ----------------------------------------------------------------- accelerator and optimizer
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # the session shards the model: torch FSDP's plugin (built by transformers from --fsdp without "xla": true,
        # e.g. for engine fsdp2) would have accelerate shard it a second time
        kwargs.pop("fsdp_plugin", None)
        self._accelerator_kwargs = super()._build_accelerator_args(**kwargs)
        # bf16/fp16 became the plugin's compute_dtype in __init__; accelerate's autocast would break SDPA on XLA
        self._accelerator_kwargs["mixed_precision"] = "no"
        return self._accelerator_kwargs

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator setup, with :class:`XlaFsdpAccelerator` (on this trainer's session) as the accelerator
        (the base class's own stays stock, also in a launched script)."""
        from .accelerate import XlaFsdpAccelerator

        with patches.stock_accelerator():
            super().create_accelerator_and_postprocess()
        kwargs = dict(self._accelerator_kwargs)
        self.accelerator = XlaFsdpAccelerator(session=self.xla_fsdp_session, **kwargs)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Transformers' weight-decay rule applied to the original parameter names inside FSDP units."""
        if not is_wrapped(model):
            return super().get_decay_parameter_names(model)
        return self.xla_fsdp_session.decay_parameter_names(model)

    def _raw_optimizer(self) -> Any:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    # ----------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """A sharded checkpoint-N: rank files + trainer_state.json (+ config, tokenizer; for a PEFT model peft's
        adapter files, as in a stock checkpoint-N), published atomically."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        checkpoints = self.xla_fsdp_session.checkpoints
        checkpoints.wait()  # the previous checkpoint is published before this one is named and rotated
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        series = checkpoints.series(run_dir, TRAINER_PREFIX)  # the one policy: naming, latest, rotation
        output_dir = series.path(self.state.global_step)
        if self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] \
                and self.state.best_global_step:
            best = series.path(self.state.best_global_step)
            if best == output_dir or best.exists():
                self.state.best_model_checkpoint = str(best)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        state = copy.deepcopy(self.state)  # as of this step, whenever the files are written

        def side_files(stage: Path) -> None:
            state.save_to_json(str(stage / TRAINER_STATE_NAME))
            self._save_side_files(stage)

        def published(path: Path) -> None:
            """On the training thread, once the checkpoint is in place: hub upload and rotation."""
            self._xla_fsdp_last_checkpoint = str(path)
            if self.args.push_to_hub:
                self._push_from_checkpoint(str(path))
            if self.args.should_save:
                series.rotate(self.args.save_total_limit, protect=[self.state.best_model_checkpoint])

        only_model = self.args.save_only_model
        checkpoints.save(output_dir, self.model, None if only_model else self._raw_optimizer(),
                         None if only_model else self.lr_scheduler, step=self.state.global_step,
                         extra={"trainer": True, **training_record(self.state.log_history)}, side_files=side_files,
                         on_published=published, adapters=True)

    def _save_side_files(self, directory: Path) -> None:
        """The model's config files and tokenizer (:meth:`~hf_xla_fsdp.session.CheckpointManager.write_model_files`)
        and training_args.json. The tokenizer is the ``processing_class`` or, without one, the data collator's
        ``tokenizer`` (as the stock ``Trainer._save`` falls back to it)."""
        processor = self.processing_class
        if processor is None:
            processor = getattr(self.data_collator, "tokenizer", None)
        self.xla_fsdp_session.checkpoints.write_model_files(directory, self.model, processor)
        (directory / "training_args.json").write_text(self.args.to_json_string())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Check ``resume_from_checkpoint`` is one of our complete checkpoints (loaded after the optimizer exists)."""
        read_marker(Path(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """Restore this rank's model shard, optimizer and scheduler (any saved world size)."""
        if checkpoint is None:
            return
        only_model = self.args.save_only_model
        self.xla_fsdp_session.checkpoints.load(checkpoint, self.model, None if only_model else self._raw_optimizer(),
                                               None if only_model else self.lr_scheduler, restore_rng=False)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is not None:
            self.xla_fsdp_session.checkpoints.restore_rng(checkpoint, self.model)

    def _load_best_model(self) -> None:
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        self.xla_fsdp_session.checkpoints.load(self.state.best_model_checkpoint, self.model, restore_rng=False)

    # ----------------------------------------------------------------- the final model
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained``-ready safetensors model in ``output_dir`` (default ``args.output_dir``).

        Every rank writes its shard; the main process streams them into safetensors beside whatever
        ``output_dir`` already holds (``checkpoint-*`` stay), with config, tokenizer and training record.
        """
        if not is_wrapped(self.model):
            raise ConfigError("save_model needs the FSDP-wrapped model; build the trainer with a model or call train() first")
        output = Path(output_dir if output_dir is not None else self.args.output_dir)
        self.xla_fsdp_session.checkpoints.save_pretrained(
            self.model, output, is_main=self.args.should_save, step=self.state.global_step,
            extra=training_record(self.state.log_history), side_files=self._save_side_files, progress=not self.args.disable_tqdm)
        if self.args.should_save:
            (output / "training_args.json").write_text(self.args.to_json_string())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, language: Optional[str] = None, license: Optional[str] = None,
                          tags: Union[str, list[str], None] = None, model_name: Optional[str] = None,
                          finetuned_from: Optional[str] = None, tasks: Any = None,
                          dataset_tags: Any = None, dataset: Union[str, list[str], None] = None,
                          dataset_args: Any = None) -> None:
        """README.md for ``output_dir`` from our model card template and the saved training record."""
        from ..export.hub import write_card

        if self.is_world_process_zero():
            write_card(Path(self.args.output_dir), model_name=model_name, license=license, base_model=finetuned_from,
                       datasets=dataset, load_path=self.args.hub_model_id)


def _below_mixin(trainer_cls: type) -> tuple[type, ...]:
    """``trainer_cls``'s MRO after :class:`XlaFsdpTrainerMixin` (the user's and the library's own classes)."""
    mro = trainer_cls.__mro__
    return mro[mro.index(XlaFsdpTrainerMixin) + 1:] if XlaFsdpTrainerMixin in mro else mro


def _defined_below(trainer_cls: type, name: str) -> Optional[type]:
    """The first class after :class:`XlaFsdpTrainerMixin` in ``trainer_cls``'s MRO that defines ``name``."""
    return next((cls for cls in _below_mixin(trainer_cls) if name in cls.__dict__), None)


def trainer_arguments(trainer_cls: type, args: tuple, kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``args`` and ``kwargs`` bound to the signature of the ``__init__`` ``trainer_cls``'s own classes define (after
    our mixins; ``self`` excluded): the first one that names its parameters, passing over subclasses that only forward
    ``*args, **kwargs``. A call that does not fit that signature fails as the subclass itself would (``TypeError``)."""
    inits = (list(inspect.signature(cls.__dict__["__init__"]).parameters.values())[1:]
             for cls in _below_mixin(trainer_cls) if "__init__" in cls.__dict__)
    params = next((p for p in inits if any(q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) for q in p)), None)
    if params is None:
        raise ConfigError(f"{trainer_cls.__name__} defines no __init__ that names its parameters")
    try:
        return inspect.Signature(params).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{trainer_cls.__name__}.__init__() {err}") from None


class XlaFsdpTrainer(XlaFsdpTrainerMixin, Trainer):
    """A ``transformers.Trainer`` for PyTorch/XLA FSDP with meta init, sharded checkpoints and streaming saves
    (see :class:`XlaFsdpTrainerMixin`)."""


def xla_fsdp_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with XLA FSDP: the same class
    with :class:`XlaFsdpTrainerMixin` first, made once per class (``XlaFsdpTrainer`` for ``Trainer``). The one way a
    Trainer gets XLA FSDP: ``XlaFsdpSFTTrainer`` and a launched script's Trainer classes are made here."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(f"xla_fsdp_trainer needs a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, XlaFsdpTrainerMixin):
        return trainer_cls
    made = process_state().trainer_classes
    if trainer_cls not in made:
        made[trainer_cls] = XlaFsdpTrainer if trainer_cls is Trainer else type(
            f"XlaFsdp{trainer_cls.__name__}", (XlaFsdpTrainerMixin, trainer_cls),
            {"__module__": trainer_cls.__module__, "__doc__": f"{trainer_cls.__name__} with XLA FSDP."})
    return made[trainer_cls]


patches.patch_training_arguments()  # the one-line swap: TrainingArguments ready the runtime for their settings first

__all__ = ["XlaFsdpCallback", "XlaFsdpTrainer", "XlaFsdpTrainerMixin", "trainer_arguments", "xla_fsdp_trainer"]
