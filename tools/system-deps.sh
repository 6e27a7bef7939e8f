#!/usr/bin/env bash
# tools/system-deps.sh: the Debian packages embodyhpc needs on a fresh machine (run as root).
# Idempotent: installs only what dpkg does not already have, so a second run takes milliseconds.
#   - FFmpeg 5.1 shared libraries for torchcodec 0.13 (CPU) and the ffmpeg CLI (libx264, libsvtav1, libdav1d)
#   - libfuse2 for bench/latency_fs.py (staging bench behind a simulated metadata latency)
#   - EGL + Mesa (llvmpipe) so MuJoCo renders MetaWorld cameras without a GPU (MUJOCO_GL=egl); libGL + GLib for
#     OpenCV, which gym-pusht imports
#   - Chromium and chromedriver for the MLflow UI test in a real browser (tests/tracking/test_browser.py)
#   - the local Slurm cluster for tests: tools/slurm-local.sh install
set -euo pipefail
PACKAGES=(libavutil57 libavcodec59 libavformat59 libavdevice59 libavfilter8 libswscale6 libswresample4 ffmpeg
          libegl1 libgl1-mesa-dri libopengl0 libgl1 libglib2.0-0 libfuse2 chromium chromium-driver
          ${EMBODYHPC_EXTRA_DEBS:-})

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[system-deps] installing: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
bash "$(dirname "$0")/slurm-local.sh" install
