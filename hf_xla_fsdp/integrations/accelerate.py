"""XLA FSDP through ``accelerate launch --config_file xla_fsdp.yaml``.

With ``distributed_type: XLA`` accelerate runs the script's ``main()`` through ``xmp.spawn`` and
passes none of the YAML's ``fsdp_config:`` settings on. :func:`find_accelerate_config` finds the
YAML itself, in this order:

1. ``HF_XLA_FSDP_ACCELERATE_CONFIG`` (a path), when set;
2. the ``--config_file`` of the ``accelerate launch`` command line that started this process or
   one of its parents (read from the OS, so ``xmp.spawn`` workers and threads find it too);
3. accelerate's default config file, when it exists.

:class:`XlaFsdpAccelerator` is an ``accelerate.Accelerator`` that applies those settings:
``prepare`` wraps the model (or keeps a model already built with :meth:`build_model`), gradients
are never all-reduced again after FSDP's reduce-scatter (so ``optimizer.step()`` stays a plain
step, never ``xm.optimizer_step``), ``clip_grad_norm_``'s norm spans every rank's shards,
``save_state``/``load_state`` are the sharded rank checkpoints and ``save_model`` consolidates.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from accelerate import Accelerator

from ..engines import engine_for
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin, read_accelerate_yaml

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


class XlaFsdpAccelerator(Accelerator):
    """An ``Accelerator`` whose models are XLA FSDP models configured by the accelerate YAML."""

    def __init__(self, *args: Any, fsdp_plugin: Optional[XlaFsdpPlugin] = None, **kwargs: Any) -> None:
        # settings first: a bad fsdp_config must fail before anything else starts
        plugin = fsdp_plugin or plugin_from_accelerate_launch()
        # before accelerate's state looks at the devices (FSDP v2: one process drives every device)
        engine_for(plugin).setup_runtime(plugin)
        super().__init__(*args, **kwargs)
        self.xla_fsdp_plugin = plugin

    # ----------------------------------------------------------------- models
    def build_model(self, source: Any, **kwargs: Any) -> torch.nn.Module:
        """Build ``source`` (config, config.json or local model dir) on meta, block by block, wrapped."""
        return self.xla_fsdp_plugin.build(source, progress=self.is_main_process, **kwargs)

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Wrap ``model`` with XLA FSDP unless it already is (e.g. from :meth:`build_model`)."""
        from ..engines import is_wrapped

        if not is_wrapped(model):
            model = self.xla_fsdp_plugin.wrap(model)
        if not any(m is model for m in self._models):  # Trainer prepares the same model again for eval
            self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """Refuse an optimizer built on the parameters of the model before it was sharded."""
        sharded = {id(p) for m in self._models for p in m.parameters()}
        if any(id(p) not in sharded for group in optimizer.param_groups for p in group["params"]):
            raise ConfigError(
                "the optimizer holds parameters that are not the FSDP model's: create it after the model is "
                "wrapped (accelerator.build_model(...) or model = accelerator.prepare(model)), from model.parameters()")
        return super().prepare_optimizer(optimizer, device_placement=False)

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

    def save_state(self, output_dir: Union[str, os.PathLike, None] = None, *, step: Optional[int] = None,
                   extra: Optional[dict[str, Any]] = None, **_: Any) -> str:
        """Sharded rank checkpoint of model, optimizer, scheduler, RNG and ``extra`` (every rank calls it)."""
        from ..checkpoint import save_checkpoint

        if output_dir is None:
            raise ConfigError("save_state needs an output_dir for the sharded checkpoint")
        save_checkpoint(output_dir, self._fsdp_model(), self._optimizer(), self._scheduler(),
                        step=self.step if step is None else step, plugin=self.xla_fsdp_plugin, extra=extra,
                        barrier=lambda tag: self.wait_for_everyone())
        return str(output_dir)

    def load_state(self, input_dir: Union[str, os.PathLike, None] = None, **_: Any) -> dict[str, Any]:
        """Restore what :meth:`save_state` saved (any world size); returns ``step``, ``extra``, ..."""
        from ..checkpoint import load_checkpoint

        if input_dir is None:
            raise ConfigError("load_state needs the checkpoint directory to resume from")
        info = load_checkpoint(input_dir, self._fsdp_model(), self._optimizer(), self._scheduler())
        self.step = info["step"]
        return info

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The transformers model inside the FSDP units (its parameters stay sharded: save with save_model)."""
        from ..engines import unwrap

        return unwrap(model)

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
        save_consolidated(model, save_directory, self.xla_fsdp_plugin, is_main=self.is_main_process,
                          step=self.step if step is None else step, extra=extra,
                          barrier=lambda tag: self.wait_for_everyone(), dtype=dtype, max_shard_size=max_shard_size,
                          progress=self.is_main_process)
