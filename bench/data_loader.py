"""Loader samples/s on a LeRobot v3.0 dataset with the training access pattern: ours vs LeRobot's LeRobotDataset.

    python bench/data_loader.py                                   # baseline: our own PyAV decoder path
    python bench/data_loader.py --lerobot-venv /tmp/lerobot-venv  # baseline: lerobot 0.4.4 in that venv
    python bench/data_loader.py --build-lerobot-venv /tmp/lerobot-venv   # create it first (~8 GB, minutes)
    python bench/data_loader.py --data /path/to/lerobot_v3_dataset --samples 2000

Access pattern (what a pi0.5 / ACT recipe asks of the loader): every camera with a 2-frame history
(delta_timestamps [-1/fps, 0]), a 50-step action chunk ([0, 1/fps, ..., 49/fps]), step-level random sampling
(our StepSampler's order, seed 0; LeRobot gets the same index list), DataLoader with 2 workers, batch 32.
samples/s counts the samples of every batch after the first `--warmup-batches` (worker start-up excluded).

Dataset: generated into a temp dir with our LeRobotWriter (2 cameras 96x96, 6 episodes x 150 frames, 20 fps,
GOP 2) once per codec in --codecs. AV1 is LeRobot's default codec (what users bring); h264 is our writer's
default. Or pass --data (cameras, fps and codec as found there).
--h264-tune fastdecode writes the h264 dataset with libx264's fastdecode tune (about half the decode CPU, files about
17 % larger): both loaders read those files, and its rows say h264/fastdecode, apart from the goal's plain h264 rows.

lerobot 0.4.4 pulls a CUDA torch (8.3 GB venv), so it is never used unless asked: --lerobot-venv runs the same
access pattern with LeRobotDataset (its default video backend) inside that venv, in a subprocess. Without it
the baseline is our own reader on the PyAV decoder (the output says so); the 3x goal is against LeRobot.
Goals against LeRobot in the same run: ours >= 5x with uint8 frames (data.image_dtype=uint8: workers ship the
decoded bytes), >= 3.5x with LeRobot-equal float32 items. Our reader decodes every frame a batch needs from one
video file in one call (its __getitems__, which a plain DataLoader uses). Both loaders fill the cores, so the
ratio is a CPU ratio: "CPU ms/sample" is the CPU time of the loading process and its workers over the timed window
(/proc, user + system) per sample. The bench reports; it always exits 0.

--gop-window W adds a row: ours with uint8 frames in the order data.gop_window_batches=W gives (windows of W
batches regrouped by video file and frame, data/gop_order.py). Every loader then reads the same samples: a pass is
whole windows (the samples per pass are rounded to them), whose samples the regrouping does not change; LeRobot
reads them in the plain order. How much the regrouping saves grows with the share of the dataset a window holds
(here W x batch of the --episodes x --frames frames): on a dataset far larger than a window it finds few neighbours.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from lerobot_venv import build_lerobot_venv, offline_env

GOAL_RATIO = {"uint8": 5.0, "float32": 3.5}
CAMERAS = ("observation.images.front", "observation.images.wrist")
STATE_DIM, ACTION_DIM = 8, 7
TASKS = ("pick up the red block", "open the top drawer", "push the puck to the goal")

# Runs inside the LeRobot venv: the same indices, batch size, workers and delta timestamps as our loader. It
# stays up and runs one timed pass per "pass" line on stdin, so its passes interleave with ours (the cores are
# shared: drift then hits every loader alike) and its start-up (imports, HF datasets) is not timed.
CPU_SECONDS = r'''
def cpu_seconds(pids):
    """user + system CPU seconds of these processes (all their threads), from /proc/PID/stat."""
    import os
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
'''
exec(CPU_SECONDS)  # defines cpu_seconds here too: the same measure on both sides
cpu_seconds = globals()["cpu_seconds"]

LEROBOT_SCRIPT = CPU_SECONDS + r'''
import json, os, sys, time
import torch
from torch.utils.data import DataLoader
from lerobot.datasets.lerobot_dataset import LeRobotDataset
import lerobot

cfg = json.load(open(sys.argv[1]))
dataset = LeRobotDataset("local/bench", root=cfg["root"], delta_timestamps=cfg["delta_timestamps"])
print(json.dumps({"backend": dataset.video_backend, "lerobot": lerobot.__version__, "torch": torch.__version__}),
      flush=True)
for command in sys.stdin:
    if command.strip() == "pass":
        # No item is read in this process before the workers fork: LeRobot caches torchcodec decoders per
        # process, and one opened here breaks in forked workers ("Could not push packet to decoder", lerobot 0.4.4).
        loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=cfg["indices"],
                            num_workers=cfg["num_workers"])
        batches = iter(loader)
        for _ in range(cfg["warmup_batches"]):
            next(batches)
        pids = [os.getpid(), *(w.pid for w in batches._workers)]
        start, cpu_start, num_samples = time.perf_counter(), cpu_seconds(pids), 0
        for batch in batches:
            num_samples += len(batch["index"])
            cpu_end = cpu_seconds(pids)  # after each batch: the workers are gone once the pass ends
        rate = num_samples / (time.perf_counter() - start)
        print(json.dumps({"rate": rate, "cpu_ms": 1000 * (cpu_end - cpu_start) / num_samples}), flush=True)
    elif command.strip() == "shapes":
        item = dataset[cfg["indices"][0]]
        print(json.dumps({"shapes": {k: list(v.shape) for k, v in item.items() if hasattr(v, "shape")}}),
              flush=True)
'''


def make_frames(num_frames: int, size: int, seed: int) -> np.ndarray:
    """uint8 (T, H, W, 3): a textured gradient with a moving block, deterministic from seed (not trivially
    compressible, like a robot camera, unlike a flat colour)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / (size - 1)
    texture = rng.integers(-12, 13, size=(size, size, 3))
    t = np.arange(num_frames)[:, None, None] / max(num_frames - 1, 1)
    base = np.stack([40 + 120 * x + 60 * t, 50 + 100 * y + 30 * np.sin(6 * t), 180 - 90 * x * y - 50 * t], -1)
    frames = base + texture
    cx = (0.2 + 0.6 * t[:, 0, 0]) * size
    cy = (0.5 + 0.3 * np.sin(2 * np.pi * t[:, 0, 0])) * size
    inside = (np.abs(x[None] * size - cx[:, None, None]) < size / 8) & (np.abs(y[None] * size - cy[:, None, None])
                                                                      < size / 8)
    frames[inside] = (230, 40, 40)
    return np.clip(np.round(frames), 0, 255).astype(np.uint8)


