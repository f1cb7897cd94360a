"""The session under every entry point: the engine resolved once, units tagged with it, and the upstream APIs the
integrations rely on checked against the installed versions."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_llama

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin, upstream
from hf_xla_fsdp.checkpoint.codec import codec_of
from hf_xla_fsdp.engines import ENGINES, fsdp_units


def _count_engine_lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import hf_xla_fsdp.engines as engines
    import hf_xla_fsdp.session.session as session_module

    calls: list[int] = []
    real = engines.engine_for

    def counting(plugin: XlaFsdpPlugin):
        calls.append(plugin.version)
        return real(plugin)

    monkeypatch.setattr(engines, "engine_for", counting)
    monkeypatch.setattr(session_module, "engine_for", counting)
    return calls


@pytest.mark.parametrize("layers", [2, 6])
def test_one_build_resolves_the_engine_once(monkeypatch, layers):
    calls = _count_engine_lookups(monkeypatch)
    model = XlaFsdpPlugin().build(tiny_llama(num_hidden_layers=layers), progress=False)
    assert len([name for name, _ in fsdp_units(model)]) == layers + 1  # every block and the root are units
    assert calls == [1]  # one lookup for the whole build, however many blocks


@pytest.mark.xla
def test_one_wrap_resolves_the_engine_once_and_tags_every_unit(monkeypatch):
    from hf_xla_fsdp.modeling.meta_init import build_eager

    calls = _count_engine_lookups(monkeypatch)
    model = XlaFsdpPlugin(activation_checkpointing=True).wrap(build_eager(tiny_llama(num_hidden_layers=4)))
    assert calls == [1]
    units = [unit for _, unit in fsdp_units(model)]
    assert len(units) == 5 and all(codec_of(unit) is ENGINES["xla_v1"] for unit in units)


def test_plugin_versions_are_the_engines():
    """The older ``version`` spelling selects, among the engines sharing an alias, the one declaring that version; an
    unknown one is refused with the versions the engines declare. (``version=1`` alone is its default, i.e. unsaid:
    the default engine, fsdp2 where torch_xla is not installed, as before engine keys.)"""
    assert {XlaFsdpPlugin(engine=e.aliases[0], version=e.version).engine for e in ENGINES.values() if e.version} == {
        k for k, e in ENGINES.items() if e.version}
    assert XlaFsdpPlugin(version=2).engine == "xla_v2"  # not the default: it selects v2 whatever is installed
    with pytest.raises(ConfigError, match=r"version=3 is not valid; allowed values: 1 \(engine=xla_v1, FSDP v1"):
        XlaFsdpPlugin(version=3)


@pytest.mark.xla
def test_every_upstream_api_we_rely_on_is_installed_as_we_use_it():
    # an optional entry has a fallback in our code and may be missing from an older release; on the newest tested
    # combination (constraints/tested.txt) every entry must be there, so a rename there is seen
    newest = upstream.tested_combination(upstream.installed_versions()) == "constraints/tested.txt"
    found = [(e, why) for e, why in upstream.problems() if newest or not e.optional]
    assert not found, "\n".join(f"{e.target}: {why}" for e, why in found)


def test_an_optional_upstream_api_that_is_gone_refuses_nothing(monkeypatch):
    gone = upstream.Upstream("torch_xla", "probe", "torch_xla:_XLAC._not_a_function", None, "a probe", optional=True)
    monkeypatch.setattr(upstream, "RELIED_ON", (gone,))
    monkeypatch.setattr(upstream, "_checked", set())
    assert [p for _, p in upstream.problems("probe")] == ["torch_xla:_XLAC._not_a_function is gone"]
    upstream.require("probe")  # our code has a fallback: no refusal
    monkeypatch.setattr(upstream, "RELIED_ON", (dataclasses.replace(gone, optional=False),))
    monkeypatch.setattr(upstream, "_checked", set())
    with pytest.raises(ConfigError, match="_XLAC._not_a_function is gone"):
        upstream.require("probe")


def test_a_changed_upstream_api_is_one_line(monkeypatch):
    import transformers.trainer

    def moved(self, model, trial, extra):  # a release that changed what the Trainer passes
        return None

    monkeypatch.setattr(transformers.trainer.Trainer, "_save_checkpoint", moved)
    monkeypatch.setattr(upstream, "_checked", set())
    with pytest.raises(ConfigError) as err:
        upstream.require("trainer")
    message = str(err.value)
    assert "\n" not in message and message.startswith("transformers 5.")
    assert "Trainer._save_checkpoint takes (model, trial, extra), not (model, trial)" in message
    monkeypatch.delattr(transformers.trainer.Trainer, "_load_best_model")
    monkeypatch.setattr(upstream, "_checked", set())
    with pytest.raises(ConfigError, match=r"(and 1 more)"):
        upstream.require("trainer")


@pytest.mark.xla
def test_the_trainer_callback_saves_and_stops_on_sigterm_only_during_a_train_that_watches():
    import os
    import signal

    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_xla_fsdp.integrations.trainer import XlaFsdpCallback
    from hf_xla_fsdp.session import XlaFsdpSession

    session = XlaFsdpSession(XlaFsdpPlugin())
    assert session.watch_preemption()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, e.g. while a script read accelerator.preempted
    finally:
        session.stop_watching_preemption()
    assert session.preempted
    callback, args = XlaFsdpCallback(session), TrainingArguments(output_dir="unused", report_to=[])
    control = callback.on_step_end(args, TrainerState(global_step=3), TrainerControl())
    # a train() that does not watch (save_strategy "no", or a later train()) trains on
    assert not control.should_save and not control.should_training_stop and callback.preempted_at is None
    callback.watching = True
    control = callback.on_step_end(args, TrainerState(global_step=3), TrainerControl())
    assert control.should_save and control.should_training_stop and callback.preempted_at == 3
