"""Settings from every source, with one conflict rule: :func:`resolve`.

A setting can come from keyword arguments (an ``XlaFsdpPlugin`` handed to the Trainer or the Accelerator),
transformers' ``fsdp_config`` (``TrainingArguments`` or the script's ``--fsdp_config``), ``TrainingArguments`` flags
(``bf16``, ``fp16``, ``gradient_checkpointing``), an accelerate YAML (its ``fsdp_config:`` mapping and its
``mixed_precision``), accelerate's ``mixed_precision`` argument and ``ACCELERATE_MIXED_PRECISION``, and the launcher
(``--fsdp_config``, ``--config_file``, ``--mixed_precision``). Each becomes a :class:`Source`: a name that says
where it came from, and the settings it names (plugin field names). Every entry point builds its list of sources and
calls :func:`resolve`, so the rule is the same everywhere:

* each source is valid on its own (its own one-line error);
* a source that holds a whole settings mapping (an ``fsdp_config``, a YAML's ``fsdp_config:``, a plugin) selects an
  engine: it names ``version``, 1 when absent (as transformers reads a missing ``xla_fsdp_v2``); a flag names only
  what it sets (``bf16`` names ``compute_dtype``);
* two sources that name the same setting with different values are refused with one line:
  ``<source> and <source> disagree: <setting>=<value> vs <value>; keep the setting in one place``;
* otherwise the settings are the union of what the sources name, and the plugin's defaults for the rest.

The launcher hands its sources to the script's processes through :data:`LAUNCH_ENV` (:func:`hand_off`), as
``accelerate launch`` hands its settings over in ``ACCELERATE_*`` variables; a process reads them once
(:func:`launch_sources`). Inline JSON or a path is told apart here only (:func:`read_settings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, TypeVar, Union

from ..errors import ConfigError
from .keys import read_accelerate_yaml, read_settings_file

#: the settings class resolved (``XlaFsdpPlugin``: passed in, so this module below the plugin never imports it)
PluginT = TypeVar("PluginT")


class Settings(Protocol):
    """What :func:`plugin_source` reads of a plugin (an ``XlaFsdpPlugin``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable settings."""

#: the launcher's settings sources, as JSON, in the environment of the script's processes
LAUNCH_ENV = "HF_XLA_FSDP_LAUNCH"
#: what accelerate's launcher exports for the mixed precision of its YAML / command line
ACCELERATE_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"


def _show(value: Any) -> str:
    text = repr(value)
    return text.removeprefix("torch.") if text.startswith("torch.") else text


@dataclass(frozen=True)
class Source:
    """Where settings came from (``name``, used in messages) and the settings it holds (raw, in transformers',
    accelerate's or the plugin's vocabulary, as the source spelled them). ``selects_engine``: the source names
    ``version`` (absent: 1)."""

    name: str
    settings: Mapping[str, Any]
    selects_engine: bool = True

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form (see :func:`hand_off`)."""
        return {"name": self.name, "settings": dict(self.settings), "selects_engine": self.selects_engine}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Source":
        """Inverse of :meth:`to_json`."""
        return cls(str(data["name"]), dict(data["settings"]), bool(data.get("selects_engine", True)))


def resolve(sources: Sequence[Optional[Source]], plugin_cls: type[PluginT]) -> PluginT:
    """The ``plugin_cls`` the ``sources`` describe together (``None`` entries are skipped; no source: the defaults).

    Each source is normalized and checked on its own first (its own error names the problem); two sources naming
    one setting with different values are refused with the one line of the module docstring, the earlier source
    first. ``XlaFsdpPlugin.resolve(sources)`` is this with the plugin class.
    """
    checked = []
    for source in sources:
        if source is None:
            continue
        explicit = plugin_cls._normalize(source.settings, source.name)
        alone = plugin_cls(**explicit)
        named = sorted(set(explicit) | ({"version"} if source.selects_engine else set()))
        checked.append((source, explicit, alone, named))
    merged: dict[str, Any] = {}
    for i, (source, explicit, alone, named) in enumerate(checked):
        for earlier, _, earlier_alone, earlier_named in checked[:i]:
            for key in sorted(set(named) & set(earlier_named)):
                mine, theirs = getattr(alone, key), getattr(earlier_alone, key)
                if mine != theirs:
                    raise ConfigError(f"{earlier.name} and {source.name} disagree: {key}={_show(theirs)} vs "
                                      f"{_show(mine)}; keep the setting in one place")
        for key in named:
            merged.setdefault(key, explicit.get(key, getattr(alone, key)))
    try:
        return plugin_cls(**merged)
    except ConfigError as err:  # each source alone is valid: the combination is not
        raise ConfigError(f"{err} (settings from {', '.join(c[0].name for c in checked)})") from None


def names_settings(sources: Sequence[Optional[Source]]) -> bool:
    """True when a source selects an engine (a settings mapping or a plugin, not only flags)."""
    return any(s is not None and s.selects_engine for s in sources)


# --------------------------------------------------------------------------- sources
def read_settings(value: Any, what: str) -> tuple[Mapping[str, Any], str]:
    """``(mapping, name)`` of a settings value: a mapping, inline JSON (``{...}``) or the path of a JSON file.

    ``what`` names where it was given (``the launcher's --fsdp_config``); a path is added to the name.
    """
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{what} {value!r} is not valid JSON: {err}") from None
    elif isinstance(value, (str, os.PathLike)):
        path = str(value)
        value = read_settings_file(path, "fsdp_config", json.load, json.JSONDecodeError, "JSON")
        what = f"{what} {path}"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a JSON object / mapping of settings, got {type(value).__name__}")
    return value, what


def settings_source(name: str, settings: Any) -> Source:
    """A whole settings mapping in transformers' / accelerate's / our vocabulary (a mapping, inline JSON or a path):
    it names every key it holds and selects an engine."""
    mapping, name = read_settings(settings, name)
    return Source(name, dict(mapping))


def plugin_source(plugin: Settings, name: Optional[str] = None) -> Source:
    """An ``XlaFsdpPlugin`` built in code: it selects its engine and names every setting it does not leave at its
    default (a default value cannot be told from one never given)."""
    defaults = type(plugin)()
    named = [f.name for f in dataclasses.fields(plugin) if getattr(plugin, f.name) != getattr(defaults, f.name)]
    if name is None:
        name = f"fsdp_plugin=XlaFsdpPlugin({', '.join(f'{k}={_show(getattr(plugin, k))}' for k in named)})"
    values = plugin.to_dict()
    return Source(name, {k: values[k] for k in ["version", *named] if k in values})


def precision_source(name: str, precision: Any) -> Optional[Source]:
    """accelerate's / the Trainer's mixed precision (``no``, ``bf16``, ``fp16``) as a source naming ``compute_dtype``
    (on XLA FSDP it is the engine's compute dtype, never autocast, which breaks SDPA attention on XLA); ``None`` for
    ``no`` or nothing."""
    precision = str(getattr(precision, "value", precision) or "no").strip().lower()  # an enum (the Trainer's) or text
    if precision not in ("no", "bf16", "fp16", "fp8"):
        raise ConfigError(f"{name} is not valid; allowed values: no, bf16, fp16")
    if precision == "fp8":
        raise ConfigError(f"{name}: fp8 cannot be honoured on XLA FSDP; use bf16 or no")
    if precision == "no":
        return None
    return Source(name, {"compute_dtype": precision}, selects_engine=False)


def flag_source(name: str, **settings: Any) -> Source:
    """A flag that sets some settings and selects no engine (e.g. ``gradient_checkpointing=True``)."""
    return Source(name, settings, selects_engine=False)


def yaml_sources(path: Union[str, os.PathLike], *, with_precision: bool = True) -> list[Source]:
    """The sources of an accelerate YAML: its ``fsdp_config:`` mapping (when it has one) and its ``mixed_precision``."""
    data = read_accelerate_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError(f"accelerate config file {path} must hold a mapping")
    mapping = data.get("fsdp_config")
    if mapping is not None and not isinstance(mapping, Mapping):
        raise ConfigError(f"fsdp_config in {path} must be a mapping of settings")
    out = [settings_source(f"fsdp_config in {path}", mapping)] if mapping else []
    precision = data.get("mixed_precision")
    if with_precision and precision is not None:
        out.append(precision_source(f"mixed_precision={precision} in {path}", precision))
    return [s for s in out if s is not None]


def fsdp_config_from_argv(argv: Optional[Sequence[str]] = None) -> Any:
    """The ``--fsdp_config`` value a ``HfArgumentParser`` script will read from ``argv`` (default ``sys.argv[1:]``):
    a path or inline JSON, as given; also the ``fsdp_config`` of a lone ``args.json`` / ``.yaml`` file
    (``parser.parse_json_file``). ``None`` when there is none."""
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
    return value or None


def argv_sources(argv: Optional[Sequence[str]] = None) -> list[Source]:
    """The script's own ``--fsdp_config`` (read from its command line, see :func:`fsdp_config_from_argv`)."""
    value = fsdp_config_from_argv(argv)
    return [settings_source("the script's --fsdp_config", value)] if value is not None else []


def launch_sources(argv: Optional[Sequence[str]] = None, yaml_path: Union[str, os.PathLike, None] = None,
                   fsdp_config: Any = None, mixed_precision: Optional[str] = None) -> list[Source]:
    """What the launcher knows, in order: the script's ``--fsdp_config`` (``argv``), the accelerate YAML ``yaml_path``
    (``fsdp_config:`` and ``mixed_precision``), the launcher's own ``--fsdp_config`` (mapping, path or inline JSON)
    and ``--mixed_precision``; ``XlaFsdpPlugin.resolve`` checks them."""
    sources = argv_sources(argv) if argv is not None else []
    if yaml_path is not None:
        sources += yaml_sources(yaml_path)
    if fsdp_config is not None:
        sources.append(settings_source("the launcher's --fsdp_config", fsdp_config))
    if mixed_precision is not None:
        sources.append(precision_source(f"the launcher's --mixed_precision {mixed_precision}", mixed_precision))
    return [s for s in sources if s is not None]


# --------------------------------------------------------------------------- the hand-off to the script's processes
def hand_off(sources: Sequence[Source]) -> None:
    """Give the launch's ``sources`` to this process and every process it starts (:data:`LAUNCH_ENV`)."""
    from ..process import process_state

    os.environ[LAUNCH_ENV] = json.dumps([s.to_json() for s in sources])
    process_state().launch_sources = list(sources)


def watch_launch(resolver: Callable[[], list[Source]]) -> None:
    """Under a stock launcher (the start-up hook): the launch's sources are ``resolver()``'s, read on first use (the
    script's arguments are known only once it runs); a hand-off already received wins."""
    from ..process import process_state

    state = process_state()
    with state.lock:
        if state.launch_sources is None and state.launch_resolver is None:
            state.launch_resolver = resolver


def current_launch_sources() -> Optional[list[Source]]:
    """The sources of the launch that started this process: handed over (:data:`LAUNCH_ENV`) or found by the
    start-up hook's resolver; ``None`` when this process was not launched with XLA FSDP (read once, then kept)."""
    from ..process import process_state

    state = process_state()
    with state.lock:
        if state.launch_sources is None:
            raw = os.environ.get(LAUNCH_ENV)
            if raw:
                try:
                    state.launch_sources = [Source.from_json(s) for s in json.loads(raw)]
                except (ValueError, KeyError, TypeError) as err:
                    raise ConfigError(f"{LAUNCH_ENV} is not what hf-xla-fsdp launch writes ({err}); unset it") from None
            elif state.launch_resolver is not None:
                resolver, state.launch_resolver = state.launch_resolver, None
                state.launch_sources = list(resolver() or [])
        return state.launch_sources


def hook_sources() -> list[Source]:
    """The start-up hook's sources under a stock launcher: the script's ``--fsdp_config`` and the accelerate YAML
    this process was launched with (:func:`hf_xla_fsdp.config.sources.find_accelerate_config`)."""
    import sys

    from .sources import find_accelerate_config

    return launch_sources(sys.argv[1:], find_accelerate_config())