def write_dataset(root: Path, codec: str, *, num_episodes: int, num_frames: int, size: int, fps: int,
                  tune: str | None = None) -> float:
    """Write the synthetic dataset with our LeRobotWriter (`tune`: libx264's --tune for h264); returns seconds taken."""
    from embodyhpc.data.video_encode import VideoOptions
    from embodyhpc.data.writer import LeRobotWriter

    features = {**{cam: {"dtype": "video", "shape": [size, size, 3]} for cam in CAMERAS},
                "observation.state": {"dtype": "float32", "shape": [STATE_DIM]},
                "action": {"dtype": "float32", "shape": [ACTION_DIM]}}
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with LeRobotWriter(root, fps=fps, features=features, video=VideoOptions(codec=codec, tune=tune)) as writer:
        for e in range(num_episodes):
            writer.add_episode({**{cam: make_frames(num_frames, size, seed=2 * e + c) for c, cam in enumerate(CAMERAS)},
                                "observation.state": rng.normal(size=(num_frames, STATE_DIM)).astype(np.float32),
                                "action": rng.normal(size=(num_frames, ACTION_DIM)).astype(np.float32)},
                               task=TASKS[e % len(TASKS)])
    return time.perf_counter() - start


def access_pattern(root: Path, horizon: int) -> tuple[dict[str, list[float]], list[str], int]:
    """(delta_timestamps, camera keys, fps) of the training access pattern for the dataset at root."""
    info = json.loads((root / "meta" / "info.json").read_text())
    fps = int(info["fps"])
    cameras = [k for k, f in info["features"].items() if f.get("dtype") == "video"]
    delta = {cam: [-1 / fps, 0.0] for cam in cameras}
    delta["action"] = [k / fps for k in range(horizon)]
    return delta, cameras, fps


