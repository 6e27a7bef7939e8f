"""What a job id looks like: Slurm's (a job, or one element of an array) and the local backend's (a process id).

Both sides read it: run.json's reader (embodyhpc/rundir.py) refuses a record that is not one, and
embodyhpc/slurm/commands.py refuses to pass anything else to scancel. Here, below both, so neither imports the other.
"""

from __future__ import annotations

import re

JOB_ID = re.compile(r"[0-9]{1,20}(_[0-9]{1,10})?")  # a job, or one element of an array; local pids are digits too
