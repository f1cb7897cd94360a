"""A stand-in for TorchTPU (``torch_tpu``) on a machine without a TPU, for tests/unit/test_fsdp2_engine.py.

It registers what the real package registers when torch loads it (torch_tpu 0.2.0's ``_loader.load``): torch's
PrivateUse1 device renamed ``tpu`` with a ``torch.tpu`` device module, and the torch.distributed backends ``tpu`` /
``tpu_dist`` for that device, ``tpu_dist`` as its default. Nothing runs on it: the tests only check that engine fsdp2
would pick that device and backend, and that doing so imports no torch_xla.
"""

import types

import torch
import torch.distributed as dist

torch.utils.rename_privateuse1_backend("tpu")
_module = types.ModuleType("torch.tpu")
_module.is_available = lambda: True
_module.device_count = lambda: 4
_module.set_device = lambda index: None
torch._register_device_module("tpu", _module)


def _create_process_group(*args, **kwargs):  # never called: no process group is made in the tests
    raise RuntimeError("the fake torch_tpu has no collectives")


for _name in ("tpu", "tpu_dist"):
    dist.Backend.register_backend(_name, _create_process_group, devices=["tpu"])
dist.Backend.default_device_backend_map["tpu"] = "tpu_dist"
