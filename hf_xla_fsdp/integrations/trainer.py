"""XLA FSDP through transformers' ``Trainer`` flags: ``--fsdp --fsdp_config cfg.json``.

:class:`XlaFsdpTrainer` is a drop-in ``transformers.Trainer`` that reads the same
``TrainingArguments`` (an existing transformers XLA ``fsdp_config`` JSON works unchanged; our
extra keys ``meta_init``, ``sharding``, ``checkpoint_format``, ``consolidate_dtype`` and
``consolidate_max_shard_size`` are accepted) and differs from the stock XLA FSDP path in four ways:

* the model may be given as a config, a ``config.json`` or a local model directory, and is then
  built on ``meta`` and materialized, wrapped and sharded block by block (``meta_init``), so no
  process ever holds the whole model; an ``nn.Module`` is wrapped once, with our plugin;
* ``save_steps`` write our sharded rank checkpoints (model shard, optimizer, scheduler, RNG, plus
  ``trainer_state.json`` for the data position), published atomically; ``resume_from_checkpoint``
  reads only this rank's file;
* the final ``save_model`` streams the shards into a ``from_pretrained``-ready safetensors model in
  ``output_dir`` (beside the ``checkpoint-*`` directories), tokenizer and training record included;
* gradients are not all-reduced again after FSDP's reduce-scatter and clipping takes the
  norm over every shard (the accelerator is :class:`~hf_xla_fsdp.integrations.accelerate.XlaFsdpAccelerator`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn
from transformers import PretrainedConfig, Trainer, TrainerCallback, TrainingArguments

from ..engines import engine_for, engine_of, is_wrapped, unwrap
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin
from ..session.preemption import PreemptionGuard

logger = logging.getLogger(__name__)

# transformers' own decay rule (Trainer.get_decay_parameter_names), applied to the original names
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]
_FUSED_OPTIMIZERS = ("adamw_torch_fused",)


def plugin_from_training_args(args: TrainingArguments) -> XlaFsdpPlugin:
    """The plugin described by ``--fsdp --fsdp_config`` (transformers has already read the JSON)."""
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if not args.fsdp or not fsdp_config.get("xla"):
        raise ConfigError('XlaFsdpTrainer needs --fsdp and an --fsdp_config JSON with "xla": true '
                          "(e.g. examples/xla_fsdp_config.json)")
    return XlaFsdpPlugin.from_fsdp_config(fsdp_config)


def fsdp_config_from_argv(argv: Optional[list[str]] = None) -> Any:
    """The ``--fsdp_config`` value a ``HfArgumentParser`` script will read from ``argv`` (default ``sys.argv[1:]``).

    A path or a parsed inline JSON object; also the ``fsdp_config`` of a lone ``args.json`` / ``.yaml`` file
    (``parser.parse_json_file``). ``None`` when there is none.
    """
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    value: Any = None
    for i, arg in enumerate(argv):
        if arg in ("--fsdp_config", "--fsdp-config") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(("--fsdp_config=", "--fsdp-config=")):
            value = arg.split("=", 1)[1]
    if (value is None and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")) and os.path.isfile(argv[0])
            and os.path.getsize(argv[0]) < 1 << 20):  # an arguments file, not a data set
        with open(argv[0], encoding="utf-8") as f:
            if argv[0].endswith(".json"):
                data = json.load(f)
            else:
                import yaml

                data = yaml.safe_load(f)
        value = data.get("fsdp_config") if isinstance(data, dict) else None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json.loads(value)
    return value or None


def enable_spmd_if_configured(argv: Optional[list[str]] = None) -> bool:
    """Start SPMD when the command line's ``--fsdp_config`` asks for FSDP v2; returns whether it did.

    It runs by itself when this module is imported (``from hf_xla_fsdp import XlaFsdpTrainer``), which in a
    script comes before ``TrainingArguments`` exist: building them starts accelerate's process state, which
    uses the XLA device (and under multi-device XLA would count one process per device).
    """
    settings = fsdp_config_from_argv(argv)
    if settings is None:
        return False
    plugin = XlaFsdpPlugin.from_fsdp_config(settings)  # also reports a bad config before anything runs
    engine = engine_for(plugin)
    if engine.spmd:
        engine.setup_runtime(plugin)
    return engine.spmd


def _auto_spmd(fsdp_config: Any, what: str) -> None:
    """Start SPMD when ``fsdp_config`` (dict, path or inline JSON) asks for FSDP v2.

    A config that cannot be read is left for the trainer to report with the other arguments; SPMD that can no
    longer start fails here, with the one line the script needs (never a forced switch, which segfaults later).
    """
    if os.environ.get("HF_XLA_FSDP_AUTO_SPMD", "1").strip().lower() in ("0", "false", "no") or not fsdp_config:
        return
    try:
        if isinstance(fsdp_config, str) and fsdp_config.lstrip().startswith("{"):
            fsdp_config = json.loads(fsdp_config)
        engine = engine_for(XlaFsdpPlugin.from_fsdp_config(fsdp_config))
    except Exception:  # noqa: BLE001 - not ours to judge here; XlaFsdpTrainer reports it with the other arguments
        return
    if engine.spmd:
        from ..engines.v2 import enable_spmd

        enable_spmd(what=what)


def _enable_spmd_at_import() -> None:
    """The user's ``from hf_xla_fsdp import XlaFsdpTrainer`` runs before ``parse_args``: a v2 ``--fsdp_config``
    on the command line (or in a lone ``args.json``) starts SPMD now, before the script uses the XLA device."""
    try:
        settings = fsdp_config_from_argv()
    except Exception:  # noqa: BLE001
        return
    _auto_spmd(settings, "code that ran before hf_xla_fsdp's trainer was imported")


def _start_spmd_with_training_arguments() -> None:
    """``TrainingArguments`` built after this import start SPMD themselves when their fsdp_config asks for v2.

    Their ``_setup_devices`` (first read in ``__post_init__``) builds accelerate's ``PartialState``, which takes
    the XLA device and counts processes; SPMD has to be on before that, whatever way the config arrived
    (command line, JSON/YAML file, a dict in code, a ``TrainingArguments`` subclass such as TRL's configs).
    """
    original = TrainingArguments.__dict__.get("_setup_devices")
    if not isinstance(original, functools.cached_property) or getattr(original.func, "_hf_xla_fsdp", False):
        return  # another transformers layout: the argv hook and XlaFsdpTrainer's own check still apply

    def _setup_devices(self: TrainingArguments) -> torch.device:
        if getattr(self, "fsdp", None):
            _auto_spmd(getattr(self, "fsdp_config", None), "code that ran before these TrainingArguments were built")
        return original.func(self)

    _setup_devices._hf_xla_fsdp = True  # type: ignore[attr-defined]
    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(TrainingArguments, "_setup_devices")
    TrainingArguments._setup_devices = patched


def original_parameter_names(model: nn.Module) -> dict[str, str]:
    """FSDP parameter name -> the user's parameter name (a flattened group maps to its first member)."""
    return engine_of(model).original_names(model)


@contextlib.contextmanager
def _pending_save_ends() -> Iterator[None]:
    """A checkpoint still being written in the background is published (or its failure raised) before training
    returns; if training itself failed, that failure is the one raised and the save's is logged."""
    from ..checkpoint import wait_for_pending_save

    try:
        yield
    except BaseException:
        try:
            wait_for_pending_save()
        except Exception as err:
            logger.error("%s", err)
        raise
    wait_for_pending_save()


class PreemptionCallback(TrainerCallback):
    """Once SIGTERM has arrived, the step that ends saves a checkpoint and training stops (``save_on_preemption``)."""

    def __init__(self, guard: PreemptionGuard):
        self.guard = guard
        self.step: Optional[int] = None  # the step whose end saw the signal

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the step boundary after the signal: save, then stop."""
        if self.guard.received and self.step is None:
            self.step = state.global_step
            logger.warning("%s received: saving a checkpoint at step %d, then stopping", self.guard.signal_name,
                           state.global_step)
        if self.step is not None:
            control.should_save = True
            control.should_training_stop = True
        return control


class XlaFsdpTrainerMixin:
    """XLA FSDP for a ``transformers.Trainer`` or any subclass of it (TRL's trainers included).

    Put it first in the bases (``class MyTrainer(XlaFsdpTrainerMixin, SFTTrainer)``) or use
    :func:`xla_fsdp_trainer` (``xla_fsdp_trainer(SFTTrainer)``). ``model`` may be an ``nn.Module``,
    a model already built with ``XlaFsdpPlugin.build``, or a ``PretrainedConfig`` / ``config.json``
    path / local model directory, which is built on meta block by block when the fsdp_config's
    ``meta_init`` is true (the default). The outer FSDP unit is added only after the subclass's own
    ``__init__`` has finished, so whatever it does to the model (attach adapters, patch its forward,
    as TRL's fused LM head does) happens inside the unit. ``fsdp_plugin`` overrides the settings read
    from ``args.fsdp_config``.
    """

    def __init__(self, model: Union[nn.Module, PretrainedConfig, str, os.PathLike, None] = None,
                 args: Optional[TrainingArguments] = None, *trainer_args: Any,
                 fsdp_plugin: Optional[XlaFsdpPlugin] = None, **trainer_kwargs: Any) -> None:
        if args is None:
            raise ConfigError(f"{type(self).__name__} needs TrainingArguments with --fsdp and --fsdp_config "
                              "(\"xla\": true)")
        self.xla_fsdp_plugin = fsdp_plugin or plugin_from_training_args(args)
        if args.bf16 or args.fp16:  # the engine's compute dtype (before any block is wrapped), never autocast
            flag = "bf16" if args.bf16 else "fp16"
            self.xla_fsdp_plugin = self.xla_fsdp_plugin.with_mixed_precision(flag, f"TrainingArguments({flag}=True)")
        engine = engine_for(self.xla_fsdp_plugin)
        if not engine.runtime_ready(args.world_size):
            from ..engines.v2 import SPMD_TOO_LATE

            raise ConfigError(SPMD_TOO_LATE.format(what=f"TrainingArguments (accelerate's PartialState, "
                                                        f"{args.world_size} process(es) counted)"))
        engine.setup_runtime(self.xla_fsdp_plugin)  # FSDP v2: one process drives every device, before any XLA tensor
        optim = str(getattr(args.optim, "value", args.optim))
        if optim in _FUSED_OPTIMIZERS:
            # torch's fused AdamW has no XLA kernel; the same update unfused compiles into the step graph
            logger.warning("optim=%s has no XLA kernel; using adamw_torch", optim)
            args.optim = "adamw_torch"
        asked = [name for name in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, name, False)]
        if asked:
            # torch.utils.checkpoint has no XLA device module; on XLA it is checkpoint_module around every block
            logger.warning("%s=True: using XLA FSDP's activation_checkpointing (checkpoint_module around every block) "
                           "instead", asked[0])
            for name in asked:
                setattr(args, name, False)
            if not self.xla_fsdp_plugin.activation_checkpointing:
                self.xla_fsdp_plugin = dataclasses.replace(self.xla_fsdp_plugin, activation_checkpointing=True)
        if model is not None and trainer_kwargs.get("peft_config") is not None and not isinstance(model, nn.Module):
            # TRL's peft_config with a model path: adapters attached on meta, the base read block by block (never
            # whole on the host); the subclass then receives a PeftModel and attaches nothing itself
            from transformers import set_seed

            set_seed(args.seed)
            model = self.xla_fsdp_plugin.build(model, progress=args.should_log, wrap_root=False,
                                               peft_config=trainer_kwargs.pop("peft_config"))
            trainer_kwargs["peft_config"] = None
        elif model is not None:
            model = self._materialize(model, args, wrap_root=False)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if self.model is not None:
            self.model = self.model_wrapped = self._finish_wrapping(self.model)
        self._inspect_inner_model()
        # the stock XLA FSDP paths (v1 wrap in _wrap_model, v2's own ("fsdp", "tensor") mesh and batch sharding)
        # stay off: our engine wraps the model and shards the batches in the dataloaders below
        self.is_fsdp_xla_v2_enabled = self.is_fsdp_xla_v1_enabled = False

    def _finish_wrapping(self, model: nn.Module) -> nn.Module:
        """The model with its outer unit: wrapped whole when nothing is yet, else only the root added."""
        from ..engines import unit_classes
        from ..modeling.wrapping import wrap_root

        if not is_wrapped(model):
            return self.xla_fsdp_plugin.wrap(model)
        if not isinstance(model, unit_classes()):  # blocks sharded by a meta build, root left for after __init__
            return wrap_root(model, self.xla_fsdp_plugin)
        return model

    # ----------------------------------------------------------------- training, preemption-aware
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``save_on_preemption`` (and checkpoints on), SIGTERM saves ``checkpoint-N`` at the
        next step boundary, stops training, logs where it saved and exits the process with code 0."""
        from ..checkpoint import wait_for_pending_save
        from ..checkpoint.layout import latest_checkpoint

        if kwargs.get("resume_from_checkpoint") is True or (args and args[0] is True):
            # transformers picks the highest checkpoint-N; only a marked one is complete (object storage writes in place)
            latest = latest_checkpoint(self.args.output_dir)
            if latest is not None:
                kwargs["resume_from_checkpoint"], args = str(latest), args[1:]
        save_strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        guard = PreemptionGuard()
        if not (self.xla_fsdp_plugin.save_on_preemption and save_strategy != "no" and guard.install()):
            with _pending_save_ends():
                return super().train(*args, **kwargs)
        callback = PreemptionCallback(guard)
        self.add_callback(callback)
        try:
            with _pending_save_ends():
                result = super().train(*args, **kwargs)
        finally:
            guard.restore()
            self.remove_callback(callback)
        if callback.step is None:
            return result
        wait_for_pending_save()
        saved = getattr(self, "_xla_fsdp_last_checkpoint", None)
        logger.warning("%s received: saved checkpoint %s at step %d and stopped training; resume with "
                       "resume_from_checkpoint=%s", guard.signal_name, saved, self.state.global_step, saved)
        raise SystemExit(0)

    def _shard_inputs(self, loader: Any) -> Any:
        return engine_for(self.xla_fsdp_plugin).prepare_loader(loader, self.xla_fsdp_plugin)

    def get_train_dataloader(self) -> Any:
        """Trainer's loader; with FSDP v2 its batches are split over every device."""
        return self._shard_inputs(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's loader; with FSDP v2 its batches are split over every device."""
        return self._shard_inputs(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Trainer's loader; with FSDP v2 its batches are split over every device."""
        return self._shard_inputs(super().get_test_dataloader(test_dataset))

    def _transformers_model(self) -> nn.Module:
        """The transformers model inside the FSDP wrappers and, for a PEFT model, inside peft's (whose plain
        ``PeftModel.forward(*args, **kwargs)`` names no column), as the stock Trainer inspects it."""
        inner = unwrap(self.model)
        if hasattr(inner, "get_base_model") and hasattr(inner, "peft_config"):
            inner = inner.get_base_model()
        return inner

    def _inspect_inner_model(self) -> None:
        """Label names and loss support from the transformers model, not from its FSDP wrapper's class."""
        from transformers.utils import can_return_loss, find_labels

        if self.model is None:
            return
        inner = type(self._transformers_model())
        if self.args.label_names is None:
            self.label_names = find_labels(inner)
        self.can_return_loss = can_return_loss(inner)

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            # FSDP's forward(*args, **kwargs) hides the columns the model really takes
            self._signature_columns = list(inspect.signature(self._transformers_model().forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    # ----------------------------------------------------------------- the model
    def _materialize(self, model: Any, args: TrainingArguments, wrap_root: bool = True) -> nn.Module:
        from transformers import set_seed

        plugin = self.xla_fsdp_plugin
        if isinstance(model, nn.Module):
            return model if is_wrapped(model) or not wrap_root else plugin.wrap(model)
        if not isinstance(model, (PretrainedConfig, str, os.PathLike)):
            raise ConfigError(f"model must be an nn.Module, a PretrainedConfig, a config.json or a local model "
                              f"directory, not {type(model).__name__}")
        set_seed(args.seed)  # the same initial weights as building the model after set_seed in run_clm
        # the root wrap turns the KV cache off under activation checkpointing (see the engines' wrap_root)
        return plugin.build(model, progress=args.should_log, wrap_root=wrap_root)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init()``'s model (module, config or path), built and wrapped like ``model``."""
        return self._materialize(super().call_model_init(trial), self.args)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if is_wrapped(model):
            return model  # never a second FSDP wrap (the stock path would wrap again here)
        return self.xla_fsdp_plugin.wrap(model) if training else model

    # ----------------------------------------------------------------- accelerator and optimizer
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        self._accelerator_kwargs = super()._build_accelerator_args(**kwargs)
        # bf16/fp16 became the plugin's compute_dtype in __init__; accelerate's autocast would break SDPA on XLA
        self._accelerator_kwargs["mixed_precision"] = "no"
        return self._accelerator_kwargs

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator setup, with :class:`XlaFsdpAccelerator` as the accelerator."""
        from .accelerate import XlaFsdpAccelerator

        super().create_accelerator_and_postprocess()
        kwargs = dict(self._accelerator_kwargs)
        if kwargs.pop("fsdp_plugin", None) is not None:  # torch FSDP's plugin: never built for an XLA fsdp_config
            raise ConfigError("XlaFsdpTrainer got a torch FSDP plugin; use an fsdp_config with \"xla\": true")
        self.accelerator = XlaFsdpAccelerator(fsdp_plugin=self.xla_fsdp_plugin, **kwargs)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Transformers' weight-decay rule applied to the original parameter names inside FSDP units.

        A flattened group (``flatten_parameters``) is one tensor, so it decays as a whole.
        """
        if not is_wrapped(model):
            return super().get_decay_parameter_names(model)
        inner = unwrap(model)
        decay = []
        for name, orig in original_parameter_names(model).items():
            owner = orig.rsplit(".", 1)[0] if "." in orig else ""
            try:
                is_norm = isinstance(inner.get_submodule(owner), nn.LayerNorm)
            except AttributeError:
                is_norm = False
            if "flat_param" in orig or not (is_norm or any(p.search(orig.lower()) for p in _NO_DECAY)):
                decay.append(name)
        return decay

    def _raw_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    # ----------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """A sharded checkpoint-N: rank files + trainer_state.json (+ config, tokenizer), published atomically."""
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

        from ..checkpoint import save_checkpoint, wait_for_pending_save
        from ..checkpoint.consolidate import consolidate_into

        wait_for_pending_save()  # the previous checkpoint is published before this one is named and rotated
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] \
                and self.state.best_global_step:
            best = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            if best == output_dir or best.exists():
                self.state.best_model_checkpoint = str(best)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        state = copy.deepcopy(self.state)  # as of this step, whenever the files are written
        plugin = self.xla_fsdp_plugin

        def finish(stage: Path) -> None:
            """Rank 0, the rank files marked complete: trainer state and side files join before publication."""
            from transformers.trainer import TRAINER_STATE_NAME

            state.save_to_json(str(stage / TRAINER_STATE_NAME))
            self._save_side_files(stage)
            if plugin.checkpoint_format == "sharded+consolidated":
                consolidate_into(stage, stage, dtype=plugin.consolidate_dtype,
                                 max_shard_size=plugin.consolidate_max_shard_size,
                                 progress=not self.args.disable_tqdm and not plugin.async_save)

        def published(path: Path) -> None:
            """On the training thread, once the checkpoint is in place: hub upload and rotation."""
            self._xla_fsdp_last_checkpoint = str(path)
            if self.args.push_to_hub:
                self._push_from_checkpoint(str(path))
            if self.args.should_save:
                from transformers.trainer_utils import rotate_checkpoints

                rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

        save_only_model = self.args.save_only_model
        # a background save gathers through torch.distributed (thread-safe); a synchronous one through accelerate
        barrier = None if plugin.async_save else (lambda tag: self.accelerator.wait_for_everyone())
        save_checkpoint(output_dir, self.model, None if save_only_model else self._raw_optimizer(),
                        None if save_only_model else self.lr_scheduler, step=self.state.global_step,
                        plugin=plugin, extra={"trainer": True, **self._training_record()},
                        barrier=barrier, before_commit=finish, async_save=plugin.async_save,
                        after_commit=published, storage=plugin.checkpoint_storage)

    def _save_side_files(self, directory: Path) -> None:
        """config.json, generation_config.json, tokenizer and training_args.json of the run."""
        inner = unwrap(self.model)
        config = getattr(inner, "config", None)
        if config is not None:
            config.save_pretrained(str(directory))
        generation_config = getattr(inner, "generation_config", None)
        if generation_config is not None and getattr(inner, "can_generate", lambda: False)():
            generation_config.save_pretrained(str(directory))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(directory))
        (directory / "training_args.json").write_text(self.args.to_json_string())

    def _training_record(self) -> dict[str, Any]:
        """Losses of the run so far (for the consolidated model's training record and model card)."""
        losses = {str(e["step"]): float(e["loss"]) for e in self.state.log_history if "loss" in e and "step" in e}
        record: dict[str, Any] = {"losses": losses}
        evals = [e for e in self.state.log_history if "eval_loss" in e]
        if evals:
            record["eval_loss"] = float(evals[-1]["eval_loss"])
        return record

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Check ``resume_from_checkpoint`` is one of our complete checkpoints (loaded after the optimizer exists)."""
        from ..checkpoint import COMPLETE_MARKER, read_marker

        path = Path(resume_from_checkpoint)
        if not (path / COMPLETE_MARKER).is_file() and any(path.glob("rank*-of-*-pytorch_model.bin")):
            raise ConfigError(f"{path} was written by transformers' own XLA FSDP path, which XlaFsdpTrainer cannot "
                              "resume; consolidate it with `hf-xla-fsdp consolidate` and start from that model")
        read_marker(path)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """Restore this rank's model shard, optimizer and scheduler (any saved world size)."""
        from ..checkpoint import load_checkpoint

        if checkpoint is None:
            return
        load_checkpoint(checkpoint, self.model, None if self.args.save_only_model else self._raw_optimizer(),
                        None if self.args.save_only_model else self.lr_scheduler, restore_rng=False)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        from ..checkpoint import restore_rng_state

        if checkpoint is not None:
            restore_rng_state(checkpoint, self.model)

    def _load_best_model(self) -> None:
        from ..checkpoint import load_checkpoint

        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        load_checkpoint(self.state.best_model_checkpoint, self.model, restore_rng=False)

    # ----------------------------------------------------------------- the final model
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained``-ready safetensors model in ``output_dir`` (default ``args.output_dir``).

        Every rank writes its shard; the main process streams them into safetensors beside whatever
        ``output_dir`` already holds (``checkpoint-*`` stay), with config, tokenizer and training record.
        """
        from ..checkpoint.consolidate import save_consolidated

        if not is_wrapped(self.model):
            raise ConfigError("save_model needs the FSDP-wrapped model; build the trainer with a model or call train() first")
        output = Path(output_dir if output_dir is not None else self.args.output_dir)
        from ..export.peft import peft_writer

        save_consolidated(self.model, output, self.xla_fsdp_plugin, is_main=self.args.should_save,
                          step=self.state.global_step, extra=self._training_record(),
                          barrier=lambda tag: self.accelerator.wait_for_everyone(), add_files=self._save_side_files,
                          write=peft_writer(self.model, self.xla_fsdp_plugin, not self.args.disable_tqdm),
                          progress=not self.args.disable_tqdm)
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
        from ..export.hub import render_card

        if not self.is_world_process_zero():
            return
        output = Path(self.args.output_dir)
        if not (output / "config.json").is_file():
            raise ConfigError(f"{output} has no consolidated model yet; call trainer.save_model() first")
        datasets = [dataset] if isinstance(dataset, str) else (list(dataset) if dataset else None)
        name = model_name or (self.args.hub_model_id or output.name).split("/")[-1]
        card = render_card(output, model_name=name, license=license, base_model=finetuned_from, datasets=datasets,
                           load_path=self.args.hub_model_id or str(output))
        card.save(str(output / "README.md"))


class XlaFsdpTrainer(XlaFsdpTrainerMixin, Trainer):
    """A ``transformers.Trainer`` for PyTorch/XLA FSDP with meta init, sharded checkpoints and streaming saves
    (see :class:`XlaFsdpTrainerMixin`)."""


def xla_fsdp_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with XLA FSDP."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(f"xla_fsdp_trainer needs a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, XlaFsdpTrainerMixin):
        return trainer_cls
    return type(f"XlaFsdp{trainer_cls.__name__}", (XlaFsdpTrainerMixin, trainer_cls),
                {"__module__": trainer_cls.__module__, "__doc__": f"{trainer_cls.__name__} with XLA FSDP."})


_start_spmd_with_training_arguments()
_enable_spmd_at_import()

__all__ = ["PreemptionCallback", "XlaFsdpTrainer", "XlaFsdpTrainerMixin", "enable_spmd_if_configured", "fsdp_config_from_argv",
           "original_parameter_names", "plugin_from_training_args", "xla_fsdp_trainer"]
