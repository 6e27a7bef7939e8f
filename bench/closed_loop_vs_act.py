"""Closed-loop success per training CPU-minute: our demo recipe (tiny pi0.5) vs LeRobot ACT, same demos, same episodes.

    python bench/closed_loop_vs_act.py                                   # ours only (the baseline is skipped)
    python bench/closed_loop_vs_act.py --lerobot-venv /tmp/lerobot-venv  # ours vs ACT from lerobot 0.4.4
    python bench/closed_loop_vs_act.py --build-lerobot-venv /tmp/lerobot-venv   # create it first (~8 GB, minutes)
    python bench/closed_loop_vs_act.py --lerobot-venv V --tasks reach-v3 --act-steps 3000 --workdir /tmp/clbench

1. Demonstrations, once: `embodyhpc data synth --out W/demos --tasks ... --episodes N --image-size 32 --workers 2`
   (MetaWorld v3 scripted experts, seed 0, a LeRobot v3.0 dataset). Both sides train on exactly this folder.
2. Ours: `embodyhpc submit recipes/demo_metaworld_cpu.yaml --local data.root=W/demos train.steps=S
   eval.enabled=false` (tiny pi0.5, 2 processes, FSDP2 over gloo; the chain's report job runs too), then
   `embodyhpc eval --ckpt RUN --local` with the evaluation overrides below: the evaluation array of the recipe.
3. LeRobot: `lerobot-train --policy.type=act --policy.device=cpu` on the same folder (LeRobot's ACT defaults:
   batch 8, chunk 100, lr 1e-5, AdamW, dim 512, 4+1 layers, VAE; no wandb, no hub), then the checkpoint is
   rolled out by bench/closed_loop_act_side.py inside the LeRobot venv through OUR `make_suite` + `run_shard`
   (imported from this checkout), so both sides get the same (task, seed, episode) -> initial state, step limit
   and success flag. The bench also fingerprints every evaluation episode (state at reset and after 10 expert
   steps) in both venvs and prints whether they agree.
   ACT's inputs: observation.state + observation.environment_state (the 39-d sim state our recipe also feeds
   pi0.5). `--act-camera` adds the 32 px camera (ResNet-18 from scratch: torchvision's ImageNet weights cannot
   be downloaded here). Our pi0.5 also sees the camera and the instruction.

Evaluation (both sides): the tasks of the demos, held-out goals (seed 100; the demos use seed 0),
--eval-episodes per task, at most --max-steps steps (the recipe's 200), ending at the first success; no videos.
Success rates come with Wilson 95% intervals (embodyhpc.eval.aggregate, the report's own code).

Training cost = CPU time (user + system) of every process of the training command, start to exit (imports,
data loading workers, checkpoint saving included): getrusage(RUSAGE_CHILDREN) around the command, the same
measure for both sides (CPU time, not wall time: the cores are shared). Success per CPU-minute = overall success
rate / training CPU-minutes. Goal: ours >= 1.5x ACT. Evaluation CPU is printed too (not in the ratio).

Default run on 2 cores: about 50 min with the LeRobot venv (demos 1 min; ours 3-6 min training + 3 min
evaluation; ACT 30-45 min training at 1.2-1.7 s/step, ~70 CPU-min, + 1 min evaluation); about 10 min without it.
Measured on shared cores: 53 min. --workdir keeps the dataset, runs, checkpoints and logs.
The bench reports; it always exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from closed_loop_act_side import episode_digests  # noqa: E402
from lerobot_venv import build_lerobot_venv, offline_env  # noqa: E402

from embodyhpc.eval.aggregate import Report, Stats, aggregate, format_table, load_records  # noqa: E402
from embodyhpc.eval.shards import Episode, all_episodes, plan_shards  # noqa: E402

GOAL_RATIO = 1.5
RECIPE = REPO / "recipes" / "demo_metaworld_cpu.yaml"
DEFAULT_TASKS = "reach-v3,button-press-topdown-v3,drawer-open-v3,door-open-v3"  # the recipe's (make demo's)
SIM_PACKAGES = ("metaworld", "mujoco")  # pinned in the LeRobot venv to the project venv's versions
ACT_EVAL_PROCESSES = 2  # like the recipe's eval.array_parallelism


@dataclasses.dataclass
class Timed:
    rc: int
    wall_s: float
    cpu_s: float
    stdout: str


def run_timed(cmd: list[str], *, log: Path, env: dict[str, str] | None = None, capture: bool = False) -> Timed:
    """Run cmd to completion; CPU = user + system time of it and all its waited-for descendants."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if capture else err, stderr=err, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(proc.returncode, wall, cpu, proc.stdout or "")


