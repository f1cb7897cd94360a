"""accelerate's own test script (``accelerate test``: accelerate/test_utils/scripts/test_script.py) section by section.

Run it under ``accelerate launch --config_file cfg.yaml tests/scripts/accelerate_test_script.py [stock]``: the
script's ``main()`` stops at the first failing section, so this driver runs the same sections in the same order, with
the same conditions, and reports each one. By default ``Accelerator`` is resolved to ``XlaFsdpAccelerator`` (in
``accelerate`` and in the test script's module, where its functions look it up); ``stock`` keeps accelerate's own.
The last line is JSON: ``{"accelerator": ..., "sections": {name: "passed" | "failed: <error>"}}``.
"""

from __future__ import annotations

import json
import sys
import traceback

import accelerate
from accelerate.test_utils.scripts import test_script as ts
from accelerate.utils import DistributedType, is_datasets_available, is_pytest_available


def sections(state) -> list[tuple[str, object]]:
    """test_script.main()'s sections, in its order, under its conditions (accelerate 1.15)."""
    out = [("Initialization", ts.init_state_check)]
    if state.distributed_type == DistributedType.MULTI_GPU:
        import torch

        per_node = torch.cuda.device_count()
    else:
        per_node = state.num_processes
    if per_node == state.num_processes:  # main() runs these on one node only
        out += [("process execution", ts.process_execution_check),
                ("split between processes as a list", ts.test_split_between_processes_list),
                ("split between processes as a dict", ts.test_split_between_processes_nested_dict),
                ("split between processes as a tensor", ts.test_split_between_processes_tensor),
                ("split between processes evenly", ts.test_split_between_processes_evenly)]
        if is_datasets_available():
            from datasets import Dataset

            out.append(("split between processes as a datasets.Dataset",
                        lambda: ts.test_split_between_processes_dataset(Dataset)))
    out.append(("random number generator synchronization", ts.rng_sync_check))

    def dataloaders() -> None:
        ts.dl_preparation_check()
        if state.distributed_type != DistributedType.XLA:
            ts.central_dl_preparation_check()
            ts.custom_sampler_check()
            ts.check_seedable_sampler()
            ts.check_seedable_sampler_with_data_seed()
        if state.num_processes > 1:
            ts.check_seedable_sampler_in_batch_sampler_shard()

    out.append(("DataLoader integration", dataloaders))
    if state.distributed_type != DistributedType.DEEPSPEED:
        out.append(("Training integration", lambda: (ts.training_check(use_seedable_sampler=False),
                                                     ts.training_check(use_seedable_sampler=True))))
        out.append(("Breakpoint trigger", ts.test_trigger))
        if is_pytest_available():
            out.append(("reinstantiated state", ts.test_reinstantiated_state))
    return out


def main() -> None:
    """Every section of accelerate's test script with the chosen Accelerator; one report line per section."""
    which = sys.argv[1] if len(sys.argv) > 1 else "ours"
    if which == "ours":
        from hf_xla_fsdp import XlaFsdpAccelerator

        accelerate.Accelerator = XlaFsdpAccelerator
        ts.Accelerator = XlaFsdpAccelerator  # the test script's functions look Accelerator up in their module
    accelerator = ts.Accelerator()
    state = accelerator.state
    main_process = state.process_index == 0  # the last section resets the state
    results: dict[str, str] = {}
    for name, check in sections(state):
        try:
            check()
            results[name] = "passed"
        except Exception as err:  # report and go on: main() would stop here
            first = (str(err).strip().splitlines() or [""])[0]
            results[name] = f"failed: {type(err).__name__}: {first}"
            traceback.print_exc()
        print(f"SECTION {name}: {results[name]}", flush=True)
    if main_process:
        print(json.dumps({"accelerator": type(accelerator).__name__, "sections": results}), flush=True)


if __name__ == "__main__":
    main()
