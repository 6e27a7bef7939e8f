"""`embodyhpc smoke`: a short training on this node for every GPU path the install offers, one row each.

The first thing to run on a new cluster's first GPU node: tens of steps of a small model (the recipe's model.name,
pi0.5 without a recipe; the `smoke` entry of its spec, models/protocol.SmokeModel, gives the sizes it smokes, the
model config at a size and a fixed packed batch per rank) through the code training uses (build on meta,
parallelize: AC / compile / FSDP2, materialize, the loop's micro_batch_step with its FP8 context, the FP8 GEMM
counter), once per path:
- attention backends: sdpa (the reference), flash varlen, torch varlen, flex;
- precision: bf16, transformer-engine FP8 with each recipe (current, delayed, block), torchao FP8;
- compile on, and compile with CUDA graphs;
- FSDP2 over all of this node's GPUs.
A row says ran (passed or failed) or skipped and why (no GPU, a library missing or too old, a recipe the GPU
cannot run), the loss at the first and last step (the same batch, noise and flow times every step: it must fall),
tokens/s (median step after the first 3, which include compilation), peak memory and FP8 GEMMs per step; the CUDA
graphs row also the graphs recorded after those 3 steps (re-recordings: 0 where the graphs pay; FSDP2's parameter
addresses change every step, so validate refuses parallelism.cuda_graphs for training and this row shows why).
Without a GPU the CPU references run (sdpa and the CPU varlen kernel, fp32 and bf16, torchao FP8, compile with the
aot_eager backend: inductor's CPU build takes minutes here) and every GPU row is skipped with its reason.
After the rows, video decode: samples/s per DataLoader worker on the CPU and on the GPU (NVDEC), per codec, or why
the GPU cannot decode (embodyhpc/data/decode_bench.py); a decode that fails fails the smoke.

Each row runs in a process of its own (`python -m embodyhpc.train.smoke ROW_JSON`), so a kernel that crashes or
hangs fails its row only; the FSDP row starts one process per GPU inside that process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROW_TIMEOUT_S = 900
TE_RECIPES = ("current", "delayed", "block")
WARMUP_STEPS = 3  # compilation, cudagraph warm-up and first recordings: left out of tokens/s and re-recordings


@dataclass(frozen=True)
class SmokePath:
    name: str
    device: str = "cuda"
    attention: str = "auto"
    precision: str = "bf16"
    fp8_backend: str = "torchao"
    fp8_recipe: str = "current"
    compile: bool = False
    cuda_graphs: bool = False
    ranks: int = 1
    resume_and_evaluate: bool = False
    """After training: checkpoint, resume a fresh model, export, evaluate (embodyhpc/train/smoke_chain.py)."""


@dataclass
class SmokeRow:
    path: SmokePath
    status: str  # passed, failed, skipped
    reason: str | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    fp8_gemms: float | None = None
    cuda_graph_rerecords: int | None = None
    """CUDA graphs recorded after the warm-up steps (rows with cuda_graphs only): 0 where graphs replay."""
    seconds: float | None = None
    model: str | None = None
    """The class the row's process built and trained (e.g. Pi05Policy, GrootPolicy)."""
    recipe: bool = False
    """The row matches the recipe's own attention, precision and compile settings."""

    def as_dict(self) -> dict:
        return {**asdict(self), "path": asdict(self.path)}


@dataclass
class SmokeReport:
    rows: list[SmokeRow] = field(default_factory=list)
    device: str = ""
    model: str = ""
    """model.name of what was smoked."""
    size: str = ""
    egl: str | None = None
    """On a GPU node: the EGL device a simulator would render on for this node's CUDA device 0, and why
    (embodyhpc/sim/egl.py), or why none can be chosen; None without a GPU."""
    decode: dict | None = None
    """Video decode samples/s on the CPU and the GPU (data/decode_bench.py DecodeBench.as_dict); None: not measured."""

    @property
    def ok(self) -> bool:
        decoded = self.decode is None or self.decode["status"] != "failed"
        return decoded and all(row.status != "failed" for row in self.rows) and any(
            row.status == "passed" for row in self.rows)

    def as_dict(self) -> dict:
        """smoke.json and `embodyhpc smoke --json`."""
        return {"model": self.model, "size": self.size, "device": self.device, "egl": self.egl, "ok": self.ok,
                "rows": [row.as_dict() for row in self.rows], "decode": self.decode}


