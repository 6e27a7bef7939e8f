"""What torch.compile did to each compiled unit: graphs it ran, graph breaks, recompiles.

    stats = CompileStats("aot_eager")
    parallelize(model, parallel_cfg, precision_cfg, mesh, compile_backend=stats.backend_for)
    stats.attach(model)             # after parallelize: tells which unit each compiled graph runs in
    ... train ...
    stats.report()                  # {"layers.0": {"graphs": 1, "breaks": 0, "recompiles": 0}, ...}

Measured as production compiles: every unit gets the same backend object (production passes the one string
"inductor"), which records each graph dynamo hands it, with its compile id (frame, compile number of that frame),
and passes it on to the real backend (inductor on GPUs, eager/aot_eager in CPU tests and benches). Units whose
forward is the same code object (every block of a class, every CheckpointWrapper.forward) then share compiled code
as they do in production. A backend per unit would not: dynamo keeps a cache entry per backend on the shared code
object and, past its recompile_limit (8), runs the remaining units eagerly, so the tool itself made bigger models
look uncompiled. A graph is therefore counted for the unit it runs in (dynamo-disabled forward hooks `attach` adds
say which one), not the unit that happened to compile it:
- graphs: distinct compiled graphs the unit ran (0: the unit ran eagerly);
- breaks: frames beyond the first among them (a graph break resumes in a new frame, which compiles its own graph);
- recompiles: graphs beyond the first of a frame among them (a guard failed: new shapes, new constants).
A function compiled on its own (no module to attach to) names its one unit: `backend_for("flex")` without attach.
Graph breaks are also counted process-wide from dynamo's own counters (`graph_breaks_total`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class UnitStats:
    ran: set[int] = field(default_factory=set)
    """Indices (into CompileStats.compiled) of the graphs the unit ran."""
    frames: dict[int, set[int]] = field(default_factory=dict)
    """frame id -> indices of the graphs of that frame the unit ran."""

    @property
    def graphs(self) -> int:
        return len(self.ran)

    @property
    def breaks(self) -> int:
        return max(len(self.frames) - 1, 0)

    @property
    def recompiles(self) -> int:
        return sum(len(graphs) - 1 for graphs in self.frames.values())

    def as_dict(self) -> dict[str, int]:
        return {"graphs": self.graphs, "breaks": self.breaks, "recompiles": self.recompiles}


class CompileStats:
    def __init__(self, inner: str | Callable = "inductor") -> None:
        self.inner = inner
        self.units: dict[str, UnitStats] = {}
        self.compiled: list[int] = []
        """The frame id of every graph the shared backend compiled, in order (-1: compiled outside dynamo)."""
        self.unattributed = 0
        """Runs of compiled graphs outside every attached unit (with several units and no attach: all of them)."""
        self._backend: Callable | None = None
        self._calling: list[str] = []
        self._handles: list[Any] = []
        self._breaks_at_start = _graph_breaks()

    def backend_for(self, unit: str) -> Callable:
        """The one backend every unit compiles with (see the module doc); registers `unit`."""
        self.units.setdefault(unit, UnitStats())
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def attach(self, model: Any) -> None:
        """Forward hooks on each registered unit of `model` that tell the graphs run inside it (call after
        parallelize, which compiled the units; they run eagerly, like FSDP2's own hooks)."""
        import torch._dynamo

        for name in self.units:
            module = model.get_submodule(name)
            enter = torch._dynamo.disable(functools.partial(self._enter, name))
            leave = torch._dynamo.disable(self._leave)
            self._handles += [module.register_forward_pre_hook(enter),
                              module.register_forward_hook(leave, always_call=True)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def graphs_compiled(self) -> int:
        """Graphs the shared backend compiled, all units together."""
        return len(self.compiled)

    @property
    def graph_breaks_total(self) -> int:
        """Graph breaks dynamo counted in this process since these stats were made (all units, all reasons)."""
        return _graph_breaks() - self._breaks_at_start

    def report(self) -> dict[str, dict[str, int]]:
        if self.unattributed and len(self.units) > 1 and not self._handles:
            raise RuntimeError(f"{self.unattributed} compiled graph runs of {len(self.units)} units cannot be told "
                               "apart: call stats.attach(model) after parallelize")
        return {unit: stats.as_dict() for unit, stats in self.units.items()}

    # ---- internals ----
    def _make_backend(self) -> Callable:
        import torch._dynamo
        from torch._guards import CompileContext

        inner = torch._dynamo.lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner

        def backend(graph_module: Any, example_inputs: list) -> Callable:
            compile_id = CompileContext.current_compile_id()
            index = len(self.compiled)
            self.compiled.append(compile_id.frame_id if compile_id is not None else -1)
            compiled = inner(graph_module, example_inputs)

            @functools.wraps(compiled)  # keeps the calling convention dynamo reads off it (_boxed_call)
            def run(*args: Any) -> Any:
                self._ran(index)
                return compiled(*args)

            return run

        return backend

    def _enter(self, unit: str, module: Any, args: Any) -> None:
        self._calling.append(unit)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self._calling:
            self._calling.pop()

    def _ran(self, index: int) -> None:
        if self._calling:
            unit = self._calling[-1]
        elif len(self.units) == 1 and not self._handles:
            unit = next(iter(self.units))
        else:
            self.unattributed += 1
            return
        stats = self.units[unit]
        stats.ran.add(index)
        stats.frames.setdefault(self.compiled[index], set()).add(index)


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
