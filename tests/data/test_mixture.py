"""data.datasets: a weighted mixture of datasets (data/mixture.py, data/mixture_open.py, the collates, staging).

The references are outside the code under test: the binomial distribution for the sampled proportions, the
round-robin / resume contract of StepSampler (one global order, whatever the world size), each dataset's own
meta/stats.json read here for the normalisation, GR00T's published embodiment ids, each dataset's info.json for the
real action dims the loss may count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import torch

from embodyhpc.config.coerce import build
from embodyhpc.config.schema import DataConfig, ModelConfig
from embodyhpc.data.errors import DatasetError
from embodyhpc.data.mixture import MixtureDataset, MixtureSampler, mixture_order
from embodyhpc.data.mixture_open import mixture_normalizer, open_mixture, read_dataset_stats, save_dataset_stats
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_tokenizer
from embodyhpc.models.flow import action_loss_mask
from embodyhpc.models.groot.batching import GrootCollate
from embodyhpc.models.pi05.batching import Pi05Collate, to_pi05_sample

FPS = 10
HORIZON = 4
ACTIONS = {"action": [i / FPS for i in range(HORIZON)]}
# Two robots: different state and action widths, state ranges and embodiments (GR00T's gr1 = 24, oxe_droid = 17)
ROBOTS = {"a": {"state": 4, "action": 4, "scale": 1.0, "offset": 0.0, "embodiment": "gr1"},
          "b": {"state": 6, "action": 2, "scale": 50.0, "offset": 300.0, "embodiment": "oxe_droid"}}
GROOT_IDS = {"gr1": 24, "oxe_droid": 17}  # GR00T-N1.5's embodiment tags (its data config), not read from our code


def write_robot(root: Path, state_dim: int, action_dim: int, scale: float, offset: float, seed: int,
                episodes: int = 2, frames: int = 12, camera: str = "front", fps: int = FPS) -> Path:
    from embodyhpc.data.writer import LeRobotWriter

    rng = np.random.default_rng(seed)
    features = {f"observation.images.{camera}": {"dtype": "video", "shape": [16, 16, 3]},
                "observation.state": {"dtype": "float32", "shape": [state_dim]},
                "action": {"dtype": "float32", "shape": [action_dim]}}
    with LeRobotWriter(root, fps=fps, features=features) as writer:
        for _ in range(episodes):
            state = (rng.standard_normal((frames, state_dim)) * scale + offset).astype(np.float32)
            images = rng.integers(0, 255, (frames, 16, 16, 3), dtype=np.uint8)
            writer.add_episode({f"observation.images.{camera}": images, "observation.state": state,
                                "action": np.tanh(state[:, :action_dim] / scale).astype(np.float32)}, task="reach")
    return root


@pytest.fixture(scope="module")
def robots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mixture")
    return {name: write_robot(base / name, r["state"], r["action"], r["scale"], r["offset"], seed=n)
            for n, (name, r) in enumerate(ROBOTS.items())}


def mixture_config(robots, weights=(3, 1), **extra) -> DataConfig:
    entries = [{"root": str(robots[name]), "weight": w, "embodiment": ROBOTS[name]["embodiment"]}
               for name, w in zip(ROBOTS, weights, strict=True)]
    return build(DataConfig, {"format": "lerobot", "datasets": entries, "delta_timestamps": ACTIONS,
                              "num_workers": 0, **extra}, "data.")


def pyav(root, delta_timestamps):
    """The reader with PyAV's decoder: torchcodec's first import costs seconds, and decoding is not under test."""
    from embodyhpc.data import open_dataset

    return open_dataset(root, delta_timestamps, video_backend="pyav")


class Frames(torch.utils.data.Dataset):
    """A member without files: item i says which frame it is."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"frame": int(i)}


