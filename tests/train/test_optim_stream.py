"""Weight-decay groups, and the batch stream's sampler accounting across an epoch boundary."""

from __future__ import annotations

import torch

from embodyhpc.config.schema import DataConfig, ModelConfig
from embodyhpc.data.loader import build_dataloader
from embodyhpc.models import build_model
from embodyhpc.train.optim import build_optimizer, no_decay_names
from embodyhpc.train.stream import BatchStream


def test_no_decay_on_norms_biases_embeddings():
    model = build_model(ModelConfig(size="tiny", action_horizon=4, action_dim=8, max_token_len=128))
    skip = no_decay_names(model)
    assert {"embed_tokens.weight", "vision.position_embedding", "vision.patch_embed.bias",
            "layers.0.vlm.attn_norm.weight", "vision.post_norm.weight", "action_out.bias"} <= skip
    assert not {"layers.0.vlm.q_proj.weight", "vision.patch_embed.weight", "action_out.weight",
                "layers.0.expert.attn_norm.modulation.weight"} & skip
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


class _Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 18

    def __getitem__(self, index: int) -> int:
        return index


def test_stream_rolls_over_epochs_and_commits_per_step():
    loader, sampler = build_dataloader(_Indices(), DataConfig(num_workers=0), micro_batch_size=2, rank=0,
                                       world_size=2, seed=1)
    stream = BatchStream(loader, sampler)
    seen = []
    for _ in range(2):  # 2 steps x 2 micro-batches x 2 samples x 2 ranks: 16 of 18
        seen += [int(i) for _ in range(2) for i in stream.next_batch()]
        stream.commit()
    assert sampler.epoch == 0 and sampler.num_consumed == 16
    assert len(set(seen)) == 8  # this rank's half, nothing repeated
    stream.next_batch()  # 1 sample left per rank: not a full micro-batch, so epoch 1 starts
    assert sampler.epoch == 1
    stream.next_batch()
    stream.commit()
    assert sampler.epoch == 1 and sampler.num_consumed == 8
