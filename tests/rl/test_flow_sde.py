"""Flow-SDE (embodyhpc/rl/flow_sde.py) on both model families: noise level 0 is the families' own ODE sampler, the
velocities the actor differentiates are the rollout's, every transition's log-density equals an explicit Gaussian
density written here from velocities computed one step at a time by the family's own full path, and the SDE keeps
the flow's marginals (a toy field whose marginals are known in closed form)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.models import build_model
from embodyhpc.models.groot.batch import GrootSample, collate
from embodyhpc.models.groot.inference import GrootRunner
from embodyhpc.models.pi05.inference import Pi05Runner
from embodyhpc.rl.flow_sde import sample_chunk, sde_step_stats, step_times, trajectory_log_prob
from embodyhpc.validation import load_recipe
from tests.models.conftest import make_batch, make_samples

N = 3
GROOT_HORIZON, GROOT_DIMS = 16, 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on 2 shared cores: one intra-op thread (tests/models/conftest.py says why)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pi05():
    cfg = ModelConfig(size="tiny", action_horizon=8, action_dim=8, max_token_len=160)
    torch.manual_seed(0)
    return warmed(build_model(cfg), make_batch(cfg, make_samples(N, with_actions=False)))


@pytest.fixture(scope="module")
def groot():
    cfg = ModelConfig(name="groot", size="tiny", action_horizon=GROOT_HORIZON, action_dim=GROOT_DIMS, max_token_len=96)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    samples = [GrootSample(images=torch.rand(2, 3, 32, 32, generator=g), text_ids=list(range(5, 9 + 4 * i)),
                           state=torch.randn(64, generator=g)) for i in range(N)]
    return warmed(build_model(cfg), collate(samples, embodiment_id=31))


def warmed(model, batch):
    """One sampling, one backward pass and one assert_close here, so the first test does not pay the process's
    one-time costs (tracing the attention backends' compiled paths, assert_close's lazy imports: ~3 s) in its time."""
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    model.sample_actions(batch, num_steps=1, noise=noise_like(model))
    model(dataclasses.replace(batch, actions=noise_like(model))).loss.backward()
    model.zero_grad()
    return model, batch


@pytest.fixture(params=["pi05", "groot"])
def family(request):
    return request.param, *request.getfixturevalue(request.param)


def noise_like(model, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, model.action_horizon, model.action_dim, generator=torch.Generator().manual_seed(seed))


def own_velocity(name: str, model, batch, x: torch.Tensor, k: int, num_steps: int) -> torch.Tensor:
    """dx/dt (t = 1 noise) of step k, by the family's own full path, in its own time convention: pi0.5's
    predict_velocity (prefix recomputed, no cache) at t = 1 - k/K; GR00T's VLM + action head at its time k/K (t = 0
    noise there), its velocity negated (its x runs the other way)."""
    if name == "pi05":
        return model.predict_velocity(batch, x, torch.full((N,), 1.0 - k / num_steps))
    context, ctx = model.encode(batch, model.plan(batch))
    bucket = model.timestep_bucket(torch.full((N,), k / num_steps))
    return -model.action_head.velocity(context, model.padded_state(batch), x, bucket, batch.embodiment, ctx)


def direct_log_prob(trajectory: torch.Tensor, velocities: list[torch.Tensor], a: float) -> torch.Tensor:
    """The Gaussian log-density of each entry of each transition x_k -> x_{k+1}, in float64, as Flow-GRPO writes the
    step: mean = x (1 + s^2 dt / 2t) + v (1 + s^2 (1 - t) / 2t) dt, variance s^2 |dt|, s^2 = a^2 t / (1 - t), with
    1 - t read as 1/K (one step) at t = 1."""
    num_steps = trajectory.shape[1] - 1
    h = 1.0 / num_steps
    out = []
    for k in range(num_steps):
        x, nxt, v = trajectory[:, k].double(), trajectory[:, k + 1].double(), velocities[k].double()
        t = 1.0 - k * h
        s2 = a * a * t / (h if k == 0 else 1.0 - t)
        mean = x * (1 - s2 * h / (2 * t)) - v * (1 + s2 * (1 - t) / (2 * t)) * h
        variance = s2 * h
        out.append(-0.5 * math.log(2 * math.pi * variance) - (nxt - mean) ** 2 / (2 * variance))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("num_steps", [3, 10])
def test_noise_level_zero_is_pi05s_ode_sampler_bit_for_bit(pi05, num_steps):
    model, batch = pi05
    noise = noise_like(model)
    with torch.no_grad():
        sample = sample_chunk(model.flow_velocity_fn(batch), noise, num_steps=num_steps, noise_level=0.0,
                              generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample.actions, model.sample_actions(batch, num_steps=num_steps, noise=noise))
    assert sample.trajectory.shape == (N, num_steps + 1, 8, 8) and torch.equal(sample.trajectory[:, 0], noise)
    assert torch.equal(sample.trajectory[:, -1], sample.actions) and not sample.log_prob.any()


@pytest.mark.parametrize("num_steps", [4, 5])
def test_noise_level_zero_is_groots_ode_sampler(groot, num_steps, monkeypatch):
    """Same time buckets at every step (t = 1 - k/K becomes GR00T's k/K: K = 5 is where a float32 1 - t would land in
    the bucket below), same actions: bit for bit at K = 4, where GR00T's v / K and rl's (-1/K) (-v) are one rounding;
    to float32 rounding (one ulp per step) at K = 5."""
    model, batch = groot
    noise = noise_like(model)
    seen, velocity = [], model.action_head.velocity

    def recording(context, state, x, timestep, embodiment, ctx):
        seen.append(timestep.tolist())
        return velocity(context, state, x, timestep, embodiment, ctx)

    monkeypatch.setattr(model.action_head, "velocity", recording)
    expected = model.sample_actions(batch, num_steps=num_steps, noise=noise)
    ode_buckets, seen[:] = list(seen), []
    with torch.no_grad():
        sample = sample_chunk(model.flow_velocity_fn(batch), noise, num_steps=num_steps, noise_level=0.0,
                              generator=None)
    assert seen == ode_buckets == [[float(int(1000 * k / num_steps))] * N for k in range(num_steps)]
    if num_steps == 4:
        assert torch.equal(sample.actions, expected)
    torch.testing.assert_close(sample.actions, expected, rtol=0, atol=1e-6)


def test_flow_velocities_are_the_rollouts_velocities_step_by_step(family):
    name, model, batch = family
    num_steps = 4
    times, _ = step_times(num_steps)
    x = torch.randn(N, num_steps, model.action_horizon, model.action_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        together = model.flow_velocities(batch, x, times)
        velocity = model.flow_velocity_fn(batch)
        for k in range(num_steps):
            assert torch.equal(together[:, k], velocity(x[:, k], times[k].expand(N)))
            torch.testing.assert_close(together[:, k], own_velocity(name, model, batch, x[:, k], k, num_steps),
                                       rtol=1e-5, atol=1e-5)
    assert {"sample_actions", "flow_velocities"} <= set(model.fsdp_forward_methods())


def test_log_probs_are_the_explicit_gaussian_density_and_differentiate_to_the_model(family):
    name, model, batch = family
    num_steps, a = 4, 0.7
    with torch.no_grad():
        sample = sample_chunk(model.flow_velocity_fn(batch), noise_like(model), num_steps=num_steps, noise_level=a,
                              generator=torch.Generator().manual_seed(3))
    traj = sample.trajectory
    # the steps are random: x_{k+1} is not the Euler step of x_k
    assert (traj[:, 1] - (traj[:, 0] - 0.25 * own_velocity(name, model, batch, traj[:, 0], 0, 4))).abs().max() > 0.1

    model.zero_grad()
    direct = direct_log_prob(traj, [own_velocity(name, model, batch, traj[:, k], k, num_steps)
                                    for k in range(num_steps)], a)
    direct.sum().backward()
    direct_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    recomputed = trajectory_log_prob(model, batch, traj, noise_level=a)
    recomputed.sum().backward()

    torch.testing.assert_close(sample.log_prob.double(), direct.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(recomputed.double(), direct.detach(), rtol=1e-4, atol=1e-4)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == direct_grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, grad in grads.items():
        torch.testing.assert_close(grad.double(), direct_grads[n].double(), rtol=1e-3,
                                   atol=1e-5 * (1 + grad.abs().max()))
    # the actor's update reaches the prefix too (pi0.5: the vision tower; GR00T's VLM is frozen and untouched)
    if name == "pi05":
        assert model.vision.patch_embed.weight.grad.abs().max() > 0
    else:
        assert all(p.grad is None for p in model.backbone.parameters())
    model.zero_grad()


def test_one_step_by_hand_and_noise_level_is_the_first_steps_std():
    x, v = torch.tensor([[[1.0]]]), torch.tensor([[[2.0]]])
    # t = 0.5, dt = -0.25, a = 0.5: s^2 = 0.25 * 0.5 / 0.5 = 0.25; drift = 2 + 0.25 / 1 * (1 + 0.5 * 2) = 2.5
    mean, std = sde_step_stats(x, v, 0.5, -0.25, 0.5)
    assert mean.item() == pytest.approx(1 - 0.25 * 2.5) and std.item() == pytest.approx(0.25)
    # t = 1 (1 - t clamped to one step, 0.25): s^2 = 0.25 / 0.25 = 1; drift = 2 + 1/2 * 1 = 2.5; std = sqrt(0.25) = a
    mean, std = sde_step_stats(x, v, torch.tensor([1.0]), -0.25, 0.5)
    assert mean.item() == pytest.approx(0.375) and std.item() == pytest.approx(0.5)
    for k in (2, 4, 10, 50):
        assert sde_step_stats(x, v, 1.0, -1.0 / k, 0.3)[1].item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="dt must be negative"):
        sde_step_stats(x, v, 0.5, 0.25, 0.5)
    with pytest.raises(ValueError, match="rl.noise_level > 0"):
        trajectory_log_prob(None, None, torch.zeros(1, 3, 1, 1), noise_level=0.0)


MU, S = 1.5, 0.5  # the target N(MU, S^2); the noise N(0, 1)


def gaussian_flow_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The exact marginal velocity of x_t = (1 - t) * target + t * noise: x_t ~ N(m_t, var_t) with m_t = (1 - t) MU,
    var_t = (1 - t)^2 S^2 + t^2, so dx/dt = dm_t/dt + (dvar_t/dt) / (2 var_t) * (x - m_t)."""
    t = t.double()[:, None, None]
    m, var = (1 - t) * MU, (1 - t) ** 2 * S ** 2 + t ** 2
    return (-MU + (t - (1 - t) * S ** 2) / var * (x.double() - m)).float()