def smoke_model(name: str, size: str, *, where: str | None = None):
    """The spec's smoke entry (models/protocol.SmokeModel) of model `name`, checked to smoke `size`; a one-line
    ConfigError (exit 2) for a model without one (`where`: the recipe that names it) or a size it does not smoke.
    Imports no torch."""
    from embodyhpc.errors import ConfigError
    from embodyhpc.models import model_spec

    spec = model_spec(name)
    if spec.smoke is None:
        raise ConfigError(f"the {name} model has no smoke entry (its ModelSpec's `smoke` is unset)",
                          where=where, key="model.name",
                          fix=f"smoke a recipe whose model has one, or give the {name} plug-in's ModelSpec a smoke "
                              "entry (models/protocol.SmokeModel)")
    try:
        entry = spec.load("smoke")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"the {name} plug-in's smoke entry {spec.smoke!r} cannot be imported: {exc}",
                          where=where, key="model.name", fix="name a \"module:attr\" that exists") from None
    missing = [attr for attr in ("sizes", "other_sizes", "config", "fixed_batch") if not hasattr(entry, attr)]
    if missing:
        raise ConfigError(f"the {name} plug-in's smoke entry lacks {', '.join(missing)} (models/protocol.SmokeModel)",
                          where=where, key="model.name", fix="give it every attribute SmokeModel names")
    if size not in entry.sizes:
        sizes = " or ".join(f"--size {s}" for s in entry.sizes)
        raise ConfigError(f"the {name} model smokes size {' or '.join(entry.sizes)}, not {size!r}: "
                          f"{entry.other_sizes}", key="--size", fix=f"use {sizes}")
    return entry


def gpu_paths(num_gpus: int) -> list[SmokePath]:
    paths = [SmokePath(f"attention {name}", attention=name) for name in
             ("sdpa_reference", "flash_varlen", "torch_varlen", "flex")]
    paths.append(SmokePath("bf16"))
    paths += [SmokePath(f"te fp8 {recipe}", precision="fp8", fp8_backend="te", fp8_recipe=recipe)
              for recipe in TE_RECIPES]
    paths.append(SmokePath("te fp8 resume + eval", precision="fp8", fp8_backend="te", fp8_recipe="delayed",
                           resume_and_evaluate=True))
    paths.append(SmokePath("torchao fp8", precision="fp8"))
    paths += [SmokePath("compile", compile=True), SmokePath("compile + cuda graphs", compile=True, cuda_graphs=True),
              SmokePath(f"fsdp2 x{max(num_gpus, 2)} gpus", ranks=max(num_gpus, 2))]
    return paths


CPU_PATHS = (
    SmokePath("cpu sdpa_reference fp32", device="cpu", attention="sdpa_reference", precision="fp32"),
    SmokePath("cpu sdpa_segments fp32", device="cpu", attention="sdpa_segments", precision="fp32"),
    SmokePath("cpu bf16", device="cpu", precision="bf16"),
    SmokePath("cpu torchao fp8", device="cpu", precision="fp8"),
    SmokePath("cpu compile (aot_eager)", device="cpu", precision="fp32", compile=True),
)


def skip_reason(path: SmokePath, *, num_gpus: int) -> str | None:
    """Why this path cannot run on this node with this install (every reason, '; '-joined); None if it can."""
    import torch

    reasons = []
    if path.device == "cuda" and num_gpus == 0:
        reasons.append("no CUDA device (torch.cuda.is_available() is False)")
    elif path.ranks > max(num_gpus, 1):
        reasons.append(f"needs {path.ranks} GPUs, this node has {num_gpus}")
    if path.attention != "auto":
        from embodyhpc.models.attention import backend_unavailable_reason

        dtype = torch.float32 if path.precision == "fp32" else torch.bfloat16
        reason = backend_unavailable_reason(path.attention, "cuda" if path.device == "cuda" else "cpu", dtype)
        if reason and not (num_gpus == 0 and "CUDA kernels only" in reason):
            reasons.append(reason)
    if path.precision == "fp8" and path.fp8_backend == "te":
        reasons.append(_te_reason(path.fp8_recipe, check_device=num_gpus > 0))
    elif path.precision == "fp8":
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            reasons.append("torchao is not installed (pip install 'embodyhpc[fp8]')")
    reasons = [reason for reason in reasons if reason]
    return "; ".join(reasons) or None


