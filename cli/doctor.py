"""`embodyhpc doctor`: the preflight against a recipe's expectations, as text or JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping

from embodyhpc.config.load import LoadedRecipe


def compute_node(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs on a Slurm compute node: inside a job, where slurmd sets its node's name."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURMD_NODENAME") or env.get("SLURM_JOB_ID"))


def login_node(environ: Mapping[str, str] | None = None) -> bool:
    """A machine that submits to Slurm (sbatch here) outside any job: a login node, whose jobs run elsewhere."""
    return not compute_node(environ) and shutil.which("sbatch") is not None


def slurm_reason(why: str) -> str:
    """sinfo's several `sinfo: error: ...` lines for one cause, as one: the last (where it gave up), unprefixed."""
    lines = [line.strip() for line in why.splitlines() if line.strip()]
    said = [line.split(":", 2)[-1].strip() for line in lines if line.startswith(("sinfo: error:", "sinfo: fatal:"))]
    text = said[-1] if said else (lines[-1] if lines else why)
    return " ".join(text.split())[:160]


def doctor_report(loaded: LoadedRecipe | None, *, as_json: bool, suggest: bool, probe_bytes: int,
                  local: bool = False, login: bool = False, environ: Mapping[str, str] | None = None
                  ) -> tuple[str, int]:
    """Run the preflight against a recipe's expectations (or none); text and exit code. `login`: this machine
    submits to Slurm and is no compute node, so what only a compute node must have (the job's GPUs, its NVMe
    folder) is not judged here, in one line saying so; a failure on a machine that is no compute node never says
    to exclude it (sbatch --exclude names compute nodes)."""
    from embodyhpc.hw import DoctorOptions, recipe_scope, run_doctor, suggest_network_with_reasons

    skipped: list[str] = []
    if loaded is None:
        options, network = DoctorOptions(nvme_probe_bytes=probe_bytes), None
    else:
        options, network, skipped = recipe_scope(loaded.config, local=local, nvme_probe_bytes=probe_bytes)
        parts = [name for name, used in (("gpus", options.judge_gpus), ("nvme", options.nvme_path)) if used]
        if login and parts:
            options = dataclasses.replace(options, judge_gpus=False, nvme_path=None)
            skipped = [line for line in skipped if line.split(":")[0] not in parts]
            skipped.insert(0, f"{', '.join(parts)}: not judged, this is a login node (outside a Slurm job) and the "
                              "job runs on compute nodes; each job's preflight judges its own, or run `srun "
                              "embodyhpc doctor RECIPE`")
    report = run_doctor(options, network=network, environ=environ)
    out: dict = report.to_dict()
    out["not_judged"] = skipped
    text = report.to_text().rstrip("\n")
    if report.failed and not compute_node(environ):  # the last line is the verdict
        out["exclude"] = None
        failed = ", ".join(c.name for c in report.failed)
        verdict = (f"{report.hostname} is no compute node (nothing to exclude): fix what failed before submitting: "
                   f"{failed}" if login else f"this machine ({report.hostname}) cannot run the job; failed: {failed}")
        text = "\n".join(text.splitlines()[:-1] + [verdict])
    lines = [text] + [f"  -     {line}" for line in skipped]
    if suggest:
        section, reasons = suggest_network_with_reasons(report.ib_ports)
        out["suggested_network"] = {"network": section, "why": reasons}
        import yaml

        lines += ["", "# suggested site profile section:", yaml.safe_dump({"network": section}, sort_keys=False)
                  .rstrip("\n")] + [f"#   {why}" for why in reasons]
    text = json.dumps(out, indent=2, default=str) if as_json else "\n".join(lines)
    return text + "\n", report.exit_code()
