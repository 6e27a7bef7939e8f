"""pi0.5 in PyTorch: a VLM prefix (SigLIP-style patches, prompt with discretised state) and a flow-matching action
expert that attends jointly with it in every layer (layers.JointLayer), on padded or packed batches.

Flow matching, in the pi0 / openpi convention: t = 1 is pure noise, t = 0 the data.
    x_t = t * noise + (1 - t) * actions,    target velocity u = dx_t/dt = noise - actions,
t ~ Beta(1.5, 1) * 0.999 + 0.001 (more weight on noisy times). The loss is the MSE between the predicted and the
target velocity over the valid entries of each sample (steps before the episode end, the robot's real action
dims), averaged per sample, then over samples, so packing does not change any sample's weight.
Inference integrates dx/dt = v from t = 1 to 0 in `num_steps` Euler steps, x <- x - v / num_steps. The prefix
never attends to actions, so its keys and values are computed once and cached for all steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from embodyhpc.models.flow import FlowMatchingOutput, action_loss_mask, masked_flow_loss, training_actions
from embodyhpc.models.init import Constant, Normal, Pieces, Rule, init_parameters, linear_like, owned
from embodyhpc.models.norms import OffsetRMSNorm
from embodyhpc.models.pi05.batch import Pi05Batch
from embodyhpc.models.pi05.layers import AdaRMSNorm, JointLayer, KeyValue, LayerContext, TimeCondition
from embodyhpc.models.pi05.plan import TokenPlan, build_token_plan
from embodyhpc.models.pi05.shapes import Pi05Shape
from embodyhpc.models.rope import rope_angles
from embodyhpc.models.vision import VisionTower

TIME_BETA_ALPHA = 1.5  # t ~ Beta(1.5, 1): its CDF is t**1.5, so t = U**(1/1.5) by inversion
TIME_MIN_PERIOD, TIME_MAX_PERIOD = 4e-3, 4.0  # sinusoidal time embedding periods


def sample_time(num_samples: int, *, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    uniform = torch.rand(num_samples, generator=generator, device=_generator_device(generator, device))
    return (uniform ** (1.0 / TIME_BETA_ALPHA) * 0.999 + 0.001).to(device)


def time_embedding(time: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding [N, dim] (float32) of times in [0, 1]: [sin | cos] of 2 pi t / period, periods
    log-spaced from 4e-3 to 4. Angles in float64, as openpi's PyTorch pi0.5 computes them: at t ~ 1 the shortest
    period's angle is ~1571 rad, where float32 loses ~6e-5 in sin/cos (tests/models/test_reference_pi05.py)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=time.device, dtype=torch.float64)
    period = TIME_MIN_PERIOD * (TIME_MAX_PERIOD / TIME_MIN_PERIOD) ** fraction
    angle = time.double()[:, None] / period * (2 * math.pi)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


def _generator_device(generator: torch.Generator | None, device) -> torch.device:
    return generator.device if generator is not None else torch.device(device)


class Pi05Policy(nn.Module):
    def __init__(self, shape: Pi05Shape, *, action_horizon: int, action_dim: int,
                 attention_backend: str = "auto", state_dim: int = 0) -> None:
        super().__init__()
        self.shape = shape
        self.action_horizon, self.action_dim = action_horizon, action_dim
        self.attention_backend = attention_backend
        vlm_width, expert_width = shape.vlm.width, shape.expert.width
        self.vision = VisionTower(shape.vision)
        self.vision_projector = nn.Linear(shape.vision.width, vlm_width)
        self.embed_tokens = nn.Embedding(shape.vocab_size, vlm_width)
        # The last layer's prefix stream only provides keys/values (JointLayer): its VLM block has no q/o/MLP.
        self.layers = nn.ModuleList(JointLayer(shape, prefix_output=i < shape.depth - 1) for i in range(shape.depth))
        self.action_in = nn.Linear(action_dim, expert_width)
        self.time_mlp_in = nn.Linear(expert_width, expert_width)
        self.time_mlp_out = nn.Linear(expert_width, expert_width)
        self.final_norm = AdaRMSNorm(expert_width, expert_width, shape.norm_eps, gated=False)  # no branch to gate
        self.action_out = nn.Linear(expert_width, action_dim)
        # model.state_input=expert: the continuous state, projected and added to every action token (pi0 feeds its
        # state to the expert too, as one more token); the prompt then carries no state
        self.state_dim = state_dim
        self.state_in = nn.Linear(state_dim, expert_width) if state_dim else None
        self.init_weights()

    # ---- declared for parallel/: no distributed code here ----
    def fsdp_forward_methods(self) -> list[str]:
        """Methods besides forward that parallel/ registers with FSDP (they gather the sharded parameters)."""
        return ["sample_actions", "flow_velocities"]

    def fsdp_units(self) -> list[nn.Module]:
        """Modules parallel/ shards one by one (then the root): the token embedding (0.5B parameters at full
        size), every vision block, and every joint layer (the VLM and expert blocks of one depth are one unit
        because one forward needs both)."""
        return [self.embed_tokens, *self.vision.blocks, *self.layers]

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter by init_rules (models/init.py); `seed` None draws one from torch's global
        generator. parallel/ applies the same rules to the shards of a meta-device build (materialize)."""
        if any(p.is_meta for p in self.parameters()):
            return  # built on the meta device: parallel/'s materialize fills the allocated shards by the same rules
        init_parameters(self, self.init_rules, seed)

    def init_rules(self, fqn: str, module: nn.Module) -> dict[str, Rule]:
        """{parameter name: rule} for the parameters `module` owns (see models/init.py), by module type."""
        if isinstance(module, AdaRMSNorm):  # start as a plain RMSNorm and residual; time modulation is learned
            # gate = 1 (openpi zero-initialises it, adaLN-Zero: a choice of init only); rows [scale | shift | gate]
            runs = ((2 * module.dim, 0.0), (module.dim, 1.0)) if module.gated else ((2 * module.dim, 0.0),)
            return {"modulation.weight": Constant(0.0), "modulation.bias": Pieces(runs)}
        if linear_like(module) or isinstance(module, (nn.Conv2d, nn.Embedding)):
            return {name: Normal(0.02) if name == "weight" else Constant(0.0)
                    for name in owned(module, ("weight", "bias"))}
        if isinstance(module, nn.LayerNorm):
            return {name: Constant(1.0 if name == "weight" else 0.0) for name in owned(module, ("weight", "bias"))}
        if isinstance(module, OffsetRMSNorm):
            return {"weight": Constant(0.0)}  # Gemma's scale is stored as an offset from 1
        if isinstance(module, VisionTower):
            return {"position_embedding": Normal(0.02)}
        return {}

    # ---- training ----
    def forward(self, batch: Pi05Batch, *, noise: torch.Tensor | None = None, time: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> FlowMatchingOutput:
        """The flow-matching loss of a batch with actions; noise and time are drawn unless given (tests)."""
        actions = training_actions(batch.actions, self.action_horizon, self.action_dim)
        device = actions.device
        if noise is None:
            noise = torch.randn(actions.shape, generator=generator,
                                device=_generator_device(generator, device)).to(device)
        if time is None:
            time = sample_time(actions.shape[0], generator=generator, device=device)
        t = time.float()[:, None, None]
        noisy = t * noise + (1.0 - t) * actions
        velocity = self.predict_velocity(batch, noisy, time)
        mask = self.loss_mask(batch)
        return masked_flow_loss(velocity, noise - actions, mask)

    def loss_mask(self, batch: Pi05Batch) -> torch.Tensor:
        """[N, H, A] float: 1 on the entries the loss counts."""
        return action_loss_mask(batch.actions, batch.action_is_pad, batch.action_dim_mask)

    def predict_velocity(self, batch: Pi05Batch, noisy_actions: torch.Tensor, time: torch.Tensor, *,
                         plan: TokenPlan | None = None) -> torch.Tensor:
        """v(x_t, t) [N, H, A] with the full model (prefix recomputed)."""
        plan = plan if plan is not None else self.token_plan(batch)
        ctx = self._context(plan, time, attention=("joint", "suffix"))
        prefix = self._embed_prefix(batch, plan)
        suffix = self._embed_suffix(noisy_actions, plan, self.state_embedding(batch))
        for layer in self.layers:
            prefix, suffix, _ = layer(prefix, suffix, ctx=ctx)
        return self._actions_out(suffix, ctx.cond, plan)

    # ---- inference ----
    @torch.no_grad()
    def sample_actions(self, batch: Pi05Batch, *, num_steps: int = 10, noise: torch.Tensor | None = None,
                       generator: torch.Generator | None = None, use_kv_cache: bool = True) -> torch.Tensor:
        """Actions [N, H, A] by Euler integration from noise (t = 1) to t = 0; deterministic given the generator.

        Under FSDP this is not `forward`: parallel/ registers it (fully_shard's register_fsdp_forward_method).
        """
        device = batch.images.device
        shape = (batch.num_samples, self.action_horizon, self.action_dim)
        x = noise if noise is not None else torch.randn(
            shape, generator=generator, device=_generator_device(generator, device)).to(device)
        x = x.float()
        plan = self.token_plan(batch)
        cache = self.prefix_cache(batch, plan) if use_kv_cache else None
        state = self.state_embedding(batch)
        dt = -1.0 / num_steps
        for step in range(num_steps):
            time = torch.full((batch.num_samples,), 1.0 + step * dt, device=device)
            if cache is None:
                velocity = self.predict_velocity(batch, x, time, plan=plan)
            else:
                velocity = self.velocity_from_cache(cache, x, time, plan, state=state)
            x = x + dt * velocity
        return x

    # ---- RL (embodyhpc/rl/flow_sde.py): velocities with gradients, prefix encoded once ----
    def flow_velocity_fn(self, batch: Pi05Batch) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """v(x [N, H, A], t [N]) -> [N, H, A] (t = 1 noise, v = dx/dt: this model's own convention); the prefix is
        encoded once, here, and reused by every call. Gradients flow unless the caller disables them; a sharded
        model runs it only inside a registered FSDP method (flow_velocities is one)."""
        plan = self.token_plan(batch)
        cache = self.prefix_cache(batch, plan)
        state = self.state_embedding(batch)

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            # float32 times, as sample_actions passes them (the time embedding reads their float32 value)
            return self.velocity_from_cache(cache, x.float(), t.float(), plan, state=state)

        return velocity

    def flow_velocities(self, batch: Pi05Batch, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[N, K, H, A]: flow_velocity_fn(batch)(x[:, k], t[k]) for the K denoising inputs x [N, K, H, A] at times
        t [K], in one call (what the RL actor differentiates; an FSDP forward method)."""
        if x.ndim != 4 or t.shape != x.shape[1:2]:
            raise ValueError(f"flow_velocities needs x [N, K, H, A] and t [K], got {tuple(x.shape)}, {tuple(t.shape)}")
        velocity = self.flow_velocity_fn(batch)
        return torch.stack([velocity(x[:, k], t[k].expand(x.shape[0])) for k in range(x.shape[1])], dim=1)

    def prefix_cache(self, batch: Pi05Batch, plan: TokenPlan) -> list[KeyValue]:
        """Keys and values of the prefix in every layer (rotary applied)."""
        ctx = self._context(plan, None, attention=("prefix",))
        prefix = self._embed_prefix(batch, plan)
        cache = []
        for layer in self.layers:
            prefix, _, kv = layer(prefix, None, ctx=ctx)
            cache.append(kv)
        return cache

    def velocity_from_cache(self, cache: list[KeyValue], noisy_actions: torch.Tensor, time: torch.Tensor,
                            plan: TokenPlan, *, state: torch.Tensor | None = None) -> torch.Tensor:
        """`state`: state_embedding(batch) when the model reads a continuous state (computed once per batch)."""
        ctx = self._context(plan, time, attention=("suffix",))
        suffix = self._embed_suffix(noisy_actions, plan, state)
        for layer, kv in zip(self.layers, cache, strict=True):
            _, suffix, _ = layer(None, suffix, ctx=ctx, cached_kv=kv)
        return self._actions_out(suffix, ctx.cond, plan)

    # ---- pieces ----
    def token_plan(self, batch: Pi05Batch) -> TokenPlan:
        if batch.images.shape[2] != 3:
            raise ValueError(f"images must be [N, cameras, 3, H, W], got {tuple(batch.images.shape)}")
        return build_token_plan(
            rows=batch.packing_rows(), num_cameras=batch.num_cameras, num_patches=self.shape.vision.num_patches,
            camera_valid=batch.camera_valid(), prompt_lengths=[int(n) for n in batch.prompt_lengths.tolist()],
            max_prompt_len=batch.prompt_ids.shape[1], horizon=self.action_horizon, device=batch.images.device)

    def _context(self, plan: TokenPlan, time: torch.Tensor | None, *, attention: tuple[str, ...]) -> LayerContext:
        """Everything the layers of one pass share, built here, before the first layer, so that no layer runs a
        data-dependent op or a host sync (and a compiled layer has nothing to break its graph on): rotary angles,
        the time condition, and attention planned for each layout in `attention` (joint, prefix, suffix)."""
        shape = self.shape
        cond = None
        if time is not None:
            emb = time_embedding(time, shape.expert.width).to(self.time_mlp_in.weight.dtype)
            emb = nn.functional.silu(self.time_mlp_out(nn.functional.silu(self.time_mlp_in(emb))))
            cond = TimeCondition(per_sample=emb, token_sample=plan.suffix_sample)
        # the layers compute q/k/v in the dtype the weights are used in (bf16 under mixed precision)
        dtype, needs_grad = self.vision_projector.weight.dtype, torch.is_grad_enabled()
        prepared = {f"{name}_attention": getattr(plan, f"{name}_layout").prepare(
            self.attention_backend, dtype=dtype, needs_grad=needs_grad) for name in attention}
        return LayerContext(plan=plan, prefix_rope=rope_angles(plan.prefix_positions, shape.head_dim, shape.rope_base),
                            suffix_rope=rope_angles(plan.suffix_positions, shape.head_dim, shape.rope_base),
                            cond=cond, **prepared)

    def _embed_prefix(self, batch: Pi05Batch, plan: TokenPlan) -> torch.Tensor:
        """[R, Tp, vlm width]: projected patch tokens and scaled prompt embeddings, gathered into rows."""
        dtype = self.vision.patch_embed.weight.dtype
        images = batch.images.flatten(0, 1)  # [N*C, 3, H, W]
        if batch.image_mask is None:
            patches = self.vision_projector(self.vision(images.to(dtype)))  # [N*C, P, vlm width]
        else:  # only the cameras a sample has: a missing camera's tokens are never gathered, so never encoded
            present = batch.image_mask.flatten().nonzero().flatten().to(images.device)
            encoded = self.vision_projector(self.vision(images[present].to(dtype)))  # [M, P, vlm width]
            patches = encoded.new_zeros(images.shape[0], *encoded.shape[1:]).index_copy(0, present, encoded)
        patches = patches.flatten(0, 1)
        text = self.embed_tokens(batch.prompt_ids).flatten(0, 1)
        text = text * torch.tensor(math.sqrt(self.shape.vlm.width), dtype=text.dtype)  # Gemma's embedding scale
        source = torch.cat([patches, text.to(patches.dtype), patches.new_zeros(1, patches.shape[-1])])
        return source[plan.prefix_source]

    def state_embedding(self, batch: Pi05Batch) -> torch.Tensor | None:
        """[N, expert width] from batch.state (zero-padded to state_dim), or None when the state is in the prompt."""
        if self.state_in is None:
            return None
        if batch.state is None:
            raise ValueError("this model reads the continuous state (model.state_input=expert): batch.state is None")
        state = batch.state.float()
        if state.shape[-1] > self.state_dim:
            raise ValueError(f"the state has {state.shape[-1]} dims, model.state_dim is {self.state_dim}: raise "
                             "model.state_dim")
        state = nn.functional.pad(state, (0, self.state_dim - state.shape[-1]))
        return self.state_in(state.to(self.state_in.weight.dtype))

    def _embed_suffix(self, noisy_actions: torch.Tensor, plan: TokenPlan,
                      state: torch.Tensor | None = None) -> torch.Tensor:
        tokens = self.action_in(noisy_actions.to(self.action_in.weight.dtype))  # [N, H, width]
        if state is not None:
            tokens = tokens + state[:, None, :].to(tokens.dtype)
        tokens = tokens.flatten(0, 1)  # [N*H, width]
        return torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])[plan.suffix_source]

    def _actions_out(self, suffix: torch.Tensor, cond: TimeCondition, plan: TokenPlan) -> torch.Tensor:
        x = self.final_norm(suffix, cond)[0].flatten(0, 1)[plan.action_slots]
        x = x.view(plan.num_samples, self.action_horizon, -1)
        return self.action_out(x).float()
