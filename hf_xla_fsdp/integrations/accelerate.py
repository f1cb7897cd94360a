"""XLA FSDP through ``accelerate launch --config_file xla_fsdp.yaml``.

With ``distributed_type: XLA`` accelerate runs the script's ``main()`` through ``xmp.spawn`` and
passes none of the YAML's ``fsdp_config:`` settings on. :func:`find_accelerate_config` finds the
YAML itself, in this order:

1. ``HF_XLA_FSDP_ACCELERATE_CONFIG`` (a path), when set;
2. the ``--config_file`` of the ``accelerate launch`` command line that started this process or
   one of its parents (read from the OS, so ``xmp.spawn`` workers and threads find it too);
3. accelerate's default config file, when it exists.

:class:`XlaFsdpAccelerator` is an ``accelerate.Accelerator`` that applies those settings, so a
script written for ``Accelerator`` runs with one swapped import:

* ``prepare`` wraps the model (or keeps a model already built with :meth:`build_model`); an
  optimizer built before ``prepare`` on the unwrapped model's parameters (any groups) is re-pointed
  at the sharded parameters, in the same call or a later / earlier one;
* gradients are never all-reduced again after FSDP's reduce-scatter (so ``optimizer.step()`` stays
  a plain step, never ``xm.optimizer_step``) and ``clip_grad_norm_``'s norm spans every rank's shards;
* ``save_state``/``load_state`` write and read sharded rank checkpoints (automatic naming and
  rotation of ``ProjectConfiguration``, registered objects included); ``accelerator.preempted`` turns
  True once SIGTERM has arrived, for a save at the next step boundary; ``get_state_dict`` returns the
  full state dict with the original names, and ``unwrap_model(model).save_pretrained(...)`` and
  ``save_model`` write a ``from_pretrained``-ready directory.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from accelerate import Accelerator

from ..engines import engine_for, engine_of, is_wrapped, unwrap
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin, read_accelerate_yaml
from ..session.preemption import PreemptionGuard

ENV_CONFIG = "HF_XLA_FSDP_ACCELERATE_CONFIG"


def _config_from_cmdline(cmd: Sequence[str]) -> Optional[str]:
    """The ``--config_file`` value of an ``accelerate launch`` command line, if ``cmd`` is one."""
    names = [Path(c).name for c in cmd[:3]]
    launched = ("accelerate" in names and "launch" in cmd) or "accelerate-launch" in names or any(
        "accelerate.commands.launch" in c or "accelerate.commands.accelerate_cli" in c for c in cmd[:4])
    if not launched:
        return None
    for i, arg in enumerate(cmd):
        if arg in ("--config_file", "--config-file") and i + 1 < len(cmd):
            return cmd[i + 1]
        for flag in ("--config_file=", "--config-file="):
            if arg.startswith(flag):
                return arg[len(flag):]
    return ""  # launched without --config_file: accelerate used its default file


def find_accelerate_config() -> Optional[Path]:
    """The accelerate YAML this process was launched with (see the module docstring for the order)."""
    explicit = os.environ.get(ENV_CONFIG)
    if explicit:
        return Path(explicit)
    import psutil

    proc: Optional[psutil.Process] = psutil.Process()
    while proc is not None:
        try:
            found = _config_from_cmdline(proc.cmdline())
            if found:
                path = Path(found)
                return path if path.is_absolute() else Path(proc.cwd()) / path
            if found == "":
                break
            proc = proc.parent()
        except psutil.Error:
            break
    from accelerate.commands.config import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def plugin_from_accelerate_launch() -> XlaFsdpPlugin:
    """The plugin described by the ``fsdp_config:`` of the accelerate YAML this process was launched with."""
    path = find_accelerate_config()
    if path is None:
        raise ConfigError(
            "no accelerate config found: run under `accelerate launch --config_file xla_fsdp.yaml`, set "
            f"{ENV_CONFIG}, or pass fsdp_plugin=XlaFsdpPlugin(...)")
    plugin = XlaFsdpPlugin.from_accelerate_config(path)
    distributed = str(read_accelerate_yaml(path).get("distributed_type", "XLA")).upper()
    engine_for(plugin).check_launch(distributed, str(path))
    return plugin


logger = logging.getLogger(__name__)

_OWN_SAVE = "_hf_xla_fsdp_save_pretrained"


def _ties_kept(*args: Any, **kwargs: Any) -> None:
    """``tie_weights`` of a sharded model: its ties are kept by FSDP already."""


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def repoint_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, torch.nn.Parameter],
                      sharded: set[int]) -> list[torch.nn.Parameter]:
    """Point every group of ``optimizer`` at the sharded parameters; returns the parameters it could not place.

    ``moved`` maps ``id(original parameter)`` to the sharded parameter that now holds it; ``sharded``
    holds the ids of every prepared model's parameters. A flat parameter (``flatten_parameters``)
    holds several originals: they must all sit in groups with the same hyperparameters.
    """
    unknown: list[torch.nn.Parameter] = []
    owner: dict[int, int] = {}
    new_groups: list[list[torch.nn.Parameter]] = []
    for index, group in enumerate(optimizer.param_groups):
        params: list[torch.nn.Parameter] = []
        for p in group["params"]:
            new = p if id(p) in sharded else moved.get(id(p))
            if new is None:
                unknown.append(p)
                params.append(p)
                continue
            if id(new) in owner:
                first = optimizer.param_groups[owner[id(new)]]
                if owner[id(new)] != index and _hyperparameters(first) != _hyperparameters(group):
                    raise ConfigError(
                        f"flatten_parameters puts parameters of optimizer groups {owner[id(new)]} and {index} (different "
                        "hyperparameters, e.g. weight decay) into one flat parameter; set flatten_parameters: false, or "
                        "give those parameters the same group settings")
                continue  # already in the optimizer through another member of its flat group (or a tied name)
            owner[id(new)] = index
            params.append(new)
        new_groups.append(params)
    if optimizer.state and any(id(p) in moved for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError("the optimizer already holds state (it has stepped) for the unwrapped model's parameters; "
                          "prepare it before its first step")
    for group, params in zip(optimizer.param_groups, new_groups):
        group["params"] = params
    return unknown


class XlaFsdpAccelerator(Accelerator):
    """An ``Accelerator`` whose models are XLA FSDP models configured by the accelerate YAML."""

    def __init__(self, *args: Any, fsdp_plugin: Optional[XlaFsdpPlugin] = None, **kwargs: Any) -> None:
        # settings first: a bad fsdp_config must fail before anything else starts
        plugin = fsdp_plugin or plugin_from_accelerate_launch()
        # mixed precision is the engine's compute dtype; accelerate's autocast stays off (it breaks SDPA on XLA)
        precision = kwargs.get("mixed_precision")
        source = f"Accelerator(mixed_precision={precision!r})"
        if precision is None:
            precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
            source = f"ACCELERATE_MIXED_PRECISION={precision}"
        plugin = plugin.with_mixed_precision(precision, source)
        kwargs["mixed_precision"] = "no"
        # before accelerate's state looks at the devices (FSDP v2: one process drives every device)
        engine_for(plugin).setup_runtime(plugin)
        super().__init__(*args, **kwargs)
        self.xla_fsdp_plugin = plugin
        self._moved_params: dict[int, torch.nn.Parameter] = {}  # id(original parameter) -> its sharded parameter
        self._preemption: Optional[PreemptionGuard] = None

    # ----------------------------------------------------------------- preemption
    @property
    def preempted(self) -> bool:
        """True once SIGTERM has arrived (``save_on_preemption``, on by default): save_state() and stop.

        Read it at a step boundary (after ``optimizer.step()``). The first read installs the SIGTERM handler
        (main thread only), so a script that never reads it keeps SIGTERM's usual effect; a second SIGTERM
        has it too. ``end_training()`` restores the previous handler.
        """
        if not self.xla_fsdp_plugin.save_on_preemption:
            return False
        if self._preemption is None:
            self._preemption = PreemptionGuard()
            self._preemption.install()
        return self._preemption.received

    def end_training(self) -> None:
        """accelerate's ``end_training`` (trackers); also waits for a checkpoint still being written in the background
        (``async_save``) and gives SIGTERM its previous handler back."""
        from ..checkpoint import wait_for_pending_save

        if self._preemption is not None:
            self._preemption.restore()
        wait_for_pending_save()
        super().end_training()

    # ----------------------------------------------------------------- models and optimizers
    def build_model(self, source: Any, **kwargs: Any) -> torch.nn.Module:
        """Build ``source`` (config, config.json or local model dir) on meta, block by block, wrapped."""
        return self.xla_fsdp_plugin.build(source, progress=self.is_main_process, **kwargs)

    def prepare(self, *args: Any, device_placement: Optional[list[bool]] = None) -> Any:
        """accelerate's ``prepare``; afterwards every prepared optimizer must hold only prepared models' parameters."""
        result = super().prepare(*args, device_placement=device_placement)
        if self._models:
            self._check_optimizers()
            for model in self._models:  # e.g. FSDP v2 with compute_dtype: the optimizer updates fp32 master copies
                for optimizer in self._optimizers:
                    self.xla_fsdp_plugin.prepare_optimizer(model, optimizer.optimizer)
        return result

    def _get_named_parameters(self, *args: Any, drop_refs: bool = False) -> dict[str, Any]:
        # accelerate re-maps optimizer parameters by name after XLA device placement; FSDP renames and shards
        # them (and ties share one), so that map would fail: this class re-points optimizers itself
        return {}

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Wrap ``model`` with XLA FSDP unless it already is (e.g. from :meth:`build_model`); re-point optimizers."""
        if not is_wrapped(model):
            originals: dict[str, int] = {}
            for name, param in model.named_parameters(remove_duplicate=False):
                originals.setdefault(name, id(param))
            model = self.xla_fsdp_plugin.wrap(model)
            inner = unwrap(model)
            if hasattr(inner, "tie_weights"):
                # FSDP keeps a tied weight once, shared by both names; re-tying (as accelerate scripts do on XLA after
                # prepare) would look for parameters FSDP has replaced by its shards
                inner.tie_weights = _ties_kept
            params = dict(model.named_parameters())
            for name, members in engine_of(model).parameter_origins(model).items():
                for member in members:
                    if member in originals:
                        self._moved_params[originals[member]] = params[name]
        if not any(m is model for m in self._models):  # Trainer prepares the same model again for eval
            self._models.append(model)
        for optimizer in self._optimizers:
            repoint_optimizer(optimizer.optimizer, self._moved_params, self._sharded_ids())
        return model

    def _sharded_ids(self) -> set[int]:
        from ..engines.master_weights import master_weights

        ids = {id(p) for m in self._models for p in m.parameters()}
        for m in self._models:  # what a prepared optimizer updates in a low-precision parameter's place
            masters = master_weights(m)
            ids |= {id(master) for _, master in (masters.pairs if masters is not None else [])}
        return ids

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """accelerate's optimizer wrapper around ``optimizer``, re-pointed at the sharded parameters where known."""
        repoint_optimizer(optimizer, self._moved_params, self._sharded_ids())
        return super().prepare_optimizer(optimizer, device_placement=False)

    def _check_optimizers(self) -> None:
        sharded = self._sharded_ids()
        for optimizer in self._optimizers:
            unknown = repoint_optimizer(optimizer.optimizer, self._moved_params, sharded)
            if unknown:
                shapes = ", ".join(str(list(p.shape)) for p in unknown[:3])
                raise ConfigError(
                    f"the optimizer holds {len(unknown)} parameter(s) of no prepared model (shapes {shapes}): build it "
                    "from model.parameters() of the model you prepare (before or after prepare); to create it after the "
                    "model is wrapped, use the prepared model's parameters")

    def _fsdp_model(self) -> torch.nn.Module:
        if len(self._models) != 1:
            raise ConfigError(f"expected exactly one prepared FSDP model, found {len(self._models)}")
        return self._models[0]

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's loader, adjusted by the engine (FSDP v2: every batch split over all devices on its way in)."""
        loader = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                             slice_fn_for_dispatch=slice_fn_for_dispatch)
        return engine_for(self.xla_fsdp_plugin).prepare_loader(loader, self.xla_fsdp_plugin)

    # ----------------------------------------------------------------- gradients
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled for accumulation); FSDP has reduce-scattered the gradients."""
        super().backward(loss, **kwargs)
        # accelerate's XLA path would all-reduce the (already reduced) gradient shards again
        self.gradient_state.is_xla_gradients_synced = True

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip over the whole model: the norm spans the shards of every rank (see :func:`hf_xla_fsdp.train.clip_grad_norm`)."""
        from ..train import clip_grad_norm

        params = [id(p) for p in parameters]
        for model in self._models:
            if params == [id(p) for p in model.parameters()]:
                self.gradient_state.is_xla_gradients_synced = True
                return clip_grad_norm(model, max_norm, norm_type)
        raise ConfigError("clip_grad_norm_ on an XLA FSDP model needs the prepared model's model.parameters()")

    # ----------------------------------------------------------------- checkpoints
    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self._optimizers[0].optimizer if self._optimizers else None

    def _scheduler(self) -> Any:
        return self._schedulers[0].scheduler if self._schedulers else None

    def _checkpoints_dir(self) -> Path:
        return Path(self.project_dir) / "checkpoints"

    def save_state(self, output_dir: Union[str, os.PathLike, None] = None, safe_serialization: bool = True, *,
                   step: Optional[int] = None, extra: Optional[dict[str, Any]] = None, **_: Any) -> str:
        """Sharded rank checkpoint of model, optimizer, scheduler, RNG, registered objects and ``extra``.

        Every process calls it. Without ``output_dir``, ``ProjectConfiguration(automatic_checkpoint_naming=True)``
        names it ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps at most ``total_limit`` of them,
        as accelerate does.
        """
        from ..checkpoint import save_checkpoint, wait_for_pending_save

        wait_for_pending_save()  # the previous save is published (and rotated) before this one is named
        config = self.project_configuration
        if output_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ConfigError("save_state needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
            output_dir = self._checkpoints_dir() / f"checkpoint_{self.save_iteration}"
            if output_dir.exists():
                raise ConfigError(f"checkpoint directory {output_dir} already exists; set accelerator.project_configuration"
                                  ".iteration to the iteration to continue from")
        output_dir = Path(output_dir)
        custom = copy.deepcopy([obj.state_dict() for obj in self._custom_objects])  # as of now, even if written later
        step = self.step if step is None else step
        async_save = self.xla_fsdp_plugin.async_save

        def add_custom_objects(stage: Path) -> None:
            for index, state in enumerate(custom):  # accelerate's file names, read back with weights_only=True
                torch.save(state, stage / f"custom_checkpoint_{index}.pkl")

        def published(path: Path) -> None:
            if self._preemption is not None and self._preemption.received:
                logger.warning("%s received: saved checkpoint %s at step %s; stop now and resume with "
                               "accelerator.load_state(%s)", self._preemption.signal_name, path, step,
                               "" if config.automatic_checkpoint_naming else f"'{path}'")
            if config.automatic_checkpoint_naming and config.total_limit is not None and self.is_main_process:
                for old in self._automatic_checkpoints()[:-config.total_limit]:
                    shutil.rmtree(old, ignore_errors=True)

        # a background save gathers through torch.distributed (thread-safe); a synchronous one through accelerate
        barrier = None if async_save else (lambda tag: self.wait_for_everyone())
        # SIGTERM: this save is the last one, so it is written before save_state returns
        async_save = async_save and not (self._preemption is not None and self._preemption.received)
        save_checkpoint(output_dir, self._fsdp_model(), self._optimizer(), self._scheduler(), step=step,
                        plugin=self.xla_fsdp_plugin, extra=extra, barrier=barrier, before_commit=add_custom_objects,
                        async_save=async_save, after_commit=published, storage=self.xla_fsdp_plugin.checkpoint_storage)
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return str(output_dir)

    def _automatic_checkpoints(self) -> list[Path]:
        """``checkpoint_<i>`` directories under ``<project_dir>/checkpoints``, oldest first."""
        root = self._checkpoints_dir()
        found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint_\d+", p.name)] if root.is_dir() else []
        return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))

    def load_state(self, input_dir: Union[str, os.PathLike, None] = None, **_: Any) -> dict[str, Any]:
        """Restore what :meth:`save_state` saved (any world size); without ``input_dir``, the latest automatic one.

        Returns ``step``, ``extra``, ...; ``accelerator.step`` is restored too.
        """
        from ..checkpoint import load_checkpoint, wait_for_pending_save

        wait_for_pending_save()  # the latest automatic checkpoint may still be being written
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ConfigError("load_state needs the checkpoint directory to resume from (or automatic checkpoint naming)")
            found = self._automatic_checkpoints()
            if not found:
                raise ConfigError(f"no checkpoint_<i> directory under {self._checkpoints_dir()} to resume from")
            input_dir = found[-1]
            self.project_configuration.iteration = int(found[-1].name.rsplit("_", 1)[1]) + 1
        input_dir = Path(input_dir)
        info = load_checkpoint(input_dir, self._fsdp_model(), self._optimizer(), self._scheduler())
        for index, obj in enumerate(self._custom_objects):
            path = input_dir / f"custom_checkpoint_{index}.pkl"
            if not path.is_file():
                raise ConfigError(f"{input_dir} holds no state for registered object {index} ({type(obj).__name__})")
            obj.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.step = info["step"]
        return info

    # ----------------------------------------------------------------- full weights
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict with the original parameter names, on the main process (``{}`` elsewhere).

        Every process must call it. Each rank's shard goes to a temporary sharded checkpoint that the
        main process reads back tensor by tensor (``HF_XLA_FSDP_TMPDIR`` picks where; it must be visible
        to every process of the run).
        """
        from ..checkpoint import save_checkpoint
        from ..checkpoint.consolidate import read_full_state_dict

        if not is_wrapped(model):
            return super().get_state_dict(model, unwrap=unwrap)
        root = Path(os.environ.get("HF_XLA_FSDP_TMPDIR") or tempfile.gettempdir())
        # the same name on every process of this run without communication: the launcher's pid and a counter
        self._state_dict_calls = getattr(self, "_state_dict_calls", 0) + 1
        launcher = os.getppid() if self.num_processes > 1 else os.getpid()
        tmp = root / f"hf_xla_fsdp-state-{launcher}-{self._state_dict_calls}"
        try:
            save_checkpoint(tmp, model, plugin=self.xla_fsdp_plugin, barrier=lambda tag: self.wait_for_everyone())
            return read_full_state_dict(tmp) if self.is_main_process else {}
        finally:
            self.wait_for_everyone()
            if self.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The transformers model inside the FSDP units.

        Its parameters stay sharded; its ``save_pretrained`` is replaced (on this instance only) by one
        that gathers the full weights first, so the usual final save of accelerate scripts writes a
        correct ``from_pretrained``-ready directory.
        """
        inner = unwrap(model)
        if inner is not model and hasattr(inner, "save_pretrained") and not hasattr(inner, _OWN_SAVE):
            original = type(inner).save_pretrained
            inner.save_pretrained = functools.partial(self._save_pretrained, model, inner, original)
            setattr(inner, _OWN_SAVE, True)
        return inner

    def _save_pretrained(self, model: torch.nn.Module, inner: torch.nn.Module, original: Any,
                         save_directory: Union[str, os.PathLike], *args: Any, is_main_process: bool = True,
                         state_dict: Optional[dict[str, torch.Tensor]] = None, **kwargs: Any) -> None:
        """``save_pretrained`` of a sharded model: full weights gathered, written to a staging dir, then moved in."""
        from ..checkpoint.layout import merge_into
        from ..export.peft import is_peft_model, peft_writer

        if state_dict is None and is_peft_model(inner):  # adapters only: the base is never read back
            from ..checkpoint.consolidate import save_consolidated

            save_consolidated(model, save_directory, self.xla_fsdp_plugin, is_main=is_main_process, step=self.step,
                              barrier=lambda tag: self.wait_for_everyone(),
                              write=peft_writer(model, self.xla_fsdp_plugin, progress=is_main_process))
            return
        if state_dict is None:
            state_dict = self.get_state_dict(model)  # every process takes part
        elif is_main_process and not state_dict:
            raise ConfigError("save_pretrained got an empty state_dict on the main process; pass "
                              "state_dict=accelerator.get_state_dict(model) from every process")
        if is_main_process:
            if not is_peft_model(inner):  # peft selects its own tensors from the full state dict
                self._check_state_dict(inner, state_dict)
            save_directory = Path(save_directory)
            save_directory.parent.mkdir(parents=True, exist_ok=True)
            stage = save_directory.parent / f".{save_directory.name}.save-{uuid.uuid4().hex[:8]}"
            try:
                original(inner, str(stage), *args, is_main_process=True, state_dict=state_dict, **kwargs)
                merge_into(stage, save_directory)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        self.wait_for_everyone()

    @staticmethod
    def _check_state_dict(inner: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
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

    def save_model(self, model: torch.nn.Module, save_directory: Union[str, os.PathLike],
                   max_shard_size: Union[int, str, None] = None, safe_serialization: bool = True,
                   dtype: Optional[str] = None, overwrite: bool = True, extra: Optional[dict[str, Any]] = None,
                   step: Optional[int] = None) -> None:
        """A ``from_pretrained``-ready directory: sharded save, then streaming consolidation on the main process.

        The same path as ``XlaFsdpTrainer.save_model`` (:func:`hf_xla_fsdp.checkpoint.consolidate.save_consolidated`):
        the weights of an earlier save in ``save_directory`` are replaced as a whole, other files stay
        (``overwrite`` is accepted for compatibility and changes nothing). ``extra`` (e.g.
        ``{"eval_loss": ..., "losses": {...}}``) is kept in the directory's training record, which
        ``hf-xla-fsdp export`` turns into the model card's numbers. ``dtype`` and ``max_shard_size``
        default to the plugin's ``consolidate_dtype`` / ``consolidate_max_shard_size``.
        """
        from ..checkpoint.consolidate import save_consolidated

        if not safe_serialization:
            raise ConfigError("hf_xla_fsdp writes safetensors only; call save_model with safe_serialization=True")
        from ..export.peft import peft_writer

        save_consolidated(model, save_directory, self.xla_fsdp_plugin, is_main=self.is_main_process,
                          step=self.step if step is None else step, extra=extra,
                          barrier=lambda tag: self.wait_for_everyone(), dtype=dtype, max_shard_size=max_shard_size,
                          write=peft_writer(model, self.xla_fsdp_plugin, self.is_main_process),
                          progress=self.is_main_process)
