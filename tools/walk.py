"""Walk a recipe from `embodyhpc submit` to the sbatch scripts it renders, and measure how the walk moves between
our modules ("rooms").

    .venv/bin/python tools/walk.py                                  # smoke_cpu, sites local and example_ib
    .venv/bin/python tools/walk.py --recipe R --site S [--scenario dry-run|submit] [--trace] [KEY=VALUE ...]

Scenarios, each run through the real entry point (embodyhpc.cli.main.main) in this process:
    dry-run   `embodyhpc submit RECIPE --site SITE --dry-run job.runs_root=TMP ...`
    submit    `embodyhpc submit RECIPE --site SITE job.runs_root=TMP tracking.enabled=false ...` with a stand-in
              Slurm on PATH (shell scripts: sinfo answers, sbatch prints "Submitted batch job N", scancel does
              nothing). Nothing runs: the chain is handed to the stand-in's sbatch and the command returns. No real
              Slurm is started or contacted.

The metric (the same definition before and after a refactoring):
    The command runs once untraced (imports, first-use caches), then once under sys.setprofile. Every Python
    function entry ('call' event; generator resumptions included) whose frame's module (`__name__` of its
    globals) is `embodyhpc` or starts with `embodyhpc.` (our package and the CLI, `embodyhpc.cli`) is appended to
    the call sequence as its module name; everything else (the standard library, Jinja's compiled templates,
    submitit, typer) is skipped, so a call that goes through a third-party library and back into our module does
    not split a stay. Two scopes: `command` (the whole sequence, recipe loading included) and `from submit` (the
    sequence from the first call into `embodyhpc.submit`, the CLI's service layer, to the end: the walk the
    issue names).
        rooms    distinct modules in the sequence
        stays    maximal runs of consecutive entries in one module (A A B A -> 3 stays: A, B, A)
        returns  stays in a module that already had an earlier stay = stays - rooms (A B A: 1 return)
    Counts: how often each named function ran (its `__qualname__`, any of our modules), by default
    `_sbatch_context` (slurm.render: runs exactly once per rendered script, in `render_job` before the plan held
    the scripts and in `render_jobs` after), `render_job` (the renderer's entry before), `job_shape` and the
    chain's derivation `chain_kinds`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import stat
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

OURS = "embodyhpc"
SERVICE = "embodyhpc.submit"
COUNTED = ("_sbatch_context", "render_job", "job_shape", "chain_kinds")

FAKE_SLURM = {
    "sinfo": "#!/bin/sh\necho debug\n",
    "srun": "#!/bin/sh\nexit 0\n",
    "scancel": "#!/bin/sh\nexit 0\n",
    # submitit reads the job id from this line; a counter file gives each job its own id
    "sbatch": '#!/bin/sh\nf="$(dirname "$0")/next-id"\nn=$(cat "$f" 2>/dev/null || echo 100)\n'
              'echo $((n + 1)) > "$f"\necho "Submitted batch job $n"\n',
}


@dataclass
class Walk:
    modules: list[str] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)

    def stays(self) -> list[str]:
        out: list[str] = []
        for module in self.modules:
            if not out or out[-1] != module:
                out.append(module)
        return out

    def summary(self) -> dict[str, int]:
        stays = self.stays()
        rooms = len(set(stays))
        return {"rooms": rooms, "stays": len(stays), "returns": len(stays) - rooms}


def ours(module: object) -> bool:
    return isinstance(module, str) and (module == OURS or module.startswith(OURS + "."))


def traced(fn) -> Walk:
    """Run fn() under sys.setprofile, recording every entry into one of our functions."""
    walk = Walk()

    def profile(frame, event, arg):  # noqa: ARG001 - the profiler's signature
        if event != "call":
            return
        module = frame.f_globals.get("__name__")
        if ours(module):
            walk.modules.append(module)
            walk.calls[frame.f_code.co_qualname] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return walk


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    from embodyhpc.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = ["embodyhpc", *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def fake_slurm(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FAKE_SLURM.items():
        path = folder / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{folder}{os.pathsep}{saved}"
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def scope(walk: Walk, start: str | None) -> Walk:
    """The walk from the first entry into `start` (the whole walk when None or never entered)."""
    if start is None or start not in walk.modules:
        return walk
    return Walk(walk.modules[walk.modules.index(start):], walk.calls)


def measure(recipe: str, site: str, scenario: str, overrides: list[str], tmp: Path) -> Walk:
    argv = ["submit", recipe, "--site", site, f"job.runs_root={tmp / 'runs'}", *overrides]
    if scenario == "dry-run":
        argv.insert(2, "--dry-run")
    else:
        argv.append("tracking.enabled=false")

    def once() -> None:
        code, out, err = run_cli(argv)
        if code != 0:
            raise SystemExit(f"walk: `embodyhpc {' '.join(argv)}` failed ({code}): {(err or out).strip()[-400:]}")

    with fake_slurm(tmp / "bin") if scenario == "submit" else contextlib.nullcontext():
        once()  # imports and first-use caches out of the way
        return traced(once)


def report(label: str, walk: Walk, trace: bool) -> list[str]:
    lines = []
    for name, start in (("command", None), ("from submit", SERVICE)):
        part = scope(walk, start)
        s = part.summary()
        lines.append(f"{label} [{name}]: rooms {s['rooms']}, stays {s['stays']}, returns {s['returns']}")
        if trace and start is not None:
            lines += [f"    {i:3d} {module}" for i, module in enumerate(part.stays(), 1)]
    counted = ", ".join(f"{name} x{walk.calls.get(name, 0)}" for name in COUNTED)
    lines.append(f"{label} calls: {counted}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="smoke_cpu")
    parser.add_argument("--site", action="append", help="site profile(s) (default: local and example_ib)")
    parser.add_argument("--scenario", action="append", choices=["dry-run", "submit"],
                        help="default: both")
    parser.add_argument("--trace", action="store_true", help="list the stays of the `from submit` scope")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for site in args.site or ["local", "example_ib"]:
        extra = ["site.account=walk"] if site != "local" else []
        for scenario in args.scenario or ["dry-run", "submit"]:
            with tempfile.TemporaryDirectory(prefix="walk-") as tmp:
                walk = measure(args.recipe, site, scenario, [*extra, *args.overrides], Path(tmp))
            print("\n".join(report(f"{args.recipe}@{site} {scenario}", walk, args.trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