@pytest.mark.parametrize("noise_level", [0.3, 0.7])
def test_the_sde_keeps_the_flows_marginals(noise_level):
    """n = 32000 independent entries, K = 200 steps. Tolerances: 5 standard errors (mean S / sqrt(n) = 0.0028;
    variance S^2 sqrt(2 / n) = 0.0020), plus Euler-Maruyama's O(1/K) bias, measured below 0.02 S^2 at K = 200. A
    step whose std is 10% too large ends at ~1.2 S^2, dropping the drift's score term at 1.7-4.7 S^2."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(4000, 4, 2, generator=g)
    sample = sample_chunk(gaussian_flow_velocity, noise, num_steps=200, noise_level=noise_level, generator=g)
    x = sample.actions.double().flatten()
    n = x.numel()
    assert abs(x.mean().item() - MU) < 5 * S / math.sqrt(n)
    assert abs(x.var().item() - S ** 2) < 5 * S ** 2 * math.sqrt(2 / n) + 0.02 * S ** 2
    # and it is stochastic: another generator, other actions, same law
    other = sample_chunk(gaussian_flow_velocity, noise, num_steps=200, noise_level=noise_level,
                         generator=torch.Generator().manual_seed(2)).actions
    assert (other - sample.actions).abs().mean() > 0.1 * S


@pytest.mark.parametrize("family_name,recipe", [("pi05", "demo_metaworld_cpu"),
                                                ("groot", "recipes/demo_groot_metaworld_cpu.yaml")])
def test_the_runners_observation_batch_is_what_the_rollout_acts_on(family_name, recipe):
    """The actor rebuilds a stored observation's batch with the runner's observation_batch: at noise level 0 with
    the env's noise, the SDE sampler on it gives the chunk the runner predicts for that observation."""
    config = load_recipe(recipe).config
    torch.manual_seed(0)
    model = build_model(config.model).float()
    runner_cls = Pi05Runner if family_name == "pi05" else GrootRunner
    runner = runner_cls(model, config, normalizer=StateNormalizer(config.model.state_key, "none"), execute_steps=2,
                        denoise_steps=4, num_action_dims=4)
    rng = np.random.default_rng(0)
    size = 32 if family_name == "pi05" else 48
    obs = {"observation.environment_state": rng.standard_normal(39).astype(np.float32),
           "observation.images.corner": rng.integers(0, 255, (size, size, 3), dtype=np.uint8), "task": "reach"}
    runner.reset("reach-v3", 7)
    chunk = runner.predict_chunk(obs)
    shape = (config.model.action_horizon, config.model.action_dim)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))  # env seed 7's first chunk noise
    with torch.no_grad():
        sample = sample_chunk(model.flow_velocity_fn(runner.observation_batch([obs])), noise[None], num_steps=4,
                              noise_level=0.0, generator=None)
    np.testing.assert_array_equal(sample.actions[0, :, :4].numpy(), chunk)


