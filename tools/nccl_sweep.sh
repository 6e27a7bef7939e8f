#!/usr/bin/env bash
# tools/nccl_sweep.sh — run the NCCL/Gloo bandwidth sweep (tools/nccl_sweep.py) with the repo's venv Python.
# The Python driver launches one `srun -N <nodes> --ntasks-per-node=1` step per variant itself; run this on a
# login node, or inside an allocation (salloc/sbatch) to reuse its nodes. Examples:
#   tools/nccl_sweep.sh --nodes 2 --site example_ib --variant qps4:NCCL_IB_QPS_PER_CONNECTION=4 \
#       --srun-arg=--gpus-per-node=8 --sizes 1MiB,64MiB,1GiB
#   SLURM_CONF=/tmp/slurm-local/etc/slurm.conf tools/nccl_sweep.sh --backend gloo --sizes 1KiB,1MiB   # local cluster
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then python=$here/../.venv/bin/python; else python=python3; fi
fi
command -v srun >/dev/null || { echo "nccl_sweep: srun not found (run on a Slurm login node)" >&2; exit 2; }
exec "$python" "$here/nccl_sweep.py" --python "$python" "$@"
