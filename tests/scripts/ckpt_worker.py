"""One rank of a real multi-process save: started N times by ``helpers.run_ranks``, each process joins a gloo group on
127.0.0.1, builds its OWN rank's FSDP v1 state for a world of N (``sharding_groups``, one XLA:CPU device, no XLA
collectives) and saves checkpoints through ``save_checkpoint`` with torch.distributed's barrier and gather.

    ckpt_worker.py --rank R --world N --port P --root DIR [--saves K] [--stall] [--timeout S] [--first I]
                   [--fsize-limit-after-first BYTES] [--async-save] [--storage MODE] [--pause-before I:S]

Prints ``ready``, then ``saving I`` / ``saved I`` around each save of ``DIR/checkpoint-I``; a save that fails
prints ``error: <the one line>`` and exits 3. ``--stall``: this rank never arrives at the save (it sleeps).
``--async-save``: each save returns once the state is on the host; the files are written and committed in a
background thread with the library's default (thread-safe, gloo) collectives, and the worker waits for the last one.
``--storage``: save_checkpoint's storage mode (``DIR`` may then be a URL; a simulated host is ``$HF_XLA_FSDP_HOST``).
``--pause-before I:S``: this rank sleeps S seconds before save I (the others write their files meanwhile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import build_rank, fake_adam_rank, tiny_llama  # noqa: E402

from hf_xla_fsdp.checkpoint import save_checkpoint, wait_for_pending_save  # noqa: E402
from hf_xla_fsdp.errors import CheckpointError  # noqa: E402
from hf_xla_fsdp.runtime import dist_barrier, dist_gather  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", required=True, help="checkpoints go to ROOT/checkpoint-I")
    p.add_argument("--saves", type=int, default=1)
    p.add_argument("--first", type=int, default=0, help="index of the first checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds the barrier and gather wait for every rank")
    p.add_argument("--stall", action="store_true", help="this rank never arrives at the save")
    p.add_argument("--fsize-limit-after-first", type=int, default=None,
                   help="after the first save, RLIMIT_FSIZE: writing a file past this size fails (EFBIG, a full disk)")
    p.add_argument("--async-save", action="store_true", help="save in the background (default collectives)")
    p.add_argument("--storage", default="auto", help="checkpoint storage mode (auto, shared, local, object)")
    p.add_argument("--pause-before", default=None, help="I:S: sleep S seconds before save I")
    p.add_argument("--side-file", default=None, help="rank 0 adds this file (as a Trainer adds trainer_state.json)")
    args = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout + 60))
    model = build_rank(tiny_llama(), args.world, args.rank, seed=args.seed)
    optimizer = fake_adam_rank(model, args.seed, args.rank)
    print("ready", flush=True)
    barrier, gather = dist_barrier(args.timeout), dist_gather(args.timeout)
    for i in range(args.first, args.first + args.saves):
        if args.stall:
            time.sleep(args.timeout * 3)
            return 0
        if args.pause_before is not None and int(args.pause_before.split(":")[0]) == i:
            time.sleep(float(args.pause_before.split(":")[1]))
        print(f"saving {i}", flush=True)
        where = f"{args.root}/checkpoint-{i}" if "://" in args.root else Path(args.root) / f"checkpoint-{i}"
        try:
            if args.async_save:
                save_checkpoint(where, model, optimizer, step=i, async_save=True, storage=args.storage)
            else:
                def side(stage, i=i):
                    if args.side_file:
                        (Path(stage) / args.side_file).write_text(json.dumps({"global_step": i}))

                save_checkpoint(where, model, optimizer, step=i, barrier=barrier, gather=gather, storage=args.storage,
                                before_commit=side)
        except CheckpointError as err:
            print(f"error: {err}", flush=True)
            return 3
        print(f"saved {i}", flush=True)
        if args.fsize_limit_after_first is not None and i == args.first:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit_after_first, args.fsize_limit_after_first))
    try:
        wait_for_pending_save()
    except CheckpointError as err:
        print(f"error: {err}", flush=True)
        return 3
    print("done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)  # N processes share 2 cores
    sys.exit(main())
