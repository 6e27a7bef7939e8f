"""PPO's value head (embodyhpc/rl/critic.py): shapes, starts at 0, one embedding row per task, learns a toy value
function, refuses bad input in one line."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.rl.critic import Critic


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_shapes_and_zero_start():
    torch.manual_seed(0)
    critic = Critic(state_dim=5, num_tasks=3, hidden=16, task_dim=4)
    values = critic(torch.randn(7, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0]))
    assert values.shape == (7,) and values.dtype == torch.float32
    assert not values.any()  # a zero output layer: V = 0 before the first update
    assert Critic(state_dim=0, num_tasks=2)(torch.zeros(2, 0), torch.tensor([0, 1])).shape == (2,)


def test_each_task_reads_its_own_embedding_row():
    torch.manual_seed(0)
    critic = Critic(state_dim=2, num_tasks=3, hidden=16, task_dim=4)
    torch.nn.init.normal_(critic.out.weight)
    state = torch.randn(1, 2).expand(3, 2)
    before = critic(state, torch.tensor([0, 1, 2])).detach()
    assert len(set(before.tolist())) == 3  # same state, three tasks, three values
    with torch.no_grad():
        critic.task_embedding.weight[1] += 1.0
    after = critic(state, torch.tensor([0, 1, 2])).detach()
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]


def test_it_learns_a_task_dependent_value_function():
    """Target V = tanh(<w_task, state>), a different w per task; Adam drives the MSE below 5% of the target's
    variance."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    state, task = torch.randn(128, 4, generator=g), torch.randint(0, 3, (128,), generator=g)
    target = torch.tanh((w[task] * state).sum(-1))
    torch.manual_seed(0)
    critic = Critic(state_dim=4, num_tasks=3, hidden=32, task_dim=8)
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    for _ in range(150):
        loss = (critic(state, task) - target).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05 * target.var().item()


@pytest.mark.parametrize("state,task,match", [
    (torch.zeros(2, 3), torch.tensor([0, 1]), r"states \[N, 4\], got \(2, 3\)"),
    (torch.zeros(2, 4), torch.tensor([0]), "one task index per state"),
    (torch.zeros(2, 4), torch.tensor([0, 2]), r"task indices must be in \[0, 2\)"),
    (torch.zeros(2, 4), torch.tensor([-1, 0]), r"task indices must be in \[0, 2\)"),
])
def test_refusals(state, task, match):
    with pytest.raises(ValueError, match=match):
        Critic(state_dim=4, num_tasks=2)(state, task)
