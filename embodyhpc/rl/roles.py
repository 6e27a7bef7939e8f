"""Which role this process of the RL job plays (actor, rollout or env), its rank within the role, and every role's
size: read from the environment the job started it with.

Three ways a process is started, one answer (`role_from_environment`):
- a heterogeneous Slurm step (rl.sbatch.j2, site.het_jobs: true): each group's processes get EMBODYHPC_RL_ROLE from
  the srun line; SLURM_PROCID is global over the step (group 0's ranks first) and SLURM_NTASKS_HET_GROUP_<i> is each
  group's size, so the role's rank is SLURM_PROCID minus the ranks of the groups before it;
- one allocation (site.het_jobs: false): no role in the environment; the global rank SLURM_PROCID is mapped to a role
  by EMBODYHPC_RL_SIZES ("actor=A,rollout=R,env=E": ranks 0..A-1 are the actor's, then the rollout's, then env's);
- the local backend: the same mapping, from submitit's local rank (SUBMITIT_LOCAL_GLOBALID).
Every variable is checked against the others: a missing, malformed or contradictory one is a one-line error naming it.

`python -m embodyhpc.rl.roles --describe [FOLDER]` prints this process's RoleInfo as JSON (and writes it to
FOLDER/role-<global rank>.json): the Slurm tests run it in place of the RL job's program.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from embodyhpc.config.rl_schema import ROLES
from embodyhpc.errors import UserError

ROLE_VAR = "EMBODYHPC_RL_ROLE"
SIZES_VAR = "EMBODYHPC_RL_SIZES"


@dataclass(frozen=True)
class RoleInfo:
    role: str
    role_rank: int
    """This process's rank among its role's processes (0 .. sizes[role] - 1)."""
    sizes: dict[str, int]
    """Processes of each role, in group order (actor, rollout, env)."""
    global_rank: int
    """This process's rank in the whole job (actor ranks first, then rollout, then env)."""

    @property
    def offset(self) -> int:
        """The global rank of this role's first process."""
        return sum(self.sizes[role] for role in ROLES[:ROLES.index(self.role)])


def role_from_environment(environ: Mapping[str, str] = os.environ) -> RoleInfo:
    """This process's role (see the module's docstring for the three ways it is started)."""
    sizes = parse_sizes(_required(environ, SIZES_VAR))
    total = sum(sizes.values())
    if ROLE_VAR in environ:
        return _het_step(environ, sizes)
    if environ.get("SUBMITIT_EXECUTOR") == "local":
        rank_var, count_var = "SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_NTASKS"
    else:
        rank_var, count_var = "SLURM_PROCID", "SLURM_NTASKS"
    rank = _integer(environ, rank_var)
    if count_var in environ and _integer(environ, count_var) != total:
        raise UserError(f"{count_var}={environ[count_var]} processes, but {SIZES_VAR}={environ[SIZES_VAR]} adds up "
                        f"to {total}", key=count_var, fix="start the RL job from its plan (embodyhpc submit)")
    if not 0 <= rank < total:
        raise UserError(f"{rank_var}={rank} is outside the {total} ranks of {SIZES_VAR}={environ[SIZES_VAR]}",
                        key=rank_var, fix="start the RL job from its plan (embodyhpc submit)")
    offset = 0
    for role in ROLES:
        if rank < offset + sizes[role]:
            return RoleInfo(role, rank - offset, sizes, rank)
        offset += sizes[role]
    raise AssertionError("unreachable: rank checked against the total")  # pragma: no cover


def _het_step(environ: Mapping[str, str], sizes: dict[str, int]) -> RoleInfo:
    """A heterogeneous step: the group is the role's index; its offset the sizes of the groups before it, read from
    Slurm (SLURM_NTASKS_HET_GROUP_<i>) and checked against EMBODYHPC_RL_SIZES."""
    role = environ[ROLE_VAR]
    if role not in ROLES:
        raise UserError(f"{ROLE_VAR}={role!r} is not a role of the RL job", key=ROLE_VAR,
                        fix=f"one of {', '.join(ROLES)} (the srun line of rl.sbatch.j2 sets it per group)")
    het_size = _integer(environ, "SLURM_HET_SIZE")
    if het_size != len(ROLES):
        raise UserError(f"SLURM_HET_SIZE={het_size}: the RL job has {len(ROLES)} groups ({', '.join(ROLES)})",
                        key="SLURM_HET_SIZE", fix="submit the RL job's script as rendered (embodyhpc submit)")
    group = ROLES.index(role)
    for index, name in enumerate(ROLES):
        var = f"SLURM_NTASKS_HET_GROUP_{index}"
        if _integer(environ, var) != sizes[name]:
            raise UserError(f"{var}={environ[var]}, but {SIZES_VAR} gives the {name} group (het group {index}) "
                            f"{sizes[name]} processes", key=var,
                            fix="the groups' order in the script must be actor, rollout, env, as rendered")
    offset = sum(sizes[name] for name in ROLES[:group])
    rank = _integer(environ, "SLURM_PROCID")
    if not offset <= rank < offset + sizes[role]:
        raise UserError(f"SLURM_PROCID={rank} is not a rank of the {role} group (het group {group}: ranks {offset} "
                        f"to {offset + sizes[role] - 1})", key="SLURM_PROCID",
                        fix=f"{ROLE_VAR} must be set per group in the srun line, in the order actor, rollout, env")
    return RoleInfo(role, rank - offset, sizes, rank)


def parse_sizes(text: str) -> dict[str, int]:
    """"actor=1,rollout=2,env=1" -> {"actor": 1, "rollout": 2, "env": 1}: every role once, each at least 1."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, count = part.partition("=")
        name = name.strip()
        if not sep or name not in ROLES or name in sizes or not count.strip().isdigit() or int(count) < 1:
            raise UserError(f"{SIZES_VAR}={text!r}: {part!r} is not role=count", key=SIZES_VAR,
                            fix="e.g. actor=1,rollout=1,env=1 (the plan exports it)")
        sizes[name] = int(count)
    missing = [role for role in ROLES if role not in sizes]
    if missing:
        raise UserError(f"{SIZES_VAR}={text!r} names no {missing[0]} processes", key=SIZES_VAR,
                        fix="e.g. actor=1,rollout=1,env=1 (the plan exports it)")
    return {role: sizes[role] for role in ROLES}


def _required(environ: Mapping[str, str], name: str) -> str:
    if name not in environ:
        raise UserError(f"{name} is not set: this process was not started as part of an RL job", key=name,
                        fix="start RL runs with embodyhpc submit (its plan exports it)")
    return environ[name]


def _integer(environ: Mapping[str, str], name: str) -> int:
    text = _required(environ, name)
    if not text.strip().isdigit():
        raise UserError(f"{name}={text!r} is not a non-negative integer", key=name,
                        fix="start RL runs with embodyhpc submit")
    return int(text)


def describe(folder: str | None = None) -> dict[str, object]:
    """This process's RoleInfo as plain data, with the host it runs on; written to FOLDER/role-<rank>.json."""
    import socket

    info = role_from_environment()
    data = {**asdict(info), "host": socket.gethostname()}
    if folder:
        from embodyhpc.atomic import write_json_atomic

        write_json_atomic(Path(folder) / f"role-{info.global_rank}.json", data)
    return data


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--describe" or len(argv) > 2:
        print("usage: python -m embodyhpc.rl.roles --describe [FOLDER]", file=sys.stderr)
        return 2
    try:
        print(json.dumps(describe(argv[1] if len(argv) == 2 else None), sort_keys=True))
    except UserError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
