"""FSDP v1's sharded math at world size 2, in one process: XLA:CPU cannot run v1 collectives between processes
(they hang upstream: pytorch/xla#5005, #9089), so the two ranks are built here with ``sharding_groups`` (each holding
exactly what its own process would) and their units' all-gather and reduce-scatter are carried out across the two
models in this process. Everything else is the units' own code: flattening and padding to the world size, cutting a
rank's shard, rebuilding full parameters for forward and again for backward, pre- and post-dividing gradients, and
accumulating each rank's reduced shard. The reference is the same weights as a plain model on the CPU.

Not covered here (docs/troubleshooting.md, "What runs on XLA:CPU"): the collectives themselves (XLA's all-gather and
reduce-scatter over real devices, their bucketing and overlap), and a whole multi-process training run.
"""

from __future__ import annotations

import functools

import torch
from helpers import build_ranks, tiny_llama

WORLD = 2


def units(model: torch.nn.Module) -> list:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    return [m for m in model.modules() if isinstance(m, XlaFullyShardedDataParallel)]


class ReduceScatterAcross:
    """Each rank's post-backward hands its padded flat gradient here; once every rank's backward ran, :meth:`run`
    sums them (the collective's REDUCE_SUM, times its ``scale``) and gives rank r its r-th shard, through the unit's
    own callback (post-division, accumulation into the shard's ``.grad``)."""

    def __init__(self, scale: float) -> None:
        self.scale, self.calls = scale, []

    def __call__(self, grad_flat: torch.Tensor, callback) -> None:
        self.calls.append((grad_flat, callback))

    def flush(self) -> None:  # the units call it at the end of their backward: the sum waits for every rank
        pass


def emulate_collectives(ranks: list[torch.nn.Module]) -> list[list[ReduceScatterAcross]]:
    """Replace every unit's all-gather (rank r's unit gathers the matching shards of every rank's unit) and
    reduce-scatter (:class:`ReduceScatterAcross`); returns the reduce-scatters, per rank, per unit."""
    per_rank = [units(m) for m in ranks]
    assert len({len(u) for u in per_rank}) == 1 and len(per_rank[0]) > 1  # the same nested units on every rank
    scatters = []
    for r, rank_units in enumerate(per_rank):
        scatters.append([])
        for i, unit in enumerate(rank_units):
            peers = [per_rank[q][i] for q in range(WORLD)]
            pending: list[int] = []

            def rebuild(*args, _unit=unit, _original=unit._rebuild_full_params, _pending=pending, **kwargs):
                # the parameters this call gathers, in the order it gathers them
                _pending[:] = [k for k, p in enumerate(_unit.full_params) if not p._has_full_param]
                return _original(*args, **kwargs)

            def all_gather(shard: torch.Tensor, groups=None, _peers=peers, _pending=pending) -> torch.Tensor:
                k = _pending.pop(0)
                return torch.cat([peer.sharded_params[k].to(shard.dtype).view(shard.shape) for peer in _peers])

            unit._rebuild_full_params = rebuild
            unit.all_gather_op = all_gather
            scatter = ReduceScatterAcross(unit.reduce_scatter_op.scale)
            unit.reduce_scatter_op = scatter
            scatters[-1].append(scatter)
    return scatters


def finish_reduce_scatters(scatters: list[list[ReduceScatterAcross]]) -> None:
    for per_unit in zip(*scatters):  # unit i of every rank
        assert len({len(s.calls) for s in per_unit}) == 1
        for k in range(len(per_unit[0].calls)):
            flats = [s.calls[k][0] for s in per_unit]
            total = functools.reduce(torch.add, flats) * per_unit[0].scale
            shard = total.numel() // WORLD
            for r, s in enumerate(per_unit):
                s.calls[k][1](total[r * shard:(r + 1) * shard])


def test_two_ranks_forward_and_backward_equal_the_full_model():
    import torch_xla
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts
    from transformers import LlamaForCausalLM

    config = tiny_llama(num_hidden_layers=2, vocab_size=100)  # 100 x 64 embeddings: FSDP pads them to the world size
    ranks = build_ranks(config, WORLD)
    for model in ranks:
        model.train()
    metadata = ranks[0].get_shard_metadata()
    full = consolidate_sharded_state_dicts([{k: v.cpu() for k, v in m.state_dict().items()} for m in ranks], metadata)
    reference = LlamaForCausalLM(config)
    assert not reference.load_state_dict(full, strict=False).missing_keys  # a tied lm_head comes back with its table
    scatters = emulate_collectives(ranks)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 100, (2, 12), generator=g) for _ in range(WORLD)]  # each rank its own batch
    losses = []
    for model, ids in zip(ranks, batches):
        ids = ids.to(torch_xla.device())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    finish_reduce_scatters(scatters)
    torch_xla.sync()

    # the reference: each rank's loss on its batch; the gradient FSDP leaves is the mean of the ranks' gradients
    ref_losses = [reference(input_ids=ids, labels=ids).loss for ids in batches]
    (sum(ref_losses) / WORLD).backward()
    # fp32 on both sides: only the summation order differs (XLA's fused kernels against eager CPU ops)
    for loss, ref in zip(losses, ref_losses):
        assert abs(loss.item() - ref.item()) < 1e-5
    grads = consolidate_sharded_state_dicts(
        [{name.replace("_fpw_module.", ""): p.grad.cpu() for name, p in m.named_parameters()} for m in ranks], metadata)
    ref_grads = dict(reference.named_parameters())
    assert set(grads) <= set(ref_grads) and len(grads) >= len(ref_grads) - 1  # lm_head tied: stored once
    for name, grad in grads.items():
        want = ref_grads[name].grad
        # gradients of magnitude <= ~1 after two reductions in another order: 1e-5 absolute
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=name)
    # every rank holds only its shard of each gradient: the padded flat gradient's r-th half
    for model in ranks:
        for unit in units(model):
            for p in unit.sharded_params:
                assert p.grad is not None and p.grad.shape == p.shape
