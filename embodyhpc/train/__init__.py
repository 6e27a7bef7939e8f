"""The training loop: `embodyhpc.train.loop.train` (FSDP2, gradient accumulation, async checkpoints, metrics).

Modules: schedule (warm-up + cosine), optim (AdamW decay groups),
stream (micro-batches across epochs, sampler accounting), metrics (MetricsSink, JSON lines, console), loop.
Importing this package imports nothing heavy (the CLI may import it); the modules import torch.
"""