def test_weights_3_to_1_give_proportions_within_the_binomial_interval():
    # 3:1 by weight, and not by size: the smaller member is the heavier one
    mix = MixtureDataset([Frames(50), Frames(400)], [3, 1], seed=7)
    n = 20_000
    members, frames = mix.locate(np.arange(n))
    p = 0.75
    z = NormalDist().inv_cdf(1 - 1e-6 / 2)  # two-sided 1e-6: a correct sampler fails once in a million seeds
    half = z * math.sqrt(n * p * (1 - p))
    assert abs(int((members == 0).sum()) - n * p) <= half, (int((members == 0).sum()), n * p, half)
    # member frames: in range, and no frame of member 0 twice within one window of its 50 global positions
    assert frames[members == 0].min() >= 0 and frames[members == 0].max() < 50
    for start in range(0, n, 50):
        window = frames[start:start + 50][members[start:start + 50] == 0].tolist()
        assert len(set(window)) == len(window)


def _order(mix, world_size, epoch=0, consumed_per_rank=0, state=None):
    """The global order the ranks draw, interleaved round-robin (rank r draws global position r mod W)."""
    samplers = [MixtureSampler(mix, rank=r, world_size=world_size, seed=mix.seed) for r in range(world_size)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch) if state is None else None
        s.advance(consumed_per_rank) if consumed_per_rank else None
    per_rank = [list(mixture_order(mix, s)) for s in samplers]
    return [x for draws in zip(*per_rank, strict=True) for x in draws], samplers[0]


def test_order_is_the_same_on_1_and_2_ranks_after_a_resume_and_continues_across_epochs():
    mix = MixtureDataset([Frames(30), Frames(70)], [3, 1], seed=3)
    one, _ = _order(mix, 1)
    two, _ = _order(mix, 2)
    assert two == one[:len(two)] and len(two) == 100
    # resume: 1 rank consumed 38 samples, then 2 ranks go on from its state (and back)
    _, saved = _order(mix, 1, consumed_per_rank=38)
    resumed, _ = _order(mix, 2, state=saved.state_dict())
    assert resumed == one[38:38 + len(resumed)] and len(resumed) == 62
    _, saved2 = _order(mix, 2, consumed_per_rank=7)
    assert _order(mix, 1, state=saved2.state_dict())[0] == one[14:]
    # the next epoch continues the stream: other draws, not epoch 0's again
    epoch1, _ = _order(mix, 1, epoch=1)
    assert epoch1 != one
    assert [m for m, _ in epoch1] != [m for m, _ in one]
    # the training DataLoader deals the same stream (data/loader.py picks the mixture's sampler)
    from embodyhpc.data.loader import build_dataloader

    data = build(DataConfig, {"format": "lerobot", "datasets": [{"root": "/a", "weight": 3}, {"root": "/b"}],
                              "num_workers": 0}, "data.")
    loader, sampler = build_dataloader(mix, data, micro_batch_size=4, rank=0, world_size=1, seed=3)
    assert isinstance(sampler, MixtureSampler)
    drawn = [(int(d), int(f)) for batch in loader for d, f in zip(batch["dataset_index"], batch["frame"], strict=True)]
    assert drawn == one
    # another mixture (weights or datasets) cannot continue this stream
    other = MixtureDataset([Frames(30), Frames(70)], [1, 1], seed=3)
    with pytest.raises(DatasetError, match="data mixture"):
        MixtureSampler(other, rank=0, world_size=1, seed=3).load_state_dict(saved.state_dict())


