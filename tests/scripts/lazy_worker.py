"""One process launched as `hf-xla-fsdp launch` launches (the settings handed over, the patches installed), where a
script's `from_pretrained` / `from_config` load lazily; each case compares with the eager load (our patches bypassed)
and prints one JSON line.

    python lazy_worker.py PRETRAINED_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from hf_xla_fsdp.config import resolve as r
from hf_xla_fsdp.integrations import launched

r.hand_off(r.launch_sources(fsdp_config='{"xla": true}'))
launched.start(what="the test")

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin, XlaFsdpSession  # noqa: E402
from hf_xla_fsdp.modeling.lazy import LazyParameter, bypass, lazy_state  # noqa: E402
from hf_xla_fsdp.runtime import xla_device  # noqa: E402

PRE, OUT = sys.argv[1], sys.argv[2]
IDS = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
report: dict = {}


def eager(name: str = PRE, **kwargs):
    with bypass():
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def wrapped(model) -> tuple[dict, torch.Tensor]:
    """Wrapped as the Trainer and the Accelerator wrap (the session), the full weights and the logits of IDS."""
    session = XlaFsdpSession(XlaFsdpPlugin())
    model = session.wrap_model(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS.to(xla_device())).logits.cpu()
    return session.checkpoints.full_state_dict(model, is_main=True), logits


# 1. loaded lazily: nothing on the host; wrapped, it equals the eager load wrapped the same way, bit for bit
lazy = AutoModelForCausalLM.from_pretrained(PRE)
params = list(lazy.parameters())
report["lazy"] = bool(lazy_state(lazy)) and all(isinstance(p, LazyParameter) and p.is_meta for p in params)
report["eval_mode"] = not lazy.training  # from_pretrained returns the model in eval mode
lazy_weights, lazy_logits = wrapped(lazy)
eager_weights, eager_logits = wrapped(eager())
reference = eager()  # a model of its own: wrapping changes the model it wraps
report["wrapped_weights_equal"] = same(lazy_weights, eager_weights)
report["wrapped_logits_equal"] = torch.equal(lazy_logits, eager_logits)
report["weights_equal_eager_load"] = same(lazy_weights, {k: v for k, v in eager().state_dict().items()
                                                          if k in lazy_weights})

# 2. a stock Trainer of a launched script builds it lazily (no warning, the skeleton filled block by block)
lazy = AutoModelForCausalLM.from_pretrained(PRE)
lazy.config.use_cache = False  # edits between loading and wrapping stay
trainer = Trainer(model=lazy, args=TrainingArguments(output_dir=OUT + ".trainer", report_to="none", max_steps=1))
inner = trainer.xla_fsdp_session.unwrap(trainer.model)
report["trainer"] = [type(trainer).__name__, lazy_state(lazy) is None, inner is lazy, inner.config.use_cache]

# 3. what needs the values loads the whole model in place first, exactly as eager loading
lazy = AutoModelForCausalLM.from_pretrained(PRE)
held = lazy.lm_head.weight  # a reference the script keeps gets the values too
total = float(lazy.lm_head.weight.sum())
report["value_read"] = [lazy_state(lazy) is None, not held.is_meta, type(held) is nn.Parameter,
                        total == float(reference.lm_head.weight.sum()), same(lazy.state_dict(), reference.state_dict())]

# .to(dtype) stays lazy: the weights are cast as they are read, as an eager cast after loading
lazy = AutoModelForCausalLM.from_pretrained(PRE).to(torch.bfloat16)
report["cast_stays_lazy"] = lazy_state(lazy) is not None and lazy.lm_head.weight.dtype == torch.bfloat16
report["cast_equal"] = same(lazy.state_dict(), eager().to(torch.bfloat16).state_dict())

# resize_token_embeddings (run_clm when the tokenizer is larger) draws the new rows from the RNG: the same draws
torch.manual_seed(7)
lazy = AutoModelForCausalLM.from_pretrained(PRE)
lazy.resize_token_embeddings(130)
after_lazy = torch.rand(3)
torch.manual_seed(7)
resized = eager()
resized.resize_token_embeddings(130)
report["resize_equal"] = [same(lazy.state_dict(), resized.state_dict()), torch.equal(after_lazy, torch.rand(3))]

# peft's get_peft_model, as scripts call it before the trainer: loaded whole first, then the same adapters
from peft import LoraConfig, get_peft_model  # noqa: E402

lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
torch.manual_seed(11)
peft_lazy = get_peft_model(AutoModelForCausalLM.from_pretrained(PRE), lora)
torch.manual_seed(11)
peft_eager = get_peft_model(eager(), lora)
report["peft_equal"] = same(peft_lazy.state_dict(), peft_eager.state_dict())

# a parameter added on meta after loading has no values: refused when wrapped, one line
lazy = AutoModelForCausalLM.from_pretrained(PRE)
lazy.extra_head = nn.Linear(4, 4, device="meta")
try:
    XlaFsdpSession(XlaFsdpPlugin()).wrap_model(lazy)
    report["foreign_meta"] = "not refused"
except ConfigError as err:
    report["foreign_meta"] = str(err)

# 4. from_config: the RNG moves as eager construction moves it, the wrapped weights are eager's
config = reference.config
torch.manual_seed(5)
fresh = AutoModelForCausalLM.from_config(config)
after_lazy = torch.rand(4)
torch.manual_seed(5)
with bypass():
    fresh_eager = AutoModelForCausalLM.from_config(config)
after_eager = torch.rand(4)
report["from_config_lazy"] = lazy_state(fresh) is not None
report["from_config_rng"] = torch.equal(after_lazy, after_eager)
fresh_weights, _ = wrapped(fresh)
report["from_config_equal"] = same(fresh_weights, {k: v for k, v in fresh_eager.state_dict().items()
                                                   if k in fresh_weights})

# 5. a Hub id in the local cache (HF_HOME set by the test), and the documented path given one
cached = AutoModelForCausalLM.from_pretrained("tiny-org/tiny-llama")
report["hub_lazy"] = lazy_state(cached) is not None
built = XlaFsdpPlugin().build("tiny-org/tiny-llama", progress=False)
report["hub_build"] = type(built).__name__
try:
    XlaFsdpPlugin().build("tiny-org/not-downloaded", progress=False)
    report["hub_missing"] = "not refused"
except ConfigError as err:
    report["hub_missing"] = str(err)

with open(OUT, "w") as fh:
    json.dump(report, fh)
print(json.dumps(report))
