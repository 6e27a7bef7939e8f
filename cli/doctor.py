"""`embodyhpc doctor`: the preflight against a recipe's expectations, as text or JSON."""

from __future__ import annotations

import json

from embodyhpc.config.load import LoadedRecipe


def doctor_report(loaded: LoadedRecipe | None, *, as_json: bool, suggest: bool,
                  probe_bytes: int, local: bool = False) -> tuple[str, int]:
    """Run the preflight against a recipe's expectations (or none); text and exit code."""
    from embodyhpc.hw import DoctorOptions, recipe_scope, run_doctor, suggest_network_with_reasons

    skipped: list[str] = []
    if loaded is None:
        options, network = DoctorOptions(nvme_probe_bytes=probe_bytes), None
    else:
        options, network, skipped = recipe_scope(loaded.config, local=local, nvme_probe_bytes=probe_bytes)
    report = run_doctor(options, network=network)
    out: dict = report.to_dict()
    out["not_judged"] = skipped
    lines = [report.to_text().rstrip("\n")] + [f"  -     {line}" for line in skipped]
    if suggest:
        section, reasons = suggest_network_with_reasons(report.ib_ports)
        out["suggested_network"] = {"network": section, "why": reasons}
        import yaml

        lines += ["", "# suggested site profile section:", yaml.safe_dump({"network": section}, sort_keys=False)
                  .rstrip("\n")] + [f"#   {why}" for why in reasons]
    text = json.dumps(out, indent=2, default=str) if as_json else "\n".join(lines)
    return text + "\n", report.exit_code()