def test_each_sample_is_normalised_with_its_own_datasets_statistics_and_embodiment(robots, tmp_path):

    data = mixture_config(robots)
    mix = open_mixture(data, seed=0, open_one=pyav)
    positions = list(range(24))
    items = mix.__getitems__(positions)
    members, frames = mix.locate(positions)
    assert set(members.tolist()) == {0, 1}  # both robots in the batch
    for mode in ("mean_std", "quantile"):
        norm = mixture_normalizer(data, "observation.state", mode)
        groot_cfg = ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=4, max_token_len=96,
                                state_norm=mode)
        batch = GrootCollate(groot_cfg, build_tokenizer(groot_cfg), norm)(items)
        pi_cfg = ModelConfig(name="pi05", size="tiny", action_horizon=HORIZON, action_dim=4, state_norm=mode,
                             state_dim=8)
        for n, (d, frame) in enumerate(zip(members.tolist(), frames.tolist(), strict=True)):
            name = list(ROBOTS)[d]
            stats = json.loads((robots[name] / "meta" / "stats.json").read_text())["observation.state"]
            raw = np.asarray(mix.members[d][frame]["observation.state"], np.float64)
            if mode == "mean_std":
                want = (raw - np.asarray(stats["mean"])) / np.asarray(stats["std"])
            else:
                q01, q99 = np.asarray(stats["q01"]), np.asarray(stats["q99"])
                want = np.clip(2 * (raw - q01) / (q99 - q01) - 1, -1, 1)
            width = ROBOTS[name]["state"]
            np.testing.assert_allclose(batch.state[n, :width].numpy(), want, rtol=1e-4, atol=1e-4)
            assert not batch.state[n, width:].any()
            assert int(batch.embodiment[n]) == GROOT_IDS[ROBOTS[name]["embodiment"]]
            pi = to_pi05_sample(items[n], pi_cfg, norm)
            np.testing.assert_allclose(pi.state[:width].numpy(), want, rtol=1e-4, atol=1e-4)
            assert pi.state.shape == (8,) and not pi.state[width:].any()
    # every dataset's statistics are saved; the evaluation entry's is the first unless one is marked eval
    save_dataset_stats(tmp_path, norm, [e.root for e in data.datasets])
    saved = read_dataset_stats(tmp_path)
    assert saved.eval_index == 0 and [n.offset for n in saved.normalizers] == [n.offset for n in norm.normalizers]
    marked = mixture_config(robots)
    marked = DataConfig(**{**marked.__dict__, "datasets": [marked.datasets[0],
                                                          type(marked.datasets[1])(**{**marked.datasets[1].__dict__,
                                                                                      "eval": True})]})
    assert mixture_normalizer(marked, "observation.state", "mean_std").eval_index == 1


def test_an_unknown_embodiment_is_one_line_naming_the_entry(robots):
    data = mixture_config(robots)
    mix = open_mixture(data, seed=0, open_one=pyav)
    mix.embodiments[1] = "gr2"
    members, _ = mix.locate(range(8))
    items = mix.__getitems__([int(np.flatnonzero(members == 1)[0])])
    cfg = ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=4, max_token_len=96)
    with pytest.raises(ConfigError) as info:
        GrootCollate(cfg, build_tokenizer(cfg))(items)
    assert info.value.key == "data.datasets[1].embodiment" and "'gr2'" in str(info.value)
    assert "\n" not in str(info.value)


def test_padded_action_dims_are_masked_out_of_the_loss(robots):

    data = mixture_config(robots)
    mix = open_mixture(data, seed=0, open_one=pyav)
    positions = list(range(16))
    items = mix.__getitems__(positions)
    members, _ = mix.locate(positions)
    real = [json.loads((robots[name] / "meta" / "info.json").read_text())["features"]["action"]["shape"][0]
            for name in ROBOTS]
    want = torch.stack([torch.arange(4) < real[d] for d in members.tolist()])  # [N, A]
    norm = mixture_normalizer(data, "observation.state", "mean_std")
    groot_cfg = ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=4, max_token_len=96)
    pi_cfg = ModelConfig(name="pi05", size="tiny", action_horizon=HORIZON, action_dim=4, state_dim=8)
    for batch in (GrootCollate(groot_cfg, build_tokenizer(groot_cfg), norm)(items),
                  Pi05Collate(pi_cfg, build_tokenizer(pi_cfg), norm)(items)):
        mask = action_loss_mask(batch.actions, batch.action_is_pad, batch.action_dim_mask)
        expected = want[:, None, :].expand_as(mask) & ~batch.action_is_pad[:, :, None]
        assert torch.equal(mask.bool(), expected)