def video_codec(root: Path, camera: str) -> str:
    """The camera's codec as info.json records it, else as the file says (PyAV's stream codec)."""
    info = json.loads((root / "meta" / "info.json").read_text())
    codec = info["features"][camera].get("info", {}).get("video.codec")
    if codec:
        return codec
    import av

    with av.open(str(next((root / "videos" / camera).rglob("*.mp4")))) as container:
        return container.streams.video[0].codec_context.codec.name


def measure_ours(root: Path, backend: str, delta: dict, indices: list[int], args: argparse.Namespace,
                 image_dtype: str = "float32") -> tuple[float, float]:
    """(samples/s, CPU ms per sample) of one DataLoader pass over `indices` (after warm-up batches), our reader."""
    import os

    from torch.utils.data import DataLoader

    from embodyhpc.data import open_dataset

    dataset = open_dataset(root, delta_timestamps=delta, video_backend=backend, image_dtype=image_dtype)
    # The same DataLoader arguments as LeRobot's side (defaults otherwise); pin_memory needs CUDA, so it is off.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=indices, num_workers=args.num_workers)
    batches = iter(loader)
    for _ in range(args.warmup_batches):
        next(batches)
    pids = [os.getpid(), *(w.pid for w in batches._workers)]
    start, cpu_start, num_samples = time.perf_counter(), cpu_seconds(pids), 0
    for batch in batches:
        num_samples += len(batch["index"])
        cpu_end = cpu_seconds(pids)  # after each batch: the workers are gone once the pass ends
    rate = num_samples / (time.perf_counter() - start)
    cpu_ms = 1000 * (cpu_end - cpu_start) / num_samples
    dataset.decoder.close()
    return rate, cpu_ms


