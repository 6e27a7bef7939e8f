"""What torch.compile did to each compiled unit: graphs compiled, graph breaks, recompiles.

`CompileStats.backend_for(unit)` is a torch.compile backend that records each graph dynamo hands it, with the
compile id (frame, compile number of that frame), and passes the graph on to the real backend (inductor on GPUs,
eager/aot_eager in CPU tests and benches). parallelize() gives each compiled unit its own backend instance through
`compile_backend=stats.backend_for`, which also keeps the units' compiled code apart (dynamo re-checks the backend
of a cached entry), so every number is per unit:
- graphs: graphs compiled for the unit;
- breaks: frames beyond the first (a graph break resumes in a new frame, which compiles its own graph);
- recompiles: compiles of a frame beyond its first (a guard failed: new shapes, new constants).
Graph breaks are also counted process-wide from dynamo's own counters (`graph_breaks_total`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class UnitStats:
    graphs: int = 0
    frame_compiles: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def breaks(self) -> int:
        return max(len(self.frame_compiles) - 1, 0)

    @property
    def recompiles(self) -> int:
        return sum(count - 1 for count in self.frame_compiles.values())

    def as_dict(self) -> dict[str, int]:
        return {"graphs": self.graphs, "breaks": self.breaks, "recompiles": self.recompiles}


class CompileStats:
    def __init__(self, inner: str | Callable = "inductor") -> None:
        self.inner = inner
        self.units: dict[str, UnitStats] = {}
        self._breaks_at_start = _graph_breaks()

    def backend_for(self, unit: str) -> Callable:
        import torch._dynamo
        from torch._guards import CompileContext

        stats = self.units.setdefault(unit, UnitStats())
        inner = torch._dynamo.lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner

        def backend(graph_module: Any, example_inputs: list) -> Callable:
            compile_id = CompileContext.current_compile_id()
            stats.graphs += 1
            if compile_id is not None:
                stats.frame_compiles[compile_id.frame_id] += 1
            return inner(graph_module, example_inputs)

        return backend

    @property
    def graph_breaks_total(self) -> int:
        """Graph breaks dynamo counted in this process since these stats were made (all units, all reasons)."""
        return _graph_breaks() - self._breaks_at_start

    def report(self) -> dict[str, dict[str, int]]:
        return {unit: stats.as_dict() for unit, stats in self.units.items()}


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
