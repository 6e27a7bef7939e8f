"""PPO's value head (embodyhpc/rl/critic.py): shapes, starts at 0, one embedding row per task, learns a toy value
function, refuses bad input in one line; the explained variance the actor logs per version, against a hand
computation."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.rl.critic import Critic, explained_variance


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


def test_explained_variance_of_a_version_against_a_hand_computation():
    """1 - Var(returns - values) / Var(returns) over the samples one version trained, as the actor's Window logs it
    (rl/explained_variance, MLflow train/rl/explained_variance) from each sample's GAE return and old value.
    By hand, in 1/6400ths: returns 1, 0, 1/2, 1/4 (mean 7/16): Var = 875/6400; residuals 1/5, -1/10, 0, 1/4
    (mean 7/80): Var = 131/6400; so 1 - 131/875 = 744/875."""
    import numpy as np

    from embodyhpc.rl.assembly import Window
    from embodyhpc.rl.samples import ChunkSample

    returns, values = [1.0, 0.0, 0.5, 0.25], [0.8, 0.1, 0.5, 0.0]
    assert explained_variance(torch.tensor(returns), torch.tensor(values)) == pytest.approx(744 / 875, abs=1e-6)
    window = Window()
    window.add_values([ChunkSample(env_id=0, episode_id=i, group_id=i, chunk_index=0,
                                   observation={"_return": np.float32(r), "_value": np.float32(v)},
                                   trajectory=np.zeros((2, 1, 1), np.float32), log_prob=np.zeros((1, 1, 1), np.float32),
                                   version=0) for i, (r, v) in enumerate(zip(returns, values, strict=True))])
    assert window.metrics()["rl/explained_variance"] == pytest.approx(744 / 875, abs=1e-6)
    assert explained_variance(torch.tensor(returns), torch.tensor(returns)) == 1.0  # a perfect critic
    assert explained_variance(torch.tensor(returns), torch.zeros(4)) == 0.0  # V = 0: a constant explains nothing
    assert explained_variance(torch.ones(4), torch.zeros(4)) is None  # equal returns: undefined, not logged
    assert "rl/explained_variance" not in Window().metrics()  # GRPO (no critic): no such metric
    with pytest.raises(ValueError, match="one value per return"):
        explained_variance(torch.zeros(3), torch.zeros(2))


def _value_head(tmp_path, normalizer=lambda state: state * 2.0):
    from types import SimpleNamespace

    from embodyhpc.rl.critic import ValueHead

    rl = SimpleNamespace(train_seeds=[1], group_size=2, value_lr=1e-3, gamma=0.99, gae_lambda=0.95, clip_eps=0.2)
    config = SimpleNamespace(rl=rl, eval=SimpleNamespace(tasks=["reach-v3"]),
                             model=SimpleNamespace(state_key="observation.state"))
    return ValueHead(config, normalizer, 3, torch.device("cpu"), tmp_path)


def test_critic_files_are_kept_exactly_as_long_as_their_policy_checkpoints(tmp_path):
    """The critic of every checkpoint a resume can load is there, and no other: the policy's step folders (complete,
    or one still being written) decide; a crash mid-write leaves no half file under the real name."""
    from embodyhpc.checkpoint import layout

    head = _value_head(tmp_path)
    for version in (4, 8, 12):
        layout.step_dir(tmp_path, version).mkdir()
        head.save(version)
    assert sorted(p.name for p in tmp_path.glob("critic-*")) == [f"critic-step-{v}.pt" for v in (12, 4, 8)]
    layout.remove_folder(layout.step_dir(tmp_path, 4))  # the Checkpointer's retention took step 4
    head.save(16)  # step 16's folder is still being written (asynchronous save): its critic stays
    assert sorted(p.name for p in tmp_path.glob("critic-*")) == ["critic-step-12.pt", "critic-step-16.pt",
                                                                  "critic-step-8.pt"]
    assert not list(tmp_path.glob("*.tmp"))
    with torch.no_grad():
        head.critic.out.bias.fill_(0.25)
    head.save(16)
    fresh = _value_head(tmp_path)
    assert fresh.load(16) and fresh.critic.out.bias.item() == 0.25
    assert not fresh.load(5)  # no critic for a version never saved: the caller says so


def test_gae_of_an_episode_through_the_value_head(tmp_path):
    """A zero critic: a success's advantages are (gamma * lambda)^(T-1-t), returns the same, values 0 (kept on each
    sample for the value loss); the critic reads the normaliser's output (here state * 2)."""
    import numpy as np

    from embodyhpc.rl.samples import ChunkSample

    head = _value_head(tmp_path)
    samples = [ChunkSample(env_id=0, episode_id=0, group_id=0, chunk_index=i,
                           observation={"observation.state": np.full(3, i, np.float32)},
                           trajectory=np.zeros((2, 1, 1), np.float32), log_prob=np.zeros((1, 1, 1), np.float32),
                           version=0) for i in range(3)]
    decay = 0.99 * 0.95
    assert head.advantages(samples, True) == pytest.approx([decay ** 2, decay, 1.0], abs=1e-6)
    assert [float(s.observation["_return"]) for s in samples] == pytest.approx([decay ** 2, decay, 1.0], abs=1e-6)
    assert head.advantages(samples, False) == [0.0, 0.0, 0.0]
    states, tasks = head.inputs(samples)
    assert states[:, 0].tolist() == [0.0, 2.0, 4.0] and tasks.tolist() == [0, 0, 0]


