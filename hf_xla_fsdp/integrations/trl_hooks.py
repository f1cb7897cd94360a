"""What a TRL trainer builds in its ``__init__``, built by the session instead: block by block on ``meta``, sharded.

TRL's trainers (SFT, DPO, GRPO, RLOO, KTO, reward) load every model they need themselves: the policy from a path
(``create_model_from_path(model_id, architecture, **model_init_kwargs)``), its adapters (``get_peft_model``), the
reference model of DPO / GRPO / RLOO / KTO (``create_model_from_path`` again, from the policy's path) and GRPO's
reward models named by path (``AutoModelForSequenceClassification.from_pretrained``). Each of those would hold the
whole model on the host. While the trainer's ``__init__`` runs, :class:`TrlModelHooks` puts its own functions in
place of those names in the TRL modules the trainer class comes from (and puts the originals back afterwards), so:

* the policy is built for training, its blocks sharded, its root left for the mixin to add after the trainer patched
  the model (TRL's fused LM head replaces ``forward``); with a ``peft_config`` the adapters are attached on meta first
  and TRL's own ``get_peft_model`` call receives that ``PeftModel`` (so TRL takes its usual LoRA path: the DPO
  reference is the policy with its adapters disabled, no second model);
* every other model is built in evaluation mode (:meth:`~hf_xla_fsdp.session.XlaFsdpSession.build_model`): frozen,
  no master copies, stored in the run's compute dtype; TRL then hands it to ``accelerator.prepare_model(...,
  evaluation_mode=True)``, which adds its root unit;
* ``model_init_kwargs`` as TRL computed them are honoured: ``attn_implementation`` and config keywords
  (``num_labels``) on the config, ``dtype`` as the run's compute dtype (:func:`model_init_sources`), ``architecture`` as
  the class built; what cannot apply on XLA FSDP (``quantization_config``) is one line.

The names replaced are listed in :mod:`hf_xla_fsdp.upstream` (``trl`` entries), checked before use.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config.resolve import Source
    from ..session import XlaFsdpSession

logger = logging.getLogger(__name__)

#: ``from_pretrained`` keywords that are not config keywords: how a model is loaded, not what it is
_LOADING_KEYS = {"dtype", "torch_dtype", "device_map", "trust_remote_code", "revision", "attn_implementation",
                 "low_cpu_mem_usage", "use_safetensors", "cache_dir", "token", "local_files_only", "subfolder"}
_REFUSED_KEYS = {"quantization_config": "quantized models cannot be sharded by XLA FSDP; load the model unquantized",
                 "use_kernels": "Hub kernels are CUDA kernels; drop use_kernels on XLA"}
_LOW_PRECISION = {"bfloat16": "bf16", "float16": "fp16", torch.bfloat16: "bf16", torch.float16: "fp16"}


class PathModel(str):
    """A model given by path or config, as TRL expects it (a ``str``), carrying what the session builds it from."""

    source: Any

    def __new__(cls, source: Any) -> "PathModel":
        text = str(getattr(source, "_name_or_path", "") or type(source).__name__) if not isinstance(source, (str, bytes)) \
            else str(source)
        path = super().__new__(cls, text)
        path.source = source
        return path


def is_trl_trainer(trainer_cls: type) -> bool:
    """True when ``trainer_cls`` is (or derives from) a TRL trainer that builds its models with ``create_model_from_path``."""
    return bool(_trl_modules(trainer_cls))


def _trl_modules(trainer_cls: type) -> list[Any]:
    found = []
    for cls in trainer_cls.__mro__:
        module = sys.modules.get(cls.__module__)
        if cls.__module__.startswith("trl.") and module is not None and hasattr(module, "create_model_from_path") \
                and module not in found:
            found.append(module)
    return found


def model_init_sources(args: Any) -> list["Source"]:
    """The settings a TRL config's ``model_init_kwargs`` give (TRL's way to ask for a bf16 / fp16 model): its
    ``dtype`` as the compute dtype, one source for the one conflict rule (:mod:`hf_xla_fsdp.config.resolve`). On XLA
    FSDP the parameters keep full precision (v1 shards fp32, v2 keeps fp32 master copies) and compute in it."""
    from ..config.resolve import precision_source

    kwargs = getattr(args, "model_init_kwargs", None)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype")) if isinstance(kwargs, dict) else None
    if dtype not in _LOW_PRECISION:
        return []
    source = precision_source(f"{type(args).__name__}(model_init_kwargs={{'dtype': {str(dtype)!r}}})",
                              _LOW_PRECISION[dtype])
    return [source] if source is not None else []


class TrlModelHooks:
    """The functions a TRL trainer's ``__init__`` builds models with, replaced by the session's builds (see the
    module). ``policy``: the trainer's ``model`` argument as given to TRL (``None`` when it is a module already);
    ``peft_config``: its adapters, attached on meta when the policy is built."""

    def __init__(self, session: "XlaFsdpSession", policy: Optional[PathModel], peft_config: Any, *, seed: int,
                 progress: bool) -> None:
        self.session = session
        self.policy = policy
        self.peft_config = peft_config
        self.seed = seed
        self.progress = progress
        #: the built policy (a PeftModel with adapters), and its base handed to TRL until it asks for the adapters
        self.peft_model: Optional[nn.Module] = None
        self.built_policy: Optional[nn.Module] = None
        #: models built in evaluation mode (reference, reward), in order
        self.inference_models: list[nn.Module] = []
        #: a reference built only to precompute its log-probs (see :func:`reference_model`), dropped afterwards
        self.precompute_only: Optional[nn.Module] = None
        self._originals: dict[str, Any] = {}

    @contextlib.contextmanager
    def installed(self, trainer_cls: type) -> Iterator["TrlModelHooks"]:
        """Within: ``trainer_cls``'s TRL modules build through this object; afterwards their own functions again."""
        from .. import upstream

        upstream.require("trl")
        replaced: list[tuple[Any, str, Any]] = []
        for module in _trl_modules(trainer_cls):
            for name, ours in (("create_model_from_path", self.create_model_from_path),
                               ("get_peft_model", self.get_peft_model),
                               ("AutoModelForSequenceClassification", self.reward_model_class())):
                if name in module.__dict__:
                    self._originals.setdefault(name, module.__dict__[name])
                    replaced.append((module, name, module.__dict__[name]))
                    setattr(module, name, ours)
        try:
            yield self
        finally:
            for module, name, original in reversed(replaced):
                setattr(module, name, original)

    # ----------------------------------------------------------------- what TRL calls
    def create_model_from_path(self, model_id: str, architecture: Any = None, **kwargs: Any) -> nn.Module:
        """TRL's ``create_model_from_path``: the policy (``model_id`` is the trainer's model) built for training, any
        other model (a reference) in evaluation mode; both block by block, the root unit added later."""
        architecture = getattr(architecture, "real", architecture)  # our reward model class stands for the real one
        if self.policy is not None and model_id is self.policy and self.built_policy is None:
            # TRL seeded the RNG just before: the policy draws (fresh weights, adapters) as eager construction would
            model = self.session.build_model(_source(self.policy.source, kwargs), model_cls=architecture,
                                             progress=self.progress, wrap_root=False, peft_config=self.peft_config)
            self.built_policy = model
            if self.peft_config is not None:  # TRL attaches the adapters next: get_peft_model gives it these
                self.peft_model = model
                return model.get_base_model()
            return model
        return self._inference_model(self._reference_source(model_id, kwargs), architecture)

    def get_peft_model(self, model: nn.Module, peft_config: Any, *args: Any, **kwargs: Any) -> nn.Module:
        """peft's ``get_peft_model``: for the policy built here, the ``PeftModel`` whose adapters were attached on meta;
        for a model the script built itself, peft's own."""
        if self.peft_model is not None and model is self.peft_model.get_base_model():
            return self.peft_model
        return self._originals["get_peft_model"](model, peft_config, *args, **kwargs)

    def reward_model_class(self) -> type:
        """Stands for ``AutoModelForSequenceClassification`` in TRL's modules: ``from_pretrained`` of a reward model
        named by path builds it in evaluation mode (TRL then prepares it with ``evaluation_mode=True``)."""
        from transformers import AutoModelForSequenceClassification

        hooks = self

        class RewardModel:
            real = AutoModelForSequenceClassification

            @classmethod
            def from_pretrained(cls, model_id: str, *args: Any, **kwargs: Any) -> nn.Module:
                if args:
                    raise ConfigError("hf_xla_fsdp builds reward models from a path and keyword arguments only")
                return hooks._inference_model(_source(model_id, kwargs), AutoModelForSequenceClassification)

        RewardModel.__name__ = RewardModel.__qualname__ = "AutoModelForSequenceClassification"
        return RewardModel

    # ----------------------------------------------------------------- building
    def _reference_source(self, model_id: str, kwargs: dict[str, Any]) -> Any:
        """The policy's own source when ``model_id`` names it (its path, or the name of the config it was built from),
        else ``model_id`` itself."""
        policy = self.policy
        if policy is not None:
            built = getattr(self.built_policy, "config", None)
            names = {str(policy), str(getattr(built, "_name_or_path", "") or "")}
            if model_id in names - {""} or (not model_id and policy.source is not None):
                return _source(policy.source, kwargs)
        return _source(model_id, kwargs)

    def _inference_model(self, src: Any, architecture: Any) -> nn.Module:
        """``src`` built in evaluation mode, block by block, its root unit left for ``prepare_model``. Fresh weights
        are drawn from ``seed`` (a reference of a policy built from a config starts where the policy started) on a
        forked CPU RNG: the run's random stream is what it would be without this model."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.session.build_model(src, model_cls=architecture, progress=self.progress, wrap_root=False,
                                             evaluation_mode=True)
        self.inference_models.append(model)
        return model


def _source(source: Any, kwargs: dict[str, Any]) -> Any:
    """``source`` resolved (:func:`~hf_xla_fsdp.modeling.meta_init.resolve_source`), with the config keywords of
    ``from_pretrained`` ``kwargs`` (``num_labels``) and ``attn_implementation`` applied to its config."""
    from ..modeling.meta_init import resolve_source

    for key, why in _REFUSED_KEYS.items():
        if kwargs.get(key):
            raise ConfigError(f"model_init_kwargs {key}: {why}")
    src = resolve_source(source)
    for key, value in kwargs.items():
        if key not in _LOADING_KEYS and key not in _REFUSED_KEYS:
            setattr(src.config, key, value)  # what from_pretrained(**kwargs) does with the keywords the config has
    if kwargs.get("attn_implementation"):
        src.config._attn_implementation = kwargs["attn_implementation"]
    return src


def reference_model(hooks: TrlModelHooks, ref_model: Any, args: Any) -> Any:
    """The ``ref_model`` argument of a TRL trainer (DPO, KTO) whose policy is built from a path.

    A path or config given as the reference is built in evaluation mode (block by block). With
    ``precompute_ref_log_probs`` and no reference, TRL would compute the reference log-probs with the policy itself
    during its ``__init__``, before the policy's root unit exists (it is added once that ``__init__`` has patched the
    model); a reference built in evaluation mode from the policy's source computes them instead, and the trainer drops
    it afterwards (:attr:`TrlModelHooks.precompute_only`), so training holds no reference at all. With adapters the
    policy's base is that reference (adapters disabled): the same weights.
    """
    if ref_model is not None and not isinstance(ref_model, nn.Module):
        return hooks._inference_model(_source(ref_model, {}), None)
    if ref_model is None and getattr(args, "precompute_ref_log_probs", False) and hooks.policy is not None:
        hooks.precompute_only = hooks._inference_model(_source(hooks.policy.source, {}), None)
        return hooks.precompute_only
    return ref_model


@contextlib.contextmanager
def trl_trainer_init(trainer: Any, bound: Any, session: "XlaFsdpSession", args: Any, *, by_path: bool) -> Iterator[None]:
    """Around a TRL trainer's own ``__init__`` (``trainer``'s, called with ``bound``'s arguments inside): its model
    building goes through :class:`TrlModelHooks`; a ``ref_model`` given by path (or needed only to precompute
    log-probs) is built by :func:`reference_model`, and the latter is dropped once that ``__init__`` has used it.
    ``by_path``: the policy was given as a path or config (``bound``'s ``model`` becomes a :class:`PathModel`, which
    TRL builds the policy from, on meta, through :meth:`TrlModelHooks.create_model_from_path`)."""
    from ..modeling.meta_init import check_model_source

    params = bound.arguments
    if by_path:
        check_model_source(params["model"])
        params["model"] = PathModel(params["model"])
    hooks = TrlModelHooks(session, params["model"] if by_path else None, params.get("peft_config") if by_path else None,
                          seed=args.seed, progress=args.should_log)
    with hooks.installed(type(trainer)):
        if by_path and "ref_model" in bound.signature.parameters:
            params["ref_model"] = reference_model(hooks, params.get("ref_model"), args)
        yield
    if hooks.precompute_only is not None and getattr(trainer, "ref_model", None) is hooks.precompute_only:
        trainer.ref_model = None  # its log-probs are in the datasets now: the reference is freed before training