@pytest.mark.parametrize(("data", "key"), [
    ({"format": "lerobot", "root": "/x", "datasets": [{"root": "/y"}]}, "data.datasets"),
    ({"format": "lerobot"}, "data.root"),
    ({"format": "lerobot", "datasets": [{"root": "/y", "eval": True}, {"root": "/z", "eval": True}]},
     "data.datasets[1].eval"),
    ({"format": "lerobot", "datasets": [{"root": "/y", "weight": 0}]}, "data.datasets[0].weight"),
    ({"format": "lerobot", "datasets": [{"root": "/y"}, {"root": "/y"}]}, "data.datasets[1].root"),
    ({"format": "lerobot", "datasets": [{"root": "/y"}], "gop_window_batches": 4}, "data.gop_window_batches"),
])
def test_bad_mixture_settings_are_one_line_errors_naming_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        build(DataConfig, data, "data.")
    assert info.value.key == key and "\n" not in str(info.value)


def test_every_dataset_is_staged(robots, tmp_path, monkeypatch):
    from embodyhpc.config.schema import StagingConfig
    from embodyhpc.launch.train import prepare_datasets

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "mixture-test")
    data = mixture_config(robots)
    staged = prepare_datasets(data, StagingConfig(enabled=True, nvme_dir=str(tmp_path / "nvme")), local_rank=0)
    roots = [Path(e.root) for e in staged.datasets]
    assert len(set(roots)) == 2 and all(r.parent == tmp_path / "nvme" for r in roots)
    for entry, source in zip(staged.datasets, (robots[name] for name in ROBOTS), strict=True):
        for path in source.rglob("*"):
            if path.is_file():
                assert (Path(entry.root) / path.relative_to(source)).read_bytes() == path.read_bytes()
    assert [e.weight for e in staged.datasets] == [3, 1]


def test_a_checkpointed_mixture_is_its_datasets_content_not_their_paths(robots, tmp_path):
    import shutil

    from embodyhpc.data.mixture_open import run_normalizer

    data = mixture_config(robots)
    saved = MixtureSampler(open_mixture(data, seed=0, open_one=pyav), rank=0, world_size=1, seed=0).state_dict()
    save_dataset_stats(tmp_path, mixture_normalizer(data, "observation.state", "mean_std"),
                       [e.root for e in data.datasets])
    model = ModelConfig(name="groot", size="tiny", state_norm="mean_std")

    def resumed(root_b):
        entries = [data.datasets[0], type(data.datasets[1])(**{**data.datasets[1].__dict__, "root": str(root_b)})]
        other = DataConfig(**{**data.__dict__, "datasets": entries})
        MixtureSampler(open_mixture(other, seed=0, open_one=pyav), rank=0, world_size=1, seed=0).load_state_dict(saved)
        return run_normalizer(other, model, tmp_path)

    # a copy elsewhere (as staging makes one, with its own control file beside the data) is the same dataset
    copy = tmp_path / "staged-b"
    shutil.copytree(robots["b"], copy)
    (copy / ".embodyhpc-stage.json").write_text("{}")
    assert resumed(copy).normalizers[1].offset == read_dataset_stats(tmp_path).normalizers[1].offset
    # the same frames with other metadata (another recording of the same length) is not: one line naming the entry
    stats = json.loads((copy / "meta" / "stats.json").read_text())
    stats["observation.state"]["mean"][0] += 1.0
    (copy / "meta" / "stats.json").write_text(json.dumps(stats))
    with pytest.raises(DatasetError) as info:
        resumed(copy)
    assert "data.datasets[1]'s content digest" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DatasetError, match=r"data.datasets\[1\].*not the dataset the run trained on"):
        run_normalizer(DataConfig(**{**data.__dict__, "datasets": [data.datasets[0], type(data.datasets[1])(
            **{**data.datasets[1].__dict__, "root": str(copy)})]}), model, tmp_path)
