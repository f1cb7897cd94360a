"""Models in evaluation mode: what TRL's reference, teacher and reward models are (``prepare_model(model,
evaluation_mode=True)``, ``session.build_model(..., evaluation_mode=True)``).

They are sharded like a trained model, but frozen before sharding: no gradients, no fp32 master copies, shards stored
in the compute dtype, never attached to an optimizer, and the same outputs as the eager model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_python, tiny_llama
from transformers import LlamaForCausalLM

from hf_xla_fsdp import ConfigError, XlaFsdpAccelerator, XlaFsdpPlugin, XlaFsdpSession
from hf_xla_fsdp.engines import fsdp_units, in_evaluation_mode

# bf16 keeps 8 significant bits: a value rounds by at most 2**-9 of itself, and a forward of 3 blocks adds a few such
# roundings per activation; 4 * 2**-8 of the largest logit bounds what the tiny Llama showed (3e-3 of logits ~1)
BF16_LOGITS = 4 * 2**-8


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama()).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return path, ids, logits


def _logits(model, ids):
    import torch_xla

    with torch.no_grad():
        return model(input_ids=ids.to(torch_xla.device())).logits.cpu().float()


def test_built_for_inference_on_v1_is_frozen_in_the_compute_dtype_and_equals_eager(pretrained):
    path, ids, eager = pretrained
    fp32 = XlaFsdpSession(XlaFsdpPlugin()).build_model(path, evaluation_mode=True, progress=False)
    assert not fp32.training and in_evaluation_mode(fp32)
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in fp32.parameters())
    # fp32: the same operations as eager on the gathered weights; XLA's CPU kernels sum in another order
    torch.testing.assert_close(_logits(fp32, ids), eager, atol=1e-6, rtol=0)

    # sharding zero2 trains with the root only, but an inference model never gathers all its blocks at once
    bf16 = XlaFsdpSession(XlaFsdpPlugin(compute_dtype="bfloat16", sharding="zero2")).build_model(
        path, evaluation_mode=True, progress=False)
    units = [name for name, _ in fsdp_units(bf16)]
    assert len(units) == 4  # 3 blocks and the root
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in bf16.parameters())
    diff = (_logits(bf16, ids) - eager).abs().max().item()
    assert diff <= BF16_LOGITS * eager.abs().max().item(), diff


def test_each_rank_holds_only_its_shard_in_the_compute_dtype(pretrained):
    """2 ranks of FSDP v1 built in one process (sharding_groups): rank r's model holds half of every tensor, in
    bf16, and the two halves are the pretrained weights rounded to bf16."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    path, _, _ = pretrained
    eager = LlamaForCausalLM.from_pretrained(path)
    total = sum(p.numel() for p in eager.parameters())
    ranks = [XlaFsdpSession(XlaFsdpPlugin(sharding_groups=[[0, 1]], sharding_rank=r, sharding_world_size=2,
                                          compute_dtype="bfloat16")).build_model(path, evaluation_mode=True,
                                                                                  progress=False)
             for r in range(2)]
    for model in ranks:
        held = sum(p.numel() for p in model.parameters())
        # half of every tensor, each padded to a multiple of 128 per rank (torch_xla's shard size multiple)
        assert total / 2 <= held <= total / 2 + 128 * len(list(model.parameters())), (held, total)
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    state = consolidate_sharded_state_dicts([{k: v.cpu() for k, v in m.state_dict().items()} for m in ranks],
                                            ranks[0].get_shard_metadata())
    for name, tensor in eager.state_dict().items():
        if name in state:  # the tied / non-persistent ones are not in FSDP's state
            assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_prepared_for_inference_is_never_attached_to_an_optimizer(pretrained):
    """A DPO-shaped step: the policy trains, the reference only runs forward under no_grad."""
    path, ids, _ = pretrained
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(compute_dtype="bfloat16"))
    policy = accelerator.build_model(path)
    reference = accelerator.prepare_model(LlamaForCausalLM.from_pretrained(path), evaluation_mode=True)
    policy, optimizer = accelerator.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
    assert accelerator.prepare_model(reference, evaluation_mode=True) is reference  # prepared once
    assert [m is policy for m in accelerator._models] == [True]
    frozen = {id(p) for p in reference.parameters()}
    assert not frozen & {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]}
    batch = ids.to(accelerator.device)
    with torch.no_grad():
        ref_logps = reference(input_ids=batch).logits.float().log_softmax(-1)
    logps = policy(input_ids=batch).logits.float().log_softmax(-1)
    accelerator.backward((logps - ref_logps).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in reference.parameters())
    assert not frozen & {id(p) for p in optimizer.optimizer.state}
    assert optimizer.optimizer.state  # the policy's did step
    with pytest.raises(ConfigError, match="blocks were wrapped for training; finish wrapping it with evaluation_mode=False"):
        accelerator.xla_fsdp_session.finish_wrapping(
            accelerator.xla_fsdp_session.build_model(path, wrap_root=False, progress=False), evaluation_mode=True)


V2_INFERENCE = r'''
import json, sys, torch
from transformers import LlamaForCausalLM
from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin
from hf_xla_fsdp.engines.master_weights import master_weights
from hf_xla_fsdp.engines.v2 import device_bytes
path = sys.argv[1]
accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(version=2, compute_dtype="bfloat16"))
policy = accelerator.build_model(path)
reference = accelerator.build_model(path, evaluation_mode=True)
policy, optimizer = accelerator.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
reference = accelerator.prepare_model(reference, evaluation_mode=True)
ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
model = LlamaForCausalLM.from_pretrained(path).eval()
with torch.no_grad():
    logits = reference(input_ids=ids.to(accelerator.device)).logits.cpu().float()
    eager = model(input_ids=ids).logits
total = sum(p.numel() for p in model.parameters())
print(json.dumps({
    "masters": len(master_weights(reference).pairs), "policy_masters": len(master_weights(policy).pairs),
    "dtypes": sorted({str(p.dtype) for p in reference.parameters()}),
    "trainable": sum(p.requires_grad for p in reference.parameters()),
    "attached": len({id(p) for p in reference.parameters()}
                    & {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]}),
    "device_bytes": list(device_bytes(reference).values()), "bf16_bytes": 2 * total,
    "diff": (logits - eager).abs().max().item(), "scale": eager.abs().max().item()}))
'''


@pytest.mark.slow
def test_v2_inference_model_has_no_master_copies_and_a_quarter_per_device(pretrained, tmp_path):
    import json

    path, _, _ = pretrained
    script = tmp_path / "v2_inference.py"
    script.write_text(V2_INFERENCE)
    res = run_python([script, path], devices=4, timeout=600, preloaded=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["masters"] == 0 and out["policy_masters"] > 0  # the trained model of the same run has its fp32 copies
    assert out["dtypes"] == ["torch.bfloat16"] and out["trainable"] == 0 and out["attached"] == 0
    # every tensor split over 4 devices (dim 0 of each is a multiple of 4 here, so no padding): a quarter each
    assert out["device_bytes"] == [out["bf16_bytes"] // 4] * 4, out
    assert out["diff"] <= BF16_LOGITS * out["scale"], out