def sharded_log_prob_rank(rank: int, world: int) -> dict:
    """A spawned rank (tests/parallel/harness.py): the tiny pi0.5 sharded over the world, trajectory_log_prob of its
    2 of the 4 samples through the registered flow_velocities, backward; rank 0 also runs the unsharded model on
    all 4."""
    from embodyhpc.config.schema import ParallelismConfig
    from embodyhpc.parallel import build_mesh
    from tests.parallel.workers import MODEL, build_reference, build_sharded, local_grads

    samples = make_samples(4, seed=5, with_actions=False)
    g = torch.Generator().manual_seed(6)
    trajectory = torch.randn(4, 4, MODEL.action_horizon, MODEL.action_dim, generator=g)

    def run(model, rows: slice, scale: float) -> dict:
        log_prob = trajectory_log_prob(model, make_batch(MODEL, samples[rows]), trajectory[rows], noise_level=0.5)
        (log_prob.sum() * scale).backward()
        return {"log_prob": log_prob.detach(), "grads": local_grads(model)}

    model, _ = build_sharded(build_mesh(1, world, "cpu"), ParallelismConfig())
    # FSDP averages gradients over the ranks: scaled by the world, each rank's sum adds up to the global sum
    results = {"sharded": run(model, slice(2 * rank, 2 * rank + 2), float(world))}
    if rank == 0:
        results["reference"] = run(build_reference(), slice(None), 1.0)
    return results


@pytest.mark.slow
def test_flow_velocities_run_and_differentiate_under_fsdp2():
    """The actor calls trajectory_log_prob on an FSDP2-sharded policy: flow_velocities must be a registered FSDP
    forward method (its parameters gathered, its gradients reduce-scattered) to equal the unsharded model."""
    from tests.parallel.harness import run_ranks
    from tests.parallel.workers import assemble

    ranks = run_ranks(sharded_log_prob_rank, 2)
    reference = ranks[0]["reference"]
    log_prob = torch.cat([rank["sharded"]["log_prob"] for rank in ranks])
    torch.testing.assert_close(log_prob, reference["log_prob"], rtol=1e-5, atol=1e-5)
    grads = assemble([rank["sharded"]["grads"] for rank in ranks])
    assert grads.keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * (1 + grad.abs().max().item()), msg=name)
