"""The seam between the library and an FSDP engine: everything that differs between engines, once.

An :class:`Engine` is stateless; one instance per engine is registered in :mod:`hf_xla_fsdp.engines`
and chosen from the settings (:func:`~hf_xla_fsdp.engines.engine_for`) or from a wrapped model
(:func:`~hf_xla_fsdp.engines.engine_of`). Code outside ``engines/`` asks the engine and never
tests which engine runs. torch_xla is imported inside methods only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import nn

from ..checkpoint.codec import Collectives, RankState, Restored, tag
from ..errors import ConfigError

__all__ = ["EVALUATION_ATTR", "Engine", "EngineSettings", "Machines", "PlannedUnit", "RankState", "Restored",
           "host_copies", "host_copy", "in_evaluation_mode"]


class EngineSettings(Protocol):
    """What an engine reads of the settings (an :class:`hf_xla_fsdp.plugin.XlaFsdpPlugin`, already validated).

    Engines are typed by what they read, so this package never imports the plugin, not even for annotations: the
    plugin reads the engines' declarations (:mod:`hf_xla_fsdp.config.engines`), and the layers stay one way.
    """

    engine: str
    sharding: str
    activation_checkpointing: bool
    compute_dtype: Optional[torch.dtype]
    buffer_dtype: Optional[torch.dtype]
    reshard_after_forward: bool
    flatten_parameters: bool
    disable_reshard_on_root: bool
    shard_param_on_dim_0: bool
    replica_size: int
    tensor_parallel_size: Union[int, str]
    tensor_parallel_plan: Any
    compile: bool

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``XlaFullyShardedDataParallel``."""


