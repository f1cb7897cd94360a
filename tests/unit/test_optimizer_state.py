"""Optimizer state created before the first step (so step 1 traces step 2's graph) is the state torch would make
lazily, and training with it gives the same numbers, bit for bit."""

import copy

import pytest
import torch

from hf_xla_fsdp.session.optimizers import create_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(5, 8, generator=g)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_created_state_is_torchs_own_and_trains_the_same(name: str) -> None:
    lazy_model, made_model = _model(), _model()
    lazy, made = OPTIMIZERS[name](lazy_model.parameters()), OPTIMIZERS[name](made_model.parameters())
    assert create_state(made)
    # the same keys, dtypes and devices as torch's lazy initialization makes in a first step
    probe_model = copy.deepcopy(lazy_model)
    probe = OPTIMIZERS[name](probe_model.parameters())
    for p in probe_model.parameters():
        p.grad = torch.zeros_like(p)
    probe.step()
    for p_probe, p_made in zip(probe_model.parameters(), made_model.parameters()):
        want, got = probe.state[p_probe], made.state[p_made]
        assert sorted(want) == sorted(got)
        for key in want:
            assert (want[key].dtype, want[key].device, want[key].shape) == (got[key].dtype, got[key].device,
                                                                            got[key].shape), key
    _train(lazy_model, lazy)
    _train(made_model, made)
    for a, b in zip(lazy_model.parameters(), made_model.parameters()):
        assert torch.equal(a, b)


def test_optimizers_it_does_not_know_keep_their_lazy_state() -> None:
    model = _model()
    for optimizer in (torch.optim.RMSprop(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)):
        assert not create_state(optimizer)
        assert not optimizer.state


def test_state_that_exists_is_left_alone() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps=1)
    before = {id(t) for s in optimizer.state.values() for t in s.values()}
    assert not create_state(optimizer)
    assert before == {id(t) for s in optimizer.state.values() for t in s.values()}
