"""Bytes each XLA device really holds for FSDP v2 (SPMD): parameters, gradients and AdamW state of a tiny Llama.

Started by tests/unit/test_tpu_plan.py as ``python tests/scripts/tpu_plan_worker.py CONFIG_JSON [TENSOR_PARALLEL_SIZE]``
with CPU_NUM_DEVICES set
(SPMD and the device count are fixed per process); prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from helpers import tiny_llama  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin  # noqa: E402


def per_device(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes each device allocates for ``tensors`` (XLA pads uneven shards: the local shards carry the padding)."""
    import torch_xla

    out: dict[str, int] = {}
    for t in tensors:
        for shard, device in torch_xla._XLAC._get_local_shards([t])[0]:
            out[device] = out.get(device, 0) + shard.numel() * shard.element_size()
    return dict(sorted(out.items()))


def main() -> None:
    """Build, run one AdamW step, report."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    from hf_xla_fsdp.engines.v2 import get_mesh, shard_batch

    config = tiny_llama(**json.loads(sys.argv[1]))
    plugin = XlaFsdpPlugin(version=2, tensor_parallel_size=int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    torch.manual_seed(0)
    model = plugin.build(config, progress=False)
    params = list(model.parameters())
    xm.wait_device_ops()  # shard placements can only be read once nothing is in flight
    report = {"param_bytes_per_device": per_device(params)}
    opt = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (8, 8))
    batch = shard_batch({"input_ids": ids.to(torch_xla.device()), "labels": ids.to(torch_xla.device())}, get_mesh(plugin))
    model(**batch).loss.backward()
    opt.step()
    torch_xla.sync()
    xm.wait_device_ops()
    report["grad_bytes_per_device"] = per_device([p.grad for p in params])
    report["adamw_bytes_per_device"] = per_device([t for s in opt.state.values() for t in s.values()
                                                   if isinstance(t, torch.Tensor) and t.device.type == "xla"])
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
