"""GR00T-N1.5 in our own PyTorch: an Eagle-style VLM (backbone.py) and a flow-matching action head (head.py).

Flow matching, in GR00T's convention: t = 1 is the data, t = 0 pure noise.
    x_t = (1 - t) * noise + t * actions,    target velocity v = actions - noise,
t = (0.999 - Beta(1.5, 1)) / 0.999 in training (more weight on noisy times), entering the network bucketed as
int(t * 1000). The loss is the MSE between predicted and target velocity over each sample's valid entries (steps
before the episode end, the robot's real action dims), averaged per sample then over samples, so packing changes
no sample's weight. Inference: `num_steps` Euler steps from N(0, I) at t = 0, 1/n, ..., x <- x + v / n (4 steps in
GR00T-N1.5); the VLM features are computed once per chunk.

Unlike the published code, attention never crosses samples: the LLM is causal within each sample, the VL adapter
and the DiT's cross-attention see only their own sample's tokens (padding excluded), which is what makes packed
and padded batches compute the same function (tests/models/test_groot.py). All three go through the attention
backend seam (models/attention.py), planned once per pass here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from embodyhpc.models.flow import FlowMatchingOutput, action_loss_mask, masked_flow_loss, training_actions
from embodyhpc.models.groot.backbone import EagleBackbone
from embodyhpc.models.groot.batch import GrootBatch
from embodyhpc.models.groot.head import DiTContext, FlowMatchingHead
from embodyhpc.models.groot.layers import CategorySpecificLinear
from embodyhpc.models.groot.plan import GrootPlan, build_plan
from embodyhpc.models.groot.shapes import GrootShape
from embodyhpc.models.init import Constant, Normal, Rule, init_parameters, linear_like, owned
from embodyhpc.models.norms import RMSNorm
from embodyhpc.models.vision import VisionTower

NOISE_S = 0.999
BETA_ALPHA = 1.5  # Beta(1.5, 1): CDF u**1.5, so a draw is U ** (1 / 1.5)


def sample_time(num_samples: int, *, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    gen_device = generator.device if generator is not None else torch.device(device)
    beta = torch.rand(num_samples, generator=generator, device=gen_device) ** (1.0 / BETA_ALPHA)
    return ((NOISE_S - beta) / NOISE_S).to(device)


class GrootPolicy(nn.Module):
    def __init__(self, shape: GrootShape, *, action_horizon: int, action_dim: int, attention_backend: str = "auto",
                 tune_llm: bool = False, tune_visual: bool = False) -> None:
        super().__init__()
        self.shape, self.action_horizon, self.action_dim = shape, action_horizon, action_dim
        self.attention_backend = attention_backend
        self.backbone = EagleBackbone(shape)
        self.action_head = FlowMatchingHead(shape, action_horizon=action_horizon, action_dim=action_dim)
        # fine-tuning defaults of GR00T: the LLM frozen, and the vision tower with its projector
        self.backbone.embed_tokens.requires_grad_(tune_llm)
        self.backbone.layers.requires_grad_(tune_llm)
        self.backbone.norm.requires_grad_(tune_llm)
        self.backbone.vision.requires_grad_(tune_visual)
        self.backbone.projector.requires_grad_(tune_visual)
        self.init_weights()

    # ---- declared for parallel/ ----
    def fsdp_forward_methods(self) -> list[str]:
        """Methods besides forward that parallel/ registers with FSDP (they gather the sharded parameters)."""
        return ["sample_actions", "flow_velocities"]

    def fsdp_units(self) -> list[nn.Module]:
        """Sharded one by one, then the root: every vision, LLM, VL-adapter and DiT block, the token embedding
        (0.3B at full size) and the action encoder (0.23B: three per-embodiment weights)."""
        head = self.action_head
        return [*self.backbone.vision.blocks, self.backbone.embed_tokens, *self.backbone.layers,
                *head.vl_self_attention.transformer_blocks, head.action_encoder, *head.model.transformer_blocks]

    def init_weights(self, seed: int | None = None) -> None:
        if any(p.is_meta for p in self.parameters()):
            return  # parallel/'s materialize fills the shards by the same rules
        init_parameters(self, self.init_rules, seed)

    def init_rules(self, fqn: str, module: nn.Module) -> dict[str, Rule]:
        if isinstance(module, CategorySpecificLinear):
            return {"W": Normal(0.02), "b": Constant(0.0)}
        if linear_like(module) or isinstance(module, (nn.Conv2d, nn.Embedding)):
            return {name: Normal(0.02) if name == "weight" else Constant(0.0)
                    for name in owned(module, ("weight", "bias"))}
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            return {name: Constant(1.0 if name == "weight" else 0.0) for name in owned(module, ("weight", "bias"))}
        if isinstance(module, VisionTower):
            return {"position_embedding": Normal(0.02)}
        return {}

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    # ---- training ----
    def forward(self, batch: GrootBatch, *, noise: torch.Tensor | None = None, time: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> FlowMatchingOutput:
        actions = training_actions(batch.actions, self.action_horizon, self.action_dim)
        device = actions.device
        if noise is None:
            gen_device = generator.device if generator is not None else device
            noise = torch.randn(actions.shape, generator=generator, device=gen_device).to(device)
        if time is None:
            time = sample_time(actions.shape[0], generator=generator, device=device)
        t = time.float()[:, None, None]
        noisy = (1.0 - t) * noise + t * actions
        plan = self.plan(batch)
        context, ctx = self.encode(batch, plan)
        velocity = self.action_head.velocity(context, self.padded_state(batch), noisy, self.timestep_bucket(time),
                                             batch.embodiment, ctx)
        mask = self.loss_mask(batch)
        return masked_flow_loss(velocity, actions - noise, mask)

    def loss_mask(self, batch: GrootBatch) -> torch.Tensor:
        """[N, H, A] float: 1 on the entries the loss counts."""
        return action_loss_mask(batch.actions, batch.action_is_pad, batch.action_dim_mask)

    # ---- inference ----
    @torch.no_grad()
    def sample_actions(self, batch: GrootBatch, *, num_steps: int = 4, noise: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """Actions [N, H, A]: Euler integration from noise at t = 0 to t = 1 (registered as an FSDP forward
        method by parallel/)."""
        device = batch.images.device
        if noise is None:
            gen_device = generator.device if generator is not None else device
            noise = torch.randn((batch.num_samples, self.action_horizon, self.action_dim), generator=generator,
                                device=gen_device).to(device)
        x = noise.float()
        plan = self.plan(batch)
        context, ctx = self.encode(batch, plan)
        state = self.padded_state(batch)
        for step in range(num_steps):
            time = torch.full((batch.num_samples,), step / num_steps, device=device)
            velocity = self.action_head.velocity(context, state, x, self.timestep_bucket(time), batch.embodiment, ctx)
            x = x + velocity / num_steps
        return x

    # ---- RL (embodyhpc/rl/flow_sde.py): velocities in rl's convention, with gradients, VLM encoded once ----
    def flow_velocity_fn(self, batch: GrootBatch) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """v(x [N, H, A], t [N]) -> [N, H, A] in rl's convention (t = 1 noise, t = 0 the action, v = dx/dt): this
        model's time is 1 - t and its velocity -v. The VLM and the VL adapter run once, here, and every call reuses
        them. Pass t as float64: 1 - t is taken in float64 before the float32 bucketing, so t = 1 - k/K lands in the
        bucket sample_actions' k/K does. Gradients flow unless the caller disables them (the frozen VLM never)."""
        plan = self.plan(batch)
        context, ctx = self.encode(batch, plan)
        state = self.padded_state(batch)

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            groot_time = (1.0 - t.double()).float()
            return -self.action_head.velocity(context, state, x.float(), self.timestep_bucket(groot_time),
                                              batch.embodiment, ctx)

        return velocity

    def flow_velocities(self, batch: GrootBatch, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[N, K, H, A]: flow_velocity_fn(batch)(x[:, k], t[k]) for the K denoising inputs x [N, K, H, A] at times
        t [K] (rl's convention), in one call (what the RL actor differentiates; an FSDP forward method)."""
        if x.ndim != 4 or t.shape != x.shape[1:2]:
            raise ValueError(f"flow_velocities needs x [N, K, H, A] and t [K], got {tuple(x.shape)}, {tuple(t.shape)}")
        velocity = self.flow_velocity_fn(batch)
        return torch.stack([velocity(x[:, k], t[k].expand(x.shape[0])) for k in range(x.shape[1])], dim=1)

    # ---- pieces ----
    def plan(self, batch: GrootBatch) -> GrootPlan:
        if batch.images.ndim != 5 or batch.images.shape[2] != 3:
            raise ValueError(f"images must be [N, cameras, 3, H, W], got {tuple(batch.images.shape)}")
        return build_plan(rows=batch.packing_rows(),
                          num_image_tokens=batch.images.shape[1] * self.shape.vision.num_patches,
                          text_lengths=[int(n) for n in batch.text_lengths.tolist()],
                          max_text_len=batch.text_ids.shape[1], tokens_per_sample=self.action_head.tokens_per_sample,
                          device=batch.images.device)

    def encode(self, batch: GrootBatch, plan: GrootPlan) -> tuple[torch.Tensor, DiTContext]:
        """The DiT's context (VLM features through the VL adapter, [R, key_width, width]) and its cross-attention plan;
        the frozen backbone runs without autograd."""
        dtype, needs_grad = self.action_head.vlln.weight.dtype, torch.is_grad_enabled()
        backbone_grad = needs_grad and not self.backbone_frozen
        llm = plan.llm_layout.prepare(self.attention_backend, dtype=self.backbone.projector.weight.dtype,
                                      needs_grad=backbone_grad)
        with torch.set_grad_enabled(backbone_grad):
            features = self.backbone(batch.images, batch.text_ids, plan, llm)
        vl = plan.vl_layout.prepare(self.attention_backend, dtype=dtype, needs_grad=needs_grad)
        cross = plan.cross_layout.prepare(self.attention_backend, dtype=dtype, needs_grad=needs_grad)
        context = self.action_head.encode_vl(features, vl, plan.key_width)
        return context, DiTContext(cross=cross, q_rows=plan.q_rows, q_inverse=plan.q_inverse,
                                   num_tokens=plan.tokens_per_sample, token_stride=plan.token_stride)

    def padded_state(self, batch: GrootBatch) -> torch.Tensor:
        width = self.shape.head.max_state_dim
        state = batch.state.float()
        if state.shape[-1] > width:
            raise ValueError(f"the state has {state.shape[-1]} dims, the model reads at most {width}")
        return nn.functional.pad(state, (0, width - state.shape[-1]))

    def timestep_bucket(self, time: torch.Tensor) -> torch.Tensor:
        return (time.float() * self.shape.head.num_timestep_buckets).long().float()