def _te_reason(recipe: str, *, check_device: bool) -> str | None:
    """Why transformer-engine cannot run `recipe` here: not installed, too old, or (on a GPU node) the GPU or CUDA
    lacks the recipe (te.is_fp8_available / is_fp8_block_scaling_available)."""
    from embodyhpc.errors import ConfigError
    from embodyhpc.models.fp8 import import_te

    try:
        te = import_te()
    except ConfigError as exc:
        return exc.message
    if not check_device:
        return None
    check = te.is_fp8_block_scaling_available if recipe == "block" else te.is_fp8_available
    available, reason = check(return_reason=True)
    return None if available else f"transformer-engine: {reason}"


def plan_rows(recipe_cfg=None) -> tuple[list[tuple[SmokePath, str | None]], str]:
    """(path, skip reason) for every row, and a description of this node's device."""
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    paths = gpu_paths(num_gpus) if num_gpus else [*CPU_PATHS, *gpu_paths(0)]
    device = torch.cuda.get_device_name(0) + f" x{num_gpus}" if num_gpus else "CPU only"
    return [(path, skip_reason(path, num_gpus=num_gpus)) for path in paths], device


def matches_recipe(path: SmokePath, recipe_cfg) -> bool:
    if recipe_cfg is None:
        return False
    model, precision, parallel = recipe_cfg.model, recipe_cfg.precision, recipe_cfg.parallelism
    same_precision = path.precision == precision.mode and (
        precision.mode != "fp8" or (path.fp8_backend, path.fp8_recipe) == (precision.fp8_backend, precision.fp8_recipe))
    return (same_precision and path.attention in ("auto", model.attention_backend) and path.ranks == 1
            and path.compile == parallel.compile and path.cuda_graphs == parallel.cuda_graphs)


def run_smoke(recipe_cfg=None, *, model: str | None = None, steps: int = 20, size: str = "tiny",
              progress=lambda row: None) -> SmokeReport:
    """Every row, each in its own process (see the module doc), training `model` (default: the recipe's model.name,
    pi05 without a recipe) at `size`; then the video decode rates, in a process of their own too."""
    model = model or (recipe_cfg.model.name if recipe_cfg is not None else "pi05")
    smoke_model(model, size)  # before any row: a model or size smoke cannot run fails once, here
    rows, device = plan_rows(recipe_cfg)
    report = SmokeReport(device=device, model=model, size=size)
    if device != "CPU only":
        report.egl = egl_line(os.environ)
    for path, reason in rows:
        row = SmokeRow(path, "skipped", reason) if reason else _run_in_process(path, steps, size, model)
        row.recipe = matches_recipe(path, recipe_cfg)
        report.rows.append(row)
        progress(row)
    from embodyhpc.data.decode_bench import run_isolated

    report.decode = run_isolated()
    return report


def egl_line(environ) -> str:
    """Which EGL device a LIBERO/MetaWorld shard on this node would render on (EGL's order is not CUDA's: the one whose
    CUDA device is the task's device 0), or why none can be chosen; a GPU node's smoke reports it."""
    from embodyhpc.errors import RunFailure, UserError
    from embodyhpc.sim.egl import render_device

    try:
        choice = render_device(environ)
    except (RunFailure, UserError, OSError) as exc:
        return f"no EGL device: {exc}"
    return "MUJOCO_EGL_DEVICE_ID or MUJOCO_GL set by the user" if choice is None else choice.describe()


