"""What `embodyhpc smoke` trains of pi0.5 (the spec's `smoke`; models/protocol.SmokeModel): tiny or small, 8-step
chunks of 8 action dims, on a packed batch of 4 samples. Imports no torch at load."""

from __future__ import annotations

from typing import Any

WORDS = "pick up the red block and place it in the blue bowl on the left".split()


class Pi05Smoke:
    sizes = ("tiny", "small")
    other_sizes = "full (~3.3B parameters, the published shapes) is a training run, not a smoke"

    def config(self, size: str, attention_backend: str) -> Any:
        from embodyhpc.config.schema import ModelConfig

        return ModelConfig(name="pi05", size=size, action_horizon=8, action_dim=8, attention_backend=attention_backend,
                           max_token_len=256 if size == "tiny" else 1024)

    def fixed_batch(self, model_cfg: Any, rank: int) -> tuple[Any, Any, Any, int]:
        """A packed batch of 4 samples (1-2 cameras, prompts of different lengths), its noise and flow times, and
        the tokens it puts through the model."""
        import torch

        from embodyhpc.data.packing import first_fit_decreasing
        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.pi05.batch import Pi05Sample, collate
        from embodyhpc.models.pi05.build import max_prompt_tokens
        from embodyhpc.models.pi05.shapes import shape_for

        shape = shape_for(model_cfg.size)
        size = shape.vision.image_size
        g = torch.Generator().manual_seed(100 + rank)
        samples = [Pi05Sample(images=torch.rand(2, 3, size, size, generator=g), instruction=" ".join(WORDS[:3 + 3 * i]),
                              state=torch.rand(6, generator=g) * 2 - 1, image_mask=torch.tensor([True, i % 2 == 0]),
                              actions=torch.randn(model_cfg.action_horizon, model_cfg.action_dim, generator=g))
                   for i in range(4)]
        batch = collate(samples, build_tokenizer(model_cfg), max_prompt_tokens=max_prompt_tokens(model_cfg, 2))
        counts = batch.token_counts(shape.vision.num_patches, model_cfg.action_horizon)
        batch = batch.with_rows(first_fit_decreasing(counts, model_cfg.max_token_len))
        noise = torch.randn(4, model_cfg.action_horizon, model_cfg.action_dim, generator=g)
        return batch, noise, torch.rand(4, generator=g) * 0.8 + 0.1, sum(counts)


SMOKE = Pi05Smoke()
