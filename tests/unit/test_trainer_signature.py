"""The Trainer mixin takes any subclass's own signature (integrations/trainer.py ``trainer_arguments``): TRL's
``DPOTrainer(model, ref_model, args, ...)``, ``GRPOTrainer(model, reward_funcs, args, ...)``, a user's subclass that
only forwards ``*args, **kwargs``; and a TRL config's ``model_init_kwargs`` dtype is one more source of the one
conflict rule (config/resolve.py). In process, nothing built: these run before any model or device is touched."""

from __future__ import annotations

import pytest

from hf_xla_fsdp import ConfigError, process
from hf_xla_fsdp.config import resolve as r

pytest.importorskip("trl")


@pytest.fixture
def fresh(monkeypatch):
    """A process state of its own and no launch in the environment (as tests/unit/test_resolve.py)."""
    monkeypatch.setattr(process, "_STATE", process.ProcessState())
    for name in (r.LAUNCH_ENV, r.ACCELERATE_PRECISION_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_trl_trainers_bind_their_own_positional_and_keyword_arguments():
    from trl import DPOTrainer

    from hf_xla_fsdp import XlaFsdpDPOTrainer, XlaFsdpGRPOTrainer, XlaFsdpRewardTrainer, xla_fsdp_trainer
    from hf_xla_fsdp.integrations.trainer import trainer_arguments

    config, reward = object(), (lambda prompts, completions, **_: [0.0] * len(prompts))
    bound = trainer_arguments(XlaFsdpDPOTrainer, ("policy", "reference", config), {"peft_config": None})
    assert (bound.arguments["model"], bound.arguments["ref_model"], bound.arguments["args"]) == ("policy", "reference",
                                                                                                 config)
    assert bound.args == ("policy", "reference", config)  # handed on in the form it was given
    bound = trainer_arguments(XlaFsdpGRPOTrainer, ("policy", reward), {"args": config})
    assert bound.arguments["reward_funcs"] is reward and bound.arguments["args"] is config
    assert trainer_arguments(XlaFsdpRewardTrainer, ("policy", config), {}).arguments["args"] is config

    class Forwarding(DPOTrainer):  # a user's subclass that names no parameter: DPOTrainer's signature applies
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    bound = trainer_arguments(xla_fsdp_trainer(Forwarding), ("policy", None, config), {})
    assert bound.arguments["args"] is config and bound.arguments["ref_model"] is None

    # a call the subclass itself would refuse is refused the same way, naming the class
    with pytest.raises(TypeError, match=r"XlaFsdpDPOTrainer.__init__\(\) multiple values for argument 'ref_model'"):
        trainer_arguments(XlaFsdpDPOTrainer, ("policy", "reference", config), {"ref_model": "again"})


def test_a_trl_trainer_without_a_config_says_what_to_add(fresh):
    from hf_xla_fsdp import XlaFsdpGRPOTrainer

    with pytest.raises(ConfigError, match=r"^XlaFsdpGRPOTrainer needs TrainingArguments \(or a TRL config\) with "):
        XlaFsdpGRPOTrainer("policy", lambda prompts, completions, **_: [0.0])


def test_model_init_kwargs_dtype_is_one_settings_source(fresh, tmp_path):
    from transformers import TrainingArguments

    from hf_xla_fsdp.config.training_args import trainer_settings
    from hf_xla_fsdp.integrations.trl_hooks import model_init_sources

    xla = {"fsdp": "full_shard", "fsdp_config": {"xla": True}}
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **xla)
    args.model_init_kwargs = {"dtype": "bfloat16"}  # TRL's way to ask for a bf16 model: the compute dtype here
    assert str(trainer_settings(args, None, model_init_sources(args)).compute_dtype) == "torch.bfloat16"
    args.model_init_kwargs = {"dtype": "float32"}  # full precision names nothing
    assert model_init_sources(args) == [] and trainer_settings(args).compute_dtype is None

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", bf16=True, **xla)
    args.model_init_kwargs = {"dtype": "float16"}
    with pytest.raises(ConfigError) as err:
        trainer_settings(args, None, model_init_sources(args))
    assert str(err.value) == ("TrainingArguments(bf16=True) and TrainingArguments(model_init_kwargs={'dtype': "
                              "'float16'}) disagree: compute_dtype=bfloat16 vs float16; keep the setting in one place")