def _run_in_process(path: SmokePath, steps: int, size: str, model: str = "pi05") -> SmokeRow:
    started = time.monotonic()
    spec = json.dumps({"path": asdict(path), "steps": steps, "size": size, "model": model})
    try:
        proc = subprocess.run([sys.executable, "-m", "embodyhpc.train.smoke", spec], capture_output=True, text=True,
                              timeout=ROW_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                                  "OMP_NUM_THREADS", "1")})
    except subprocess.TimeoutExpired:
        return SmokeRow(path, "failed", f"timed out after {ROW_TIMEOUT_S} s", seconds=time.monotonic() - started)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return SmokeRow(path, "failed", f"exit {proc.returncode}: {tail[:300]}", seconds=time.monotonic() - started)
    result = json.loads(lines[-1])
    row = SmokeRow(path, **{k: v for k, v in result.items() if k in SmokeRow.__dataclass_fields__ and k != "path"})
    row.seconds = time.monotonic() - started
    return row


# ---- one row, in its own process ----
def run_row(path: SmokePath, steps: int, size: str, model: str = "pi05") -> dict:
    """Train `steps` steps of `model` at `size` on this row's path; world size path.ranks (spawned ranks when > 1)."""
    if path.ranks == 1:
        return _rank_main(0, path, steps, size, model, None)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank_entry, args=(path, steps, size, model, folder), nprocs=path.ranks,
                           start_method="spawn")
        return json.loads((Path(folder) / "rank0.json").read_text())


def _rank_entry(rank: int, path: SmokePath, steps: int, size: str, model: str, folder: str) -> None:
    result = _rank_main(rank, path, steps, size, model, folder)
    if rank == 0:
        (Path(folder) / "rank0.json").write_text(json.dumps(result))


def _rank_main(rank: int, path: SmokePath, steps: int, size: str, model: str, folder: str | None) -> dict:
    import torch
    import torch.distributed as dist

    from embodyhpc.parallel.flight_recorder import set_flight_recorder_size

    device = torch.device("cuda", rank) if path.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as scratch:
        store = f"file://{folder or scratch}/rendezvous"
        set_flight_recorder_size(os.environ, torch.__version__)  # smoke jobs export the network profile too
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=store, rank=rank,
                                world_size=path.ranks)
        try:
            return _train(path, steps, size, model, device)
        finally:
            dist.barrier()
            dist.destroy_process_group()


def _train(path: SmokePath, steps: int, size: str, name: str, device) -> dict:
    import torch
    import torch.distributed as dist

    from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
    from embodyhpc.models import build_model
    from embodyhpc.models.fp8 import FP8GemmCounter
    from embodyhpc.parallel import build_mesh, materialize, parallelize
    from embodyhpc.train.loop import micro_batch_step

    entry = smoke_model(name, size)
    model_cfg = entry.config(size, path.attention)
    precision = PrecisionConfig(mode=path.precision, fp8_backend=path.fp8_backend, fp8_recipe=path.fp8_recipe)
    parallel = ParallelismConfig(compile=path.compile, cuda_graphs=path.cuda_graphs)
    backend = "aot_eager" if path.compile and device.type == "cpu" else None

    def build():
        with torch.device("meta"):
            model = build_model(model_cfg, precision)
        parallelize(model, parallel, precision, build_mesh(1, dist.get_world_size(), device.type),
                    compile_backend=backend)
        materialize(model, device, seed=0)
        return model

    with torch.device("meta"):
        built = type(build_model(model_cfg, precision)).__name__  # FSDP2 renames the class it wraps
    model = build()
    counter = FP8GemmCounter(model, device)
    batch, noise, flow_time, tokens = entry.fixed_batch(model_cfg, dist.get_rank())
    batch, noise, flow_time = batch.to(device), noise.to(device), flow_time.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    amax_group = dist.group.WORLD if dist.get_world_size() > 1 else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    with CudaGraphRecordings() as recordings:
        for step in range(steps):
            if step == WARMUP_STEPS:
                recordings.count = 0
            started = time.perf_counter()
            loss = micro_batch_step(model, batch, precision, amax_group=amax_group, noise=noise, time=flow_time)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))  # a sync: the step's time includes its GPU work
            times.append(time.perf_counter() - started)
    fp8, fell_back = counter.take()
    step_s = statistics.median(times[WARMUP_STEPS:] or times)
    first, last = losses[0], statistics.mean(losses[-3:])
    passed = last < first and all(v == v and abs(v) != float("inf") for v in losses) and fell_back == 0
    reason = None if passed else _why(first, last, fell_back)
    if path.resume_and_evaluate and passed:
        from embodyhpc.train.smoke_chain import resume_and_evaluate

        def loss_of(evaluated) -> float:
            with torch.no_grad():
                return float(evaluated(batch, noise=noise, time=flow_time).loss)

        chain = resume_and_evaluate(model, optimizer, build, model_cfg, loss_of, step=steps, device=device)
        passed, reason = chain["ok"], chain["reason"]
    return {"status": "passed" if passed else "failed", "reason": reason,
            "first_loss": first, "last_loss": last, "tokens_per_s": tokens * dist.get_world_size() / step_s,
            "peak_memory_bytes": _peak_memory(device), "fp8_gemms": fp8 / steps if counter.num_layers else None,
            "cuda_graph_rerecords": recordings.count if path.cuda_graphs and steps > WARMUP_STEPS else None,
            "model": built}


