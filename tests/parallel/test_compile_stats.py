"""CompileStats measures compiled units as production compiles them: one shared backend for every unit.

Twelve activation-checkpointed blocks share one code object (CheckpointWrapper.forward), more than dynamo's
recompile_limit (8) of compiled entries per code object: with a backend per unit the tool's own backends filled
that limit and the last 4 blocks ran eagerly, reported as 0 graphs. Whether a block ran compiled is checked apart
from CompileStats: a block's Python forward runs only when the block runs eagerly (dynamo traces it symbolically,
where torch.compiler.is_compiling() is true, and a compiled block replays its graph without it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.parallel.harness import run_ranks

NUM_BLOCKS = 12
EAGER_RUNS: dict[int, int] = {}  # block index -> Python forward calls outside compilation (in the rank's process)


class SpyBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            EAGER_RUNS[self.index] = EAGER_RUNS.get(self.index, 0) + 1
        return x + self.down(torch.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SpyBlock(i) for i in range(NUM_BLOCKS))
        self.head = nn.Linear(8, 1)

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def many_units_scenario(rank: int, world: int, num_steps: int) -> dict:
    """parallelize (full AC, compile, FSDP2) with CompileStats' backend, then `num_steps` training steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
    from embodyhpc.parallel import build_mesh, parallelize
    from embodyhpc.parallel.compile_stats import CompileStats

    torch._dynamo.reset()
    counters.clear()
    EAGER_RUNS.clear()
    torch.manual_seed(0)
    model = Blocks()
    stats = CompileStats("aot_eager")
    plan = parallelize(model, ParallelismConfig(activation_checkpointing="full", compile=True),
                       PrecisionConfig(mode="fp32"), build_mesh(1, world, "cpu"), compile_backend=stats.backend_for)
    stats.attach(model)
    for _ in range(num_steps):
        model(torch.randn(4, 8)).backward()
    return {"report": stats.report(), "eager_runs": dict(EAGER_RUNS), "ac_units": plan.ac_units,
            "compiled_units": plan.compiled_units, "graphs_compiled": stats.graphs_compiled,
            "unique_graphs": counters["stats"]["unique_graphs"], "breaks_total": stats.graph_breaks_total,
            "limit": torch._dynamo.config.recompile_limit}


@pytest.mark.slow
def test_every_unit_past_dynamos_recompile_limit_reports_its_graphs() -> None:
    (rank,) = run_ranks(many_units_scenario, 1, 3, timeout_s=300)
    units = tuple(f"blocks.{i}" for i in range(NUM_BLOCKS))
    assert rank["compiled_units"] == rank["ac_units"] == units and NUM_BLOCKS > rank["limit"]
    assert rank["eager_runs"] == {}  # every block ran compiled (independent of CompileStats)
    assert set(rank["report"]) == set(units)
    for unit, counts in rank["report"].items():
        assert counts == {"graphs": counts["graphs"], "breaks": 0, "recompiles": 0} and counts["graphs"] >= 1, unit
    assert rank["graphs_compiled"] == rank["unique_graphs"] >= 1 and rank["breaks_total"] == 0


def test_graphs_run_outside_attached_units_are_refused_not_misreported() -> None:
    """Two units and no attach: a graph that runs cannot be given to either, so the report refuses to say 0."""
    import torch._dynamo

    from embodyhpc.parallel.compile_stats import CompileStats

    torch._dynamo.reset()
    stats = CompileStats("eager")
    stats.backend_for("blocks.0")
    backend = stats.backend_for("blocks.1")
    assert stats.backend_for("blocks.0") is backend  # one backend object for every unit, as production
    assert torch.compile(lambda x: x * 3, backend=backend)(torch.ones(2)).tolist() == [3.0, 3.0]
    assert stats.graphs_compiled == 1 and stats.unattributed == 1
    with pytest.raises(RuntimeError, match=r"cannot be told apart: call stats.attach\(model\) after parallelize"):
        stats.report()
    torch._dynamo.reset()