class LeRobotLoader:
    """LeRobotDataset behind a DataLoader in a subprocess of the LeRobot venv; `run_pass()` times one pass."""

    def __init__(self, venv: Path, root: Path, delta: dict, indices: list[int], args: argparse.Namespace,
                 tmp: Path) -> None:
        script, config = tmp / "lerobot_loader.py", tmp / "lerobot_loader.json"
        script.write_text(LEROBOT_SCRIPT)
        config.write_text(json.dumps({"root": str(root), "delta_timestamps": delta, "indices": indices,
                                      "batch_size": args.batch_size, "num_workers": args.num_workers,
                                      "warmup_batches": args.warmup_batches}))
        env = offline_env(tmp / "hf_home")
        self.stderr = tmp / "lerobot_loader.stderr"
        with open(self.stderr, "w") as stderr:
            self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(script), str(config)], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"LeRobot loader failed (exit {self.proc.returncode}):\n"
                               f"{self.stderr.read_text()[-3000:]}")
        return json.loads(line)

    def _ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run_pass(self) -> tuple[float, float]:
        result = self._ask("pass")
        return result["rate"], result["cpu_ms"]

    def shapes(self) -> dict:
        return self._ask("shapes")["shapes"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="an existing LeRobot v3.0 dataset (default: generate one)")
    parser.add_argument("--codecs", default="av1,h264", help="codecs of the generated datasets (default av1,h264)")
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--frames", type=int, default=150, help="frames per episode")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--fps", type=int, default=20)
    parser.add_argument("--horizon", type=int, default=50, help="action chunk length (delta_timestamps)")
    parser.add_argument("--samples", type=int, default=640, help="samples timed per pass (after warm-up)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="passes per loader; the median is reported")
    parser.add_argument("--gop-window", type=int, default=0, metavar="W",
                        help="also time uint8 frames in data.gop_window_batches=W's order (default 0: not)")
    parser.add_argument("--h264-tune", metavar="TUNE",
                        help="encode the generated h264 dataset with libx264's --tune TUNE (e.g. fastdecode: cheaper "
                             "to decode, for data we write; both loaders read the same files; default: none)")
    parser.add_argument("--lerobot-venv", type=Path, help="venv with lerobot==0.4.4: baseline = LeRobotDataset")
    parser.add_argument("--build-lerobot-venv", type=Path, metavar="PATH",
                        help="create PATH with lerobot==0.4.4 (CUDA torch, ~8 GB), then use it as --lerobot-venv")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.build_lerobot_venv:
        build_lerobot_venv(args.build_lerobot_venv)
        args.lerobot_venv = args.build_lerobot_venv
    from embodyhpc.data.gop_order import GopOrderedSampler
    from embodyhpc.data.sampler import StepSampler

    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp_name:
        tmp = Path(tmp_name)
        if args.data:
            datasets = {"given": args.data.resolve()}
        else:
            datasets = {}
            for codec in args.codecs.split(","):
                datasets[codec] = tmp / f"dataset-{codec}"
                tune = args.h264_tune if codec == "h264" else None
                took_s = write_dataset(datasets[codec], codec, num_episodes=args.episodes, num_frames=args.frames,
                                       size=args.image_size, fps=args.fps, tune=tune)
                print(f"# wrote {codec} dataset: {len(CAMERAS)} cameras {args.image_size}x{args.image_size}, "
                      f"{args.episodes} episodes x {args.frames} frames, {args.fps} fps, GOP 2"
                      f"{f', x264 tune {tune}' if tune else ''} ({took_s:.1f} s)")
        rows = []
        for label, root in datasets.items():
            delta, cameras, fps = access_pattern(root, args.horizon)
            codec = video_codec(root, cameras[0])
            if codec == "h264" and args.h264_tune and not args.data:
                codec = f"h264/{args.h264_tune}"  # its rows are not the h264 goal's files
            from embodyhpc.data import open_dataset

            dataset = open_dataset(root)
            num_frames = len(dataset)
            sampler = StepSampler(num_frames, rank=0, world_size=1, seed=0)
            count = min(num_frames, args.samples + args.warmup_batches * args.batch_size)
            gop_indices = None
            if args.gop_window:
                window = args.gop_window * args.batch_size
                count = min(-(-count // window) * window, num_frames // window * window)  # whole windows
                gop = GopOrderedSampler(num_frames, rank=0, world_size=1, seed=0, micro_batch=args.batch_size,
                                        window_batches=args.gop_window, locate=dataset.frame_locations)
                gop_indices = list(itertools.islice(iter(gop), count))
            indices = list(itertools.islice(iter(sampler), count))
            if gop_indices is not None and sorted(gop_indices) != sorted(indices):
                raise SystemExit("the regrouped pass does not read the plain pass's samples")
            print(f"# {label}: {root} ({codec}), {len(cameras)} cameras x 2 frames, action chunk {args.horizon}, "
                  f"{num_frames} frames, {count} samples per pass, batch {args.batch_size}, "
                  f"{args.num_workers} workers")
            lerobot = None
            if args.lerobot_venv:
                try:
                    lerobot = LeRobotLoader(args.lerobot_venv.resolve(), root, delta, indices, args, tmp)
                except RuntimeError as exc:
                    print(f"# LeRobot baseline failed: {exc}")
            rates: dict[str, list[tuple[float, float]]] = {"uint8": [], "uint8+gop": [], "float32": [], "pyav": [],
                                                           "lerobot": []}
            try:
                for _ in range(args.repeats):  # interleaved, so drift on shared cores hits every loader alike
                    rates["uint8"].append(measure_ours(root, "torchcodec", delta, indices, args, "uint8"))
                    if gop_indices is not None:
                        rates["uint8+gop"].append(measure_ours(root, "torchcodec", delta, gop_indices, args, "uint8"))
                    rates["float32"].append(measure_ours(root, "torchcodec", delta, indices, args, "float32"))
                    rates["pyav"].append(measure_ours(root, "pyav", delta, indices, args, "uint8"))
                    if lerobot is not None:
                        rates["lerobot"].append(lerobot.run_pass())
                if lerobot is not None:
                    item = open_dataset(root, delta_timestamps=delta)[indices[0]]
                    ours_shapes = {k: list(v.shape) for k, v in item.items() if hasattr(v, "shape")}
                    theirs = lerobot.shapes()
                    same = ours_shapes == theirs
                    print(f"# item {indices[0]}: LeRobot and ours give the same keys and shapes: "
                          f"{'yes' if same else 'NO'}" + ("" if same else f" (LeRobot {theirs}, ours {ours_shapes})"))
            except RuntimeError as exc:
                print(f"# LeRobot baseline failed: {exc}")
                rates["lerobot"] = []
            finally:
                if lerobot is not None:
                    lerobot.close()
            print("# samples/s per pass: " + "; ".join(f"{k} {', '.join(f'{r:.0f}' for r, _ in v)}"
                                                         for k, v in rates.items() if v))

            rows.append((codec, "ours uint8 frames (torchcodec)", *_median(rates["uint8"]), "uint8"))
            if rates["uint8+gop"]:
                rows.append((codec, f"ours uint8 frames, gop window {args.gop_window} (torchcodec)",
                             *_median(rates["uint8+gop"]), "uint8+gop"))
            rows.append((codec, "ours float32 items (torchcodec)", *_median(rates["float32"]), "float32"))
            rows.append((codec, "ours uint8 frames (PyAV fallback)", *_median(rates["pyav"]), "pyav"))
            if rates["lerobot"]:
                info = lerobot.info
                rows.append((codec, f"LeRobot {info['lerobot']} ({info['backend']}, torch {info['torch']})",
                             *_median(rates["lerobot"]), "lerobot"))
        print_table(rows, have_lerobot=any(kind == "lerobot" for *_, kind in rows))
    return 0


def _median(passes: list[tuple[float, float]]) -> tuple[float, float]:
    """(median samples/s, median CPU ms per sample) over passes."""
    return statistics.median(r for r, _ in passes), statistics.median(c for _, c in passes)


def print_table(rows: list[tuple[str, str, float, float, str]], *, have_lerobot: bool) -> None:
    baseline_kind = "lerobot" if have_lerobot else "pyav"
    if not have_lerobot:
        print("# no LeRobot venv: the baseline is OUR reader on the PyAV decoder, not LeRobot "
              "(pass --lerobot-venv PATH or --build-lerobot-venv PATH for the real comparison)")
    print(f"{'codec':<6} {'loader':<52} {'samples/s':>10} {'CPU ms/sample':>14} {'x baseline':>11}  goal")
    for codec in dict.fromkeys(r[0] for r in rows):
        base = next((r[2] for r in rows if r[0] == codec and r[4] == baseline_kind), None)
        for _, name, rate, cpu_ms, kind in (r for r in rows if r[0] == codec):
            ratio = rate / base if base else float("nan")
            goal = ""
            if kind.split("+")[0] in GOAL_RATIO:
                want = GOAL_RATIO[kind.split("+")[0]]
                goal = (f">= {want:g}x LeRobot: {'ok' if ratio >= want else 'BELOW'}" if have_lerobot
                        else f">= {want:g}x LeRobot: n/a (baseline is PyAV)")
            elif kind == baseline_kind:
                goal = "(baseline)"
            print(f"{codec:<6} {name:<52} {rate:10.0f} {cpu_ms:14.2f} {ratio:10.2f}x  {goal}")


if __name__ == "__main__":
    sys.exit(main())