class CudaGraphRecordings:
    """Counts the CUDA graphs cudagraph trees record while the block is open (`count`, which the caller may reset).

    Every recording runs inside dynamo's `callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING,
    ...)` (torch/_inductor/cudagraph_trees.py, record_function), whose start callbacks see the trigger; a recording
    nested in a compilation (the first steps) is not seen. Private to torch: tests/train/test_smoke.py pins both."""

    def __init__(self) -> None:
        self.count = 0

    def _started(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            self.count += 1

    def __enter__(self) -> CudaGraphRecordings:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._started)
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._started)


def _why(first: float, last: float, fell_back: int) -> str:
    if fell_back:
        return f"{fell_back} GEMMs of fp8 layers ran in high precision (outside te.autocast)"
    return f"the loss did not fall ({first:.4f} -> {last:.4f})"


def _peak_memory(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS (Linux: KiB)


def format_report(report: SmokeReport) -> str:
    """The table `embodyhpc smoke` prints."""
    lines = [f"embodyhpc smoke of {report.model} {report.size} on {report.device}",
             *([f"rendering (EGL): {report.egl}"] if report.egl else []),
             f"{'path':<28} {'result':<8} {'loss first -> last':<20} {'tokens/s':>10} {'peak mem':>10} "
             f"{'fp8 GEMMs':>9}  note"]
    for row in report.rows:
        loss = f"{row.first_loss:.4f} -> {row.last_loss:.4f}" if row.first_loss is not None else "-"
        tokens = f"{row.tokens_per_s:,.0f}" if row.tokens_per_s else "-"
        memory = f"{row.peak_memory_bytes / 2**20:,.0f} MiB" if row.peak_memory_bytes else "-"
        gemms = f"{row.fp8_gemms:.0f}" if row.fp8_gemms is not None else "-"
        graphs = None if row.cuda_graph_rerecords is None else (
            f"{row.cuda_graph_rerecords} CUDA graphs recorded after warm-up"
            + (" (they re-record: no gain)" if row.cuda_graph_rerecords else ""))
        note = " ".join(part for part in (row.reason, graphs, "[the recipe's path]" if row.recipe else None) if part)
        lines.append(f"{row.path.name:<28} {row.status:<8} {loss:<20} {tokens:>10} {memory:>10} {gemms:>9}  {note}")
    ran = [row for row in report.rows if row.status != "skipped"]
    failed = [row for row in ran if row.status == "failed"]
    lines.append(f"{len(ran)} ran, {len(ran) - len(failed)} passed, {len(failed)} failed, "
                 f"{len(report.rows) - len(ran)} skipped")
    from embodyhpc.data.decode_bench import format_lines

    lines += format_lines(report.decode)
    return "\n".join(lines) + "\n"


def _main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    path = replace(SmokePath(name=""), **spec["path"])
    result = run_row(path, spec["steps"], spec["size"], spec["model"])
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