def failed(what: str, timed: Timed, log: Path) -> str:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.is_file() else ""
    return f"{what} failed (exit {timed.rc}); last lines of {log}:\n{tail}"


def run_dir_from_json(stdout: str) -> Path:
    """The run directory from `embodyhpc submit|eval --json` (a JSON object on stdout)."""
    start = stdout.find("{")
    if start < 0:
        raise RuntimeError(f"no JSON on stdout: {stdout[-500:]!r}")
    return Path(json.loads(stdout[start:])["run_dir"])


def fmt_rate(stats: Stats) -> str:
    return f"{stats.success_rate:.2f} [{stats.ci_low:.2f}, {stats.ci_high:.2f}]"


# ---- demonstrations ----

def make_demos(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    if args.data:
        return args.data.resolve(), f"given: {args.data}"
    out = work / "demos"
    cmd = [str(REPO / ".venv" / "bin" / "embodyhpc"), "data", "synth", "--out", str(out), "--tasks", args.tasks,
           "--episodes", str(args.demo_episodes), "--image-size", "32", "--workers", "2"]
    timed = run_timed(cmd, log=work / "synth.log")
    if timed.rc:
        raise RuntimeError(failed("embodyhpc data synth", timed, work / "synth.log"))
    info = json.loads((out / "meta" / "info.json").read_text())
    return out, (f"{info['total_episodes']} episodes, {info['total_frames']} frames at {info['fps']} fps "
                 f"({timed.wall_s:.0f} s, {timed.cpu_s / 60:.1f} CPU-min)")


# ---- ours ----

def eval_overrides(args: argparse.Namespace) -> list[str]:
    import yaml

    overrides = [f"eval.tasks=[{args.tasks}]", f"eval.seeds=[{args.eval_seed}]",
                 f"eval.episodes_per_task={args.eval_episodes}", f"eval.max_steps={args.max_steps}",
                 "eval.reference_policies=[]", "eval.videos_per_task=0"]
    episodes = len(args.tasks.split(",")) * args.eval_episodes
    if episodes < yaml.safe_load(RECIPE.read_text())["eval"]["shards"]:  # a shard may not be empty
        overrides.append(f"eval.shards={episodes}")
    return overrides


def run_ours(args: argparse.Namespace, work: Path, demos: Path) -> dict[str, Any]:
    cli = str(REPO / ".venv" / "bin" / "embodyhpc")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    runs = work / "runs"
    overrides = [f"job.runs_root={runs}", f"data.root={demos}", "eval.enabled=false"]
    if args.ours_steps:
        overrides.append(f"train.steps={args.ours_steps}")
    log = work / "ours_train.log"
    train = run_timed([cli, "submit", str(RECIPE), "--local", "--json", *overrides], log=log, env=env, capture=True)
    if train.rc:
        raise RuntimeError(failed("embodyhpc submit (training)", train, log))
    run = run_dir_from_json(train.stdout)
    job = json.loads((run / "run.json").read_text())["jobs"]["train"]
    if job["state"] != "COMPLETED":
        raise RuntimeError(f"our training ended {job['state']} ({job.get('reason')}); see {run}/submitit and {log}")
    result = json.loads((run / "logs" / "train_result.json").read_text())
    print(f"# ours trained: {result['steps']} steps in {train.wall_s:.0f} s wall, {train.cpu_s:.0f} CPU-s; "
          f"final loss {result['last_metrics'].get('loss', float('nan')):.4f}", flush=True)

    log = work / "ours_eval.log"
    ev = run_timed([cli, "eval", "--ckpt", str(run), "--local", "--json", f"job.runs_root={runs}",
                    *eval_overrides(args)], log=log, env=env, capture=True)
    if ev.rc:
        raise RuntimeError(failed("embodyhpc eval", ev, log))
    eval_run = run_dir_from_json(ev.stdout)
    report = json.loads((eval_run / "eval" / "report.json").read_text())
    if report["outcome"] != "complete":
        raise RuntimeError(f"our evaluation is {report['outcome']}: {report['why']} ({eval_run})")
    records = load_records(sorted((eval_run / "eval" / "shards" / "trained").glob("shard-*.jsonl")))
    return {"steps": result["steps"], "train": train, "eval": ev, "run": run, "eval_run": eval_run,
            "report_overall": report["results"]["policies"]["trained"]["overall"],
            "records": [{**r, "policy": "ours"} for r in records]}


# ---- LeRobot ACT ----

def act_inputs(demos: Path, camera: bool) -> tuple[dict[str, dict[str, Any]], list[str], int]:
    """ACT's input_features (from the dataset's info.json), the cameras the rollout renders, the image size."""
    features = json.loads((demos / "meta" / "info.json").read_text())["features"]
    inputs = {"observation.state": {"type": "STATE", "shape": features["observation.state"]["shape"]},
              "observation.environment_state": {"type": "ENV",
                                                "shape": features["observation.environment_state"]["shape"]}}
    cameras, size = [], 32
    if camera:
        for key, feature in features.items():
            if feature.get("dtype") == "video":
                height, width, channels = feature["shape"]
                inputs[key] = {"type": "VISUAL", "shape": [channels, height, width]}
                cameras.append(key.removeprefix("observation.images."))
                size = height
    return inputs, cameras, size


def run_act(args: argparse.Namespace, work: Path, demos: Path, episodes: list[Episode]) -> dict[str, Any]:
    venv = args.lerobot_venv.resolve()
    env = offline_env(work / "hf_home")
    inputs, cameras, size = act_inputs(demos, args.act_camera)
    out = work / "act"
    cmd = [str(venv / "bin" / "lerobot-train"), f"--dataset.repo_id=local/{demos.name}", f"--dataset.root={demos}",
           "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false", "--wandb.enable=false",
           f"--output_dir={out}", f"--steps={args.act_steps}", f"--batch_size={args.act_batch_size}",
           f"--save_freq={args.act_steps}", "--log_freq=100", f"--policy.input_features={json.dumps(inputs)}"]
    if args.act_camera:
        cmd.append("--policy.pretrained_backbone_weights=null")
    log = work / "act_train.log"
    train = run_timed(cmd, log=log, env=env)
    checkpoint = out / "checkpoints" / "last" / "pretrained_model"
    if train.rc or not checkpoint.is_dir():
        raise RuntimeError(failed("lerobot-train", train, log))
    steps = json.loads((out / "checkpoints" / "last" / "training_state" / "training_step.json").read_text())["step"]
    losses = [line.split("loss:")[1].split()[0] for line in log.read_text(errors="replace").splitlines()
              if " loss:" in line]
    print(f"# ACT trained: {steps} steps in {train.wall_s:.0f} s wall, {train.cpu_s:.0f} CPU-s; "
          f"last logged loss {losses[-1] if losses else 'n/a'}", flush=True)

    # the evaluation: ACT_EVAL_PROCESSES shard processes (one thread each) in parallel, like our eval array
    side = str(BENCH / "closed_loop_act_side.py")
    print(f"$ {venv}/bin/python {side} eval act_eval_<i>.json   # {ACT_EVAL_PROCESSES} shards in parallel",
          flush=True)
    procs, logs, shard_files = [], [], []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    for i, shard in enumerate(plan_shards(args.tasks.split(","), [args.eval_seed], args.eval_episodes,
                                          ACT_EVAL_PROCESSES)):
        config = work / f"act_eval_{i}.json"
        shard_files.append(work / f"act_eval_{i}.jsonl")
        config.write_text(json.dumps({"checkpoint": str(checkpoint), "out": str(shard_files[-1]),
                                      "episodes": [dataclasses.astuple(e) for e in shard],
                                      "max_steps": args.max_steps, "n_action_steps": args.act_n_action_steps,
                                      "cameras": cameras, "image_size": size, "threads": 1}))
        logs.append(work / f"act_eval_{i}.log")
        with open(logs[-1], "w") as err:
            procs.append(subprocess.Popen([str(venv / "bin" / "python"), side, "eval", str(config)], env=env,
                                          stdout=subprocess.PIPE, stderr=err, text=True))
    summaries = [json.loads(p.communicate()[0].strip().splitlines()[-1]) if p.wait() == 0 else None for p in procs]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    eval_timed = Timed(0, time.perf_counter() - start,
                       (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "")
    for proc, summary, shard_log in zip(procs, summaries, logs, strict=True):
        if summary is None:
            raise RuntimeError(failed("ACT evaluation shard", Timed(proc.returncode, 0, 0, ""), shard_log))

    # the same episodes on both sides? fingerprints from the LeRobot venv vs from this one
    config = work / "digests.json"
    config.write_text(json.dumps({"episodes": [dataclasses.astuple(e) for e in episodes],
                                  "out": str(work / "digests_lerobot.json")}))
    log = work / "digests.log"
    digest_run = run_timed([str(venv / "bin" / "python"), side, "digests", str(config)], log=log, env=env)
    if digest_run.rc:
        raise RuntimeError(failed("episode fingerprints in the LeRobot venv", digest_run, log))
    theirs = json.loads((work / "digests_lerobot.json").read_text())
    ours = episode_digests(episodes)
    differ = sorted(k for k in ours if theirs.get(k) != ours[k])
    packages = json.dumps(["lerobot", "torch", *SIM_PACKAGES])
    versions = subprocess.run([str(venv / "bin" / "python"), "-c", "import json, importlib.metadata as m; "
                               f"print(json.dumps({{p: m.version(p) for p in {packages}}}))"],
                              capture_output=True, text=True).stdout.strip()
    return {"steps": steps, "train": train, "eval": eval_timed, "checkpoint": checkpoint,
            "records": load_records(shard_files), "summary": summaries[0], "digests_differ": differ,
            "versions": json.loads(versions) if versions else {}}


# ---- the table ----

def print_table(ours: dict[str, Any], act: dict[str, Any] | None, report: Report, act_note: str) -> None:
    rows = [("ours: pi0.5 tiny, demo recipe", ours, report.policies["ours"].overall)]
    if act is not None:
        rows.append(("LeRobot 0.4.4 ACT" + act_note, act, report.policies["act"].overall))
    print(f"{'side':<40} {'steps':>6} {'train CPU-min':>13} {'success [Wilson 95%]':>21} {'succ/CPU-min':>12} "
          f"{'x ACT':>7}  goal")
    act_per_min = None
    if act is not None:
        act_stats = report.policies["act"].overall
        act_per_min = act_stats.success_rate / (act["train"].cpu_s / 60)
    for name, side, stats in rows:
        per_min = stats.success_rate / (side["train"].cpu_s / 60)
        if act_per_min is None:
            ratio, goal = "n/a", f">= {GOAL_RATIO:g}x ACT: n/a (baseline skipped)"
        elif side is act:
            ratio, goal = "1.00x", "(baseline)"
        elif act_per_min == 0:
            ratio, goal = (("inf", f">= {GOAL_RATIO:g}x ACT: ok (ACT had no success)") if per_min > 0
                           else ("n/a", f">= {GOAL_RATIO:g}x ACT: n/a (neither side had a success)"))
        else:
            value = per_min / act_per_min
            ratio, goal = f"{value:.2f}x", f">= {GOAL_RATIO:g}x ACT: {'ok' if value >= GOAL_RATIO else 'BELOW'}"
        print(f"{name:<40} {side['steps']:>6} {side['train'].cpu_s / 60:>13.1f} {fmt_rate(stats):>21} "
              f"{per_min:>12.4f} {ratio:>7}  {goal}")
    if act is not None and act_per_min:
        ours_stats, act_stats = report.policies["ours"].overall, report.policies["act"].overall
        low = (ours_stats.ci_low / (ours["train"].cpu_s / 60)) / (act_stats.ci_high / (act["train"].cpu_s / 60))
        high = (ours_stats.ci_high / (ours["train"].cpu_s / 60)) / max(act_stats.ci_low / (act["train"].cpu_s / 60),
                                                                        1e-12)
        print(f"# ratio with the success intervals' ends (ours low / ACT high .. ours high / ACT low): "
              f"{low:.2f}x .. {'inf' if act_stats.ci_low == 0 else f'{high:.2f}x'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"MetaWorld v3 tasks (default {DEFAULT_TASKS})")
    parser.add_argument("--demo-episodes", type=int, default=25, help="expert episodes per task (default 25)")
    parser.add_argument("--data", type=Path, help="use this `embodyhpc data synth` dataset of --tasks instead")
    parser.add_argument("--eval-episodes", type=int, default=20, help="evaluation episodes per task (default 20)")
    parser.add_argument("--eval-seed", type=int, default=100, help="held-out goals (default 100; demos use 0)")
    parser.add_argument("--max-steps", type=int, default=200, help="episode step limit (default 200, the recipe's)")
    parser.add_argument("--ours-steps", type=int, default=0, help="our training steps (default: the recipe's 600)")
    parser.add_argument("--act-steps", type=int, default=1500, help="ACT training steps (default 1500)")
    parser.add_argument("--act-batch-size", type=int, default=8, help="ACT batch size (default 8, LeRobot's)")
    parser.add_argument("--act-n-action-steps", type=int, default=None,
                        help="ACT actions executed per chunk at evaluation (default: LeRobot's 100 = the chunk)")
    parser.add_argument("--act-camera", action="store_true",
                        help="ACT also sees the camera (ResNet-18 from scratch); default: state inputs only")
    parser.add_argument("--workdir", type=Path, help="keep every output here (default: a temp dir, removed)")
    parser.add_argument("--lerobot-venv", type=Path, help="venv with lerobot==0.4.4 and metaworld: run the baseline")
    parser.add_argument("--build-lerobot-venv", type=Path, metavar="PATH",
                        help="create PATH with lerobot==0.4.4 (CUDA torch, ~8 GB) + metaworld/mujoco pinned to "
                             "this venv's versions, then use it as --lerobot-venv")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.build_lerobot_venv:
        try:
            build_lerobot_venv(args.build_lerobot_venv, [f"{p}=={metadata.version(p)}" for p in SIM_PACKAGES])
            args.lerobot_venv = args.build_lerobot_venv
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"# building the LeRobot venv failed ({exc}); the baseline is skipped")
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        work = args.workdir.resolve()
    else:
        work = Path(tempfile.mkdtemp(prefix="bench-closed-loop-"))
    try:
        bench(args, work)
    except Exception as exc:  # noqa: BLE001 - a bench reports what failed and exits 0
        print(f"# bench failed: {type(exc).__name__}: {exc}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def bench(args: argparse.Namespace, work: Path) -> None:
    tasks = args.tasks.split(",")
    episodes = all_episodes(tasks, [args.eval_seed], args.eval_episodes)
    print(f"# work dir {work}; tasks {args.tasks}; evaluation: {len(episodes)} episodes (seed {args.eval_seed}, "
          f"{args.eval_episodes} per task, <= {args.max_steps} steps)", flush=True)
    demos, about = make_demos(args, work)
    print(f"# demonstrations: {demos}: {about}", flush=True)
    ours = run_ours(args, work, demos)
    act, act_error = None, None
    if args.lerobot_venv:
        try:
            act = run_act(args, work, demos, episodes)
        except Exception as exc:  # noqa: BLE001 - ours is still reported
            act_error = f"{type(exc).__name__}: {exc}"
    records = ours["records"] + (act["records"] if act else [])
    report = aggregate(records, episodes, policies=["ours", "act"] if act else ["ours"])

    print()
    print(f"# ours: {RECIPE.relative_to(REPO)}, {ours['steps']} steps, train {ours['train'].wall_s:.0f} s wall / "
          f"{ours['train'].cpu_s / 60:.1f} CPU-min; eval {ours['eval'].wall_s:.0f} s wall / "
          f"{ours['eval'].cpu_s / 60:.1f} CPU-min ({ours['eval_run']})")
    theirs = ours["report_overall"]
    mine = report.policies["ours"].overall
    if (theirs["successes"], theirs["recorded"]) != (mine.successes, mine.recorded):
        print(f"# WARNING: our report.json says {theirs['successes']}/{theirs['recorded']}, the bench counts "
              f"{mine.successes}/{mine.recorded}")
    act_note = ""
    if act is not None:
        summary = act["summary"]
        inputs = ", ".join(k.removeprefix("observation.") for k in summary["inputs"])
        act_note = " (state + camera)" if any("images" in k for k in summary["inputs"]) else " (state only)"
        print(f"# ACT: inputs {inputs}; chunk {summary['chunk_size']}, {summary['n_action_steps']} actions executed "
              f"per chunk; batch {args.act_batch_size}; train {act['train'].wall_s:.0f} s wall / "
              f"{act['train'].cpu_s / 60:.1f} CPU-min; eval {act['eval'].wall_s:.0f} s wall / "
              f"{act['eval'].cpu_s / 60:.1f} CPU-min; LeRobot venv {act['versions']}")
        ours_versions = {p: metadata.version(p) for p in SIM_PACKAGES}
        same = "identical" if not act["digests_differ"] else f"DIFFERENT in {len(act['digests_differ'])}"
        print(f"# evaluation episodes in both venvs (state at reset + 10 expert steps): {same} "
              f"({len(episodes)} episodes; project venv {ours_versions})")
    print(format_table(report))
    print()
    print_table(ours, act, report, act_note)
    if act is None:
        if act_error:
            print(f"# LeRobot baseline failed: {act_error}")
        else:
            print("# baseline skipped: no LeRobot venv. Run with --lerobot-venv PATH (lerobot==0.4.4, metaworld and "
                  "mujoco as in this venv), or --build-lerobot-venv PATH to create one (~8 GB, a few minutes).")


if __name__ == "__main__":
    sys.exit(main())