@dataclass(frozen=True)
class PlannedUnit:
    """One FSDP unit of a meta skeleton, as the planner sees it: its parameters' ``(numel, shape)`` and names (relative
    to the unit, in the same order), each parameter counted in the innermost unit that holds it."""

    name: str
    params: tuple[tuple[int, tuple[int, ...]], ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Machines:
    """The machines of a launch, in accelerate's terms: how many, this one's rank, where machine 0 serves the
    rendezvous. ``given``: what the command line or YAML said (``num_machines=2``, ...), for the lines that refuse it."""

    count: int = 1
    rank: int = 0
    main_ip: Optional[str] = None
    main_port: Optional[int] = None
    given: tuple[str, ...] = ()

    @property
    def several(self) -> bool:
        """True when the launch spans machines (or claims a machine rank other than 0)."""
        return self.count > 1 or self.rank > 0


#: why an engine without loss scaling refuses float16 (the fix included)
NO_FLOAT16 = "has no loss scaling for float16; use bfloat16 or float32"

#: set on every unit of a model wrapped in evaluation mode (inference only: frozen, never given to an optimizer)
EVALUATION_ATTR = "_hf_xla_fsdp_evaluation_mode"


def in_evaluation_mode(model: nn.Module) -> bool:
    """True when ``model`` (or its outermost unit, or any unit of a model whose root is not wrapped yet) was
    wrapped in evaluation mode."""
    return any(m.__dict__.get(EVALUATION_ATTR, False) for m in model.modules())


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor no later training step changes: the device's value, or a clone of a host tensor (an
    optimizer's CPU ``step`` counter is updated in place)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


#: bytes of device tensors fetched in one batched transfer by :func:`host_copies`
TRANSFER_GROUP_BYTES = 64 << 20


def host_copies(tensors: Sequence[torch.Tensor], group_bytes: int = TRANSFER_GROUP_BYTES) -> list[torch.Tensor]:
    """:func:`host_copy` of each; the device tensors in batched transfers of about ``group_bytes`` each.

    This is what an async save's step waits for. Batching beats one ``.cpu()`` per tensor, but one transfer of
    the whole rank state allocates it twice at once (the runtime's host buffers, then torch's tensors): for the
    3.6 GiB state of benchmarks/async_save.py that took 8.7-11.6 s on XLA:CPU against 2.0-3.1 s in 64 MiB groups,
    whose transient host memory is one group.
    """
    from ..runtime import fetch_to_host

    out = [host_copy(t) if t.device.type == "cpu" else None for t in tensors]
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            continue
        if size >= group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.numel() * t.element_size()
    for group in groups:
        for i, fetched in zip(group, fetch_to_host([tensors[i].detach() for i in group])):
            out[i] = fetched
    return out


class Engine(ABC):
    """What an FSDP engine does; the library's one seam between its engines. Neutral: no runtime is assumed
    (:class:`~.xla.XlaEngine` holds torch_xla's defaults); the abstract methods are what every engine implements.

    It is also the :class:`~hf_xla_fsdp.checkpoint.codec.CheckpointCodec` of the models it wraps: every unit it
    makes is tagged with it, so checkpoints find it without importing this package.
    """

    # ------------------------------------------------------------ declarations: everything the settings, the
    # launcher check, the CLI, the settings table and model cards know of an engine is derived from these
    #: the value of the ``engine`` setting that selects it (``plugin.engine`` once resolved)
    key: ClassVar[str] = ""
    #: other spellings of ``engine`` that select it; engines sharing an alias are told apart by :attr:`version`
    aliases: ClassVar[tuple[str, ...]] = ()
    #: the older ``version`` setting that selects it among the engines sharing an alias (None: no version)
    version: ClassVar[Optional[int]] = None
    #: accelerate ``distributed_type`` values it runs under, and the one line when a launch says another
    launchers: ClassVar[tuple[str, ...]] = ()
    launcher_fix: ClassVar[str] = ""
    #: settings of its own: a setting that some engine lists here is honoured by the engines listing it only (the
    #: others refuse a value other than its default); a setting no engine lists is honoured by every engine
    honours: ClassVar[frozenset[str]] = frozenset()
    #: values of a setting it cannot honour, and why (one line with the fix)
    refuses: ClassVar[Mapping[str, tuple[tuple[Any, ...], str]]] = {}
    #: accelerate's ``fsdp_version: 2`` (torch's ``fully_shard``) means this engine
    torch_fsdp2: ClassVar[bool] = False
    #: name in training records and model cards
    name: str = ""
    #: human title for messages and cards
    title: str = ""
    #: tensor layout its rank files use (``checkpoint.readers.LAYOUT_*``)
    checkpoint_layout: str = ""
    #: one process drives every device (SPMD) instead of one process per device
    spmd: bool = False
    #: the module the engine's runtime lives in (None: torch itself), the extra that installs it, and what the line
    #: saying it is missing offers instead (", or use ...")
    runtime_module: Optional[str] = None
    runtime_extra: str = ""
    runtime_alternative: str = ""
    #: every step runs as graphs compiled for its input shapes: padded batch shapes and the recompilation watch apply
    #: (an eager engine needs neither)
    compiles_graphs: bool = False
    #: the runtime is XLA's and keeps compiled graphs in its persistent cache (``compilation_cache_dir``)
    compilation_cache: bool = False
    #: torch's fused optimizer kernels run on its devices (XLA has none: the Trainer's fused AdamW default is unfused)
    fused_optimizers: bool = False

    def missing_runtime(self) -> Optional[str]:
        """The one line when this engine's runtime is not installed (None when it is); nothing is imported."""
        import importlib.util

        if self.runtime_module is None:
            return None
        try:
            found = importlib.util.find_spec(self.runtime_module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return None
        return (f"{self.title} needs {self.runtime_module}, which is not installed: pip install "
                f"'hf_xla_fsdp[{self.runtime_extra}]'{self.runtime_alternative}")

    @abstractmethod
    def device(self) -> torch.device:
        """The device this process computes on."""

    @abstractmethod
    def multi_process(self) -> bool:
        """True when several processes of this engine's runtime take part."""

    @abstractmethod
    def process_index(self) -> int:
        """This process's index among the runtime's processes."""

    @abstractmethod
    def process_count(self) -> int:
        """Number of processes of the runtime."""

    @abstractmethod
    def gather_bytes(self, payload: bytes, tag: str) -> list[bytes]:
        """Every process's ``payload`` on every process, in process order (every process calls it)."""

    # ----------------------------------------------------------------- launching
    def started_by_launcher(self) -> bool:
        """True in a process that a launcher of this engine's processes started (it must not start more)."""
        return False

    def start_processes(self, count: int, launcher_arguments: list[str], machines: Optional[Machines] = None,
                        process_main: Optional[Callable[[], None]] = None) -> int:
        """Start ``count`` processes on this host (one of ``machines``), wait for them and return the exit code.

        Each runs either ``python -m hf_xla_fsdp.launch *launcher_arguments`` (a launcher of separate programs, as
        torchrun) or ``process_main`` (a launcher of Python functions, as ``xmp.spawn``; it pickles the callable).
        This default starts nothing: one line for the user, before any work."""
        raise ConfigError(f"num_processes={count}: {self.title} does not start processes; drop num_processes and "
                          "start the script with the launcher of its runtime")

    def check_machines(self, machines: Machines) -> None:
        """Refuse, in one line, machine flags the engine cannot honour, before any work (this default: any that
        place the launch on more than one machine)."""
        if machines.several or any("main_process_" in g for g in machines.given):
            what = ", ".join(machines.given) or f"num_machines={machines.count}"
            raise ConfigError(f"{what}: {self.title} does not start processes across machines; drop the machine flags")

    # ----------------------------------------------------------------- runtime
    def setup_runtime(self, plugin: EngineSettings, what: str = "this process") -> None:
        """Prepare the engine's runtime before any of its tensors exists (idempotent); ``what`` names whoever may have
        used the device first, for the message when it is too late."""

    def runtime_ready(self, counted_processes: int) -> bool:
        """False when the process layout was fixed before :meth:`setup_runtime` could run (e.g. SPMD too late)."""
        return True

    def runtime_too_late(self, what: str) -> str:
        """The one line a script needs when :meth:`runtime_ready` is False (``what`` used the device first)."""
        return f"{what} started the runtime before {self.title} could set it up"

    def processes_per_host(self, requested: Any) -> Optional[int]:
        """How many processes a launcher starts on a host (:meth:`start_processes`), ``requested`` being what the user
        asked for; ``None`` (nothing asked): the launcher's own process runs the script."""
        if requested is None:
            return None
        from ..settings import parse_int

        return parse_int(requested, "num_processes", 1)

    # ----------------------------------------------------------------- planning (nothing is built: the planner asks)
    def plan_shards(self, units: Sequence[PlannedUnit], config: Any, devices: int, plugin: EngineSettings,
                    ) -> tuple[list[list[tuple[int, ...]]], list[int]]:
        """What one device holds, by this engine's own sharding rules, when ``units`` (the FSDP units of a meta
        skeleton) are sharded over ``devices``: per unit, the shapes of the pieces one device keeps (one per
        parameter, or one for a flattened unit) and the elements it holds while that unit is all-gathered (what the
        planner calls exact). ``config`` is the model's (tensor-parallel plans follow its family)."""
        raise NotImplementedError(f"{self.title}: the planner knows no sharding rule of this engine")

    def plan_mesh(self, plugin: EngineSettings, devices: int) -> Optional[dict[str, int]]:
        """The device mesh's axis sizes over ``devices`` (``None``: the engine has no mesh)."""
        return None

    def devices_per_sample(self, plugin: EngineSettings) -> int:
        """Devices that share each sample (tensor parallelism splits activations over them); 1 for plain FSDP."""
        return 1

    def splits_tensors(self) -> bool:
        """The engine can split weights inside blocks over a tensor axis (``tensor_parallel_size``)."""
        return False

    def root_stays_gathered(self, plugin: EngineSettings) -> bool:
        """The root unit's parameters stay gathered for the whole step (not re-sharded after forward)."""
        return False

    def compute_dtype_saves_memory(self, plugin: EngineSettings) -> bool:
        """A lower ``compute_dtype`` shrinks what a step holds without adding copies (the planner may suggest it)."""
        return False

    # ----------------------------------------------------------------- wrapping
    @abstractmethod
    def unit_class(self) -> type:
        """The engine's FSDP unit class."""

    def inner_wrappers(self) -> tuple[type, ...]:
        """Wrapper classes between a unit and the user's module (removed by :meth:`unwrap`)."""
        return ()

    def wrap_block(self, block: nn.Module, plugin: EngineSettings, nested: bool, *,
                   evaluation_mode: bool = False) -> nn.Module:
        """Activation-checkpoint ``block`` if asked, and make it an FSDP unit when ``nested``.

        ``evaluation_mode``: a block of a model that only runs forward (a reference or reward model): its parameters
        are frozen before sharding (so no unit keeps gradients or fp32 master copies for them), nothing is
        recomputed (there is no backward), and it is always its own unit (the whole model is never gathered at once).
        """
        if evaluation_mode:
            block.requires_grad_(False)
            return self._for_inference(tag(self.make_unit(block, plugin), self), plugin)
        block = self.checkpoint_block(block, plugin)
        return tag(self.make_unit(block, plugin), self) if nested else block

    def wrap_root(self, model: nn.Module, plugin: EngineSettings, *, evaluation_mode: bool = False) -> nn.Module:
        """The outer FSDP unit: shards every parameter no inner unit owns (frozen first in ``evaluation_mode``)."""
        if evaluation_mode:
            model.requires_grad_(False)
            return self._for_inference(tag(self.make_root(model, plugin), self), plugin).eval()
        if getattr(getattr(model, "config", None), "use_cache", False) and plugin.activation_checkpointing:
            model.config.use_cache = False  # a KV cache is incompatible with recomputed activations
        return tag(self.make_root(model, plugin), self)

    def _for_inference(self, unit: nn.Module, plugin: EngineSettings) -> nn.Module:
        unit.__dict__[EVALUATION_ATTR] = True
        self.store_for_inference(unit, plugin)
        return unit

    def store_for_inference(self, unit: nn.Module, plugin: EngineSettings) -> None:
        """Store a frozen unit's own shards as it computes with them (``compute_dtype``): an inference-only model
        needs no full-precision copy."""

    @abstractmethod
    def make_unit(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        """One FSDP unit around ``block``."""

    def make_root(self, model: nn.Module, plugin: EngineSettings) -> nn.Module:
        """The root FSDP unit around ``model`` (its blocks may be units already)."""
        return self.make_unit(model, plugin)

    @abstractmethod
    def checkpoint_block(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        """``block`` with its activations recomputed in backward when the settings ask for activation checkpointing
        (``block`` itself otherwise)."""

    def scan_annotations(self, plugin: EngineSettings, model: nn.Module) -> Any:
        """For ``scan_layers``: a :class:`~hf_xla_fsdp.modeling.scan.ScanAnnotations` (the sharding of stacked
        weights, their per-layer slices and the scan's output)."""
        from ..modeling.scan import ScanAnnotations

        return ScanAnnotations()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside FSDP units (and their inner wrappers), or ``model``."""
        classes = (self.unit_class(), *self.inner_wrappers())
        while isinstance(model, classes):
            model = model.module
        return model

    # ----------------------------------------------------------------- training
    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Adjust an optimizer built from the wrapped model's parameters (e.g. to update fp32 master copies)."""

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        """Zeros shaped, placed and sharded like ``param`` (optimizer state made before the first step)."""
        return torch.zeros_like(param, memory_format=torch.preserve_format)

    def optimizer_targets(self, model: nn.Module) -> list[torch.Tensor]:
        """What a prepared optimizer may update for ``model``: its parameters (and any stand-ins for them)."""
        return list(model.parameters())

    def prepare_loader(self, loader: Any, plugin: EngineSettings) -> Any:
        """An XLA device loader adjusted for this engine (e.g. inputs split over every device)."""
        return loader

    def like_step_output(self, tensor: torch.Tensor, plugin: EngineSettings) -> None:
        """Give ``tensor``, a value a training loop carries from step to step (e.g. the Trainer's running loss), the
        annotation a step's outputs come back with, so the first step's graph is the one every later step runs."""

    def whole(self, tensor: torch.Tensor, plugin: EngineSettings) -> torch.Tensor:
        """``tensor`` as a value every device holds whole (a gathered result, about to be read on the host); unchanged
        where the devices hold whole values already."""
        return tensor

    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients to ``max_norm`` over every shard of every rank; returns the total norm."""
        params = [p for p in model.parameters() if p.grad is not None]
        # in fp32 whatever the gradients' dtype: a bf16 sum of squares loses the small contributions
        local = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad, float(norm_type), dtype=torch.float32) for p in params]),
            float(norm_type)) if params else torch.zeros(())
        total = self.reduce_norm(model, local, float(norm_type))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def reduce_norm(self, model: nn.Module, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The total norm from this rank's norm of its local gradients."""
        return local

    # ----------------------------------------------------------------- names and ranks
    @abstractmethod
    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        """``(rank, world size)`` as rank files count them."""

    def checkpoint_name(self, name: str) -> str:
        """The name a parameter of the wrapped model is saved under in optimizer metadata."""
        return name

    @abstractmethod
    def original_names(self, model: nn.Module) -> dict[str, str]:
        """Wrapped parameter name -> the user's parameter name (a flattened group maps to its flat name)."""

    def parameter_origins(self, model: nn.Module) -> dict[str, list[str]]:
        """Wrapped parameter name -> the user's names of every parameter it holds (several for a flat group)."""
        return {name: [orig] for name, orig in self.original_names(model).items()}

    # ----------------------------------------------------------------- checkpoints (CheckpointCodec)
    @abstractmethod
    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """The tensors (and their metadata) this rank saves for ``model`` and ``optimizer``."""

    @abstractmethod
    def restore(self, ckpt_dir: Any, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """Load model (and optimizer) state saved by this engine, for any saved world size."""

    @abstractmethod
    def sync(self) -> None:
        """Run what is pending on the device, so pending updates land before values are read."""

    @abstractmethod
    def rng_state(self) -> Any:
        """This process's device RNG state."""

    @abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` returned."""

    @abstractmethod
    def collectives(self, thread_safe: bool = False) -> Optional[Collectives]:
        """The rendezvous between this engine's processes (a no-op in one process); ``thread_safe``: usable from a
        thread other than the training thread (None when there is none)."""
