"""What `embodyhpc smoke` trains of GR00T-N1.5 (the spec's `smoke`; models/protocol.SmokeModel): the tiny size,
16-step chunks (GR00T's horizon) of 8 action dims, on 4 samples whose VLM tokens are packed as GrootCollate packs
them. Imports no torch at load.

Smoke trains the whole model (model.options.tune_llm and tune_visual on), unlike GR00T's fine-tuning default: with
the VLM frozen no gradient flows through its attention, and a backend's backward kernel would go unchecked.
Only tiny: full is the published 2.7B model (fp32 weights, gradients and AdamW states: ~43 GB on one GPU; minutes
per compile), and it reads Qwen3's tokenizer file (model.tokenizer_path), which a smoke's model config does not
carry; GR00T has no size in between.
"""

from __future__ import annotations

from typing import Any

WORDS = "open the top drawer then press the red button and reach the green goal".split()


class GrootSmoke:
    sizes = ("tiny",)
    other_sizes = ("GR00T's other size, full, is the published 2.7B model and reads Qwen3's tokenizer file: a "
                   "training run, not a smoke")

    def config(self, size: str, attention_backend: str) -> Any:
        from embodyhpc.config.schema import ModelConfig

        return ModelConfig(name="groot", size=size, action_horizon=16, action_dim=8, max_token_len=128,
                           attention_backend=attention_backend, options={"tune_llm": True, "tune_visual": True})

    def fixed_batch(self, model_cfg: Any, rank: int) -> tuple[Any, Any, Any, int]:
        """4 samples (2 cameras, instructions of different lengths, 8 or 6 real action dims), packed into rows of
        model.max_token_len by first-fit decreasing; their noise and flow times; their VLM tokens."""
        import torch

        from embodyhpc.data.packing import first_fit_decreasing
        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.groot.batch import GrootSample, collate
        from embodyhpc.models.groot.build import max_text_tokens, options_of
        from embodyhpc.models.groot.shapes import shape_for

        shape = shape_for(model_cfg.size)
        size, horizon, dims = shape.vision.image_size, model_cfg.action_horizon, model_cfg.action_dim
        tokenizer, budget = build_tokenizer(model_cfg), max_text_tokens(model_cfg, 2)
        g = torch.Generator().manual_seed(100 + rank)
        samples = []
        for i in range(4):
            real = dims if i % 2 == 0 else dims - 2
            actions = torch.nn.functional.pad(torch.randn(horizon, real, generator=g), (0, dims - real))
            state = torch.nn.functional.pad(torch.rand(39, generator=g) * 2 - 1, (0, shape.head.max_state_dim - 39))
            samples.append(GrootSample(images=torch.rand(2, 3, size, size, generator=g), state=state,
                                       text_ids=list(tokenizer.encode(" ".join(WORDS[:3 + 3 * i])))[:budget],
                                       actions=actions, num_action_dims=real))
        batch = collate(samples, embodiment_id=options_of(model_cfg).embodiment_id)
        counts = batch.token_counts(shape.vision.num_patches)
        batch = batch.with_rows(first_fit_decreasing(counts, model_cfg.max_token_len))
        noise = torch.randn(4, horizon, dims, generator=g)
        return batch, noise, torch.rand(4, generator=g) * 0.8 + 0.1, sum(counts)


SMOKE = GrootSmoke()