def test_states_out_of_the_demonstrations_range_are_counted_and_read_as_they_are(tmp_path):
    """A state dimension the demonstrations hardly moved is huge after mean_std once an exploring policy moves it:
    the recorded case, MetaWorld reach-v3's gripper opening (demonstrations: mean 0.9976, std 0.0012) at 0.9 is
    (0.9 - 0.9976) / 0.0012 = -81.33. It is counted out of range (beyond +-10), and the critic reads it unclipped,
    as the policy does."""
    import numpy as np

    from embodyhpc.rl.critic import OUT_OF_RANGE
    from embodyhpc.rl.samples import ChunkSample

    def gripper_norm(state):  # the recorded statistics of the gripper dimension; the others pass through
        out = np.array(state, np.float32)
        out[..., 1] = (out[..., 1] - 0.9976) / 0.0012
        return out

    head = _value_head(tmp_path, gripper_norm)
    rows = [[0.5, 0.9976, -3.0], [0.5, 0.9, 9.5], [-1e5, 0.9976, 2.0]]
    samples = [ChunkSample(env_id=0, episode_id=0, group_id=0, chunk_index=i,
                           observation={"observation.state": np.array(row, np.float32)},
                           trajectory=np.zeros((2, 1, 1), np.float32), log_prob=np.zeros((1, 1, 1), np.float32),
                           version=0) for i, row in enumerate(rows)]
    states, _ = head.inputs(samples)
    assert OUT_OF_RANGE == 10.0
    assert torch.allclose(states, torch.tensor([[0.5, 0.0, -3.0], [0.5, -81.333, 9.5], [-1e5, 0.0, 2.0]]), atol=1e-2)
    assert head.out_of_range(samples) == 2 and head.out_of_range(samples[:1]) == 0 and head.out_of_range([]) == 0


def test_the_critic_step_clips_its_own_gradient_norm(tmp_path):
    """ValueHead.step clips the critic's gradients to max_norm on their own norm, returns the norm before clipping,
    and steps its optimizer: with plain SGD at lr 1 the parameters move by exactly -grad * max_norm / norm."""
    head = _value_head(tmp_path)
    params = list(head.critic.parameters())
    before = [p.detach().clone() for p in params]
    grads = [torch.full_like(p, 0.5) for p in params]
    norm = sum(float((g ** 2).sum()) for g in grads) ** 0.5  # 0.5 * sqrt(number of parameters)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    head.optimizer = torch.optim.SGD(params, lr=1.0)
    assert head.step(1, None, 2.0) == pytest.approx(norm)
    for p, b, g in zip(params, before, grads, strict=True):
        assert torch.allclose(p.detach(), b - g * 2.0 / norm, atol=1e-6)
        assert p.grad is None
    for p, g in zip(params, grads, strict=True):  # max_norm <= 0: no clipping (train.grad_clip 0 means off)
        p.grad = g.clone()
    before = [p.detach().clone() for p in params]
    head.step(1, None, 0.0)
    for p, b, g in zip(params, before, grads, strict=True):
        assert torch.allclose(p.detach(), b - g, atol=1e-6)
