"""no_torch_dynamo as in transformer_engine/pytorch/jit.py (v2.9-v2.18): with torch >= 2.1 (and outside ONNX export)
it is `torch._dynamo.disable(f, recursive=recursive)`, so a compiled caller graph-breaks at every function it
decorates (te.Linear.forward among them) and dynamo never traces into it."""

from __future__ import annotations

import torch


def no_torch_dynamo(recursive: bool = True):
    def decorate(function):
        return torch._dynamo.disable(function, recursive=recursive)

    return decorate
