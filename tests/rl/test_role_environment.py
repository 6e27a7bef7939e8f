"""embodyhpc.rl.roles: a process's role, role rank and the role sizes from the environment, in the three ways an RL
job starts its processes (a heterogeneous Slurm step, one allocation, the local backend), and one-line errors for a
missing or contradictory variable.

The expected layouts are written out by hand from Slurm's documented numbering (heterogeneous_jobs.html: SLURM_PROCID
is global over the step, group 0's tasks first; measured on the local cluster: a 1+2 task het step gave group 0
SLURM_PROCID 0 and group 1 SLURM_PROCID 1 and 2, SLURM_NTASKS_HET_GROUP_0=1, SLURM_NTASKS_HET_GROUP_1=2).
"""

from __future__ import annotations

import json

import pytest

from embodyhpc.errors import UserError
from embodyhpc.rl.roles import RoleInfo, main, role_from_environment

SIZES = "actor=2,rollout=3,env=1"
SIZE_MAP = {"actor": 2, "rollout": 3, "env": 1}
# global rank -> (role, rank within the role), by hand
LAYOUT = [("actor", 0), ("actor", 1), ("rollout", 0), ("rollout", 1), ("rollout", 2), ("env", 0)]
HET_GROUPS = {"SLURM_HET_SIZE": "3", "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "3",
              "SLURM_NTASKS_HET_GROUP_2": "1"}


def het_env(role: str, procid: int, **changes: str) -> dict[str, str]:
    """What a task of a heterogeneous step sees (rl.sbatch.j2 exports EMBODYHPC_RL_ROLE per group)."""
    env = {"EMBODYHPC_RL_SIZES": SIZES, "EMBODYHPC_RL_ROLE": role, "SLURM_PROCID": str(procid),
           "SLURM_NTASKS": "6", **HET_GROUPS}
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("rank", range(6))
def test_het_step_role_rank_from_the_global_procid(rank):
    role, role_rank = LAYOUT[rank]
    assert role_from_environment(het_env(role, rank)) == RoleInfo(role, role_rank, SIZE_MAP, rank)


@pytest.mark.parametrize("rank", range(6))
def test_one_allocation_and_local_ranks_map_by_the_sizes(rank):
    role, role_rank = LAYOUT[rank]
    slurm = {"EMBODYHPC_RL_SIZES": SIZES, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "6"}
    local = {"EMBODYHPC_RL_SIZES": SIZES, "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": str(rank),
             "SUBMITIT_LOCAL_NTASKS": "6", "SLURM_PROCID": "99"}  # a stale Slurm variable is not read locally
    assert role_from_environment(slurm) == RoleInfo(role, role_rank, SIZE_MAP, rank)
    assert role_from_environment(local) == RoleInfo(role, role_rank, SIZE_MAP, rank)
    assert role_from_environment(slurm).offset == LAYOUT.index((role, 0))


@pytest.mark.parametrize(("env", "variable"), [
    ({"SLURM_PROCID": "0"}, "EMBODYHPC_RL_SIZES"),  # not started as an RL job
    ({"EMBODYHPC_RL_SIZES": "actor=1,rollout=1"}, "EMBODYHPC_RL_SIZES"),  # a role missing
    ({"EMBODYHPC_RL_SIZES": "actor=1,rollout=x,env=1"}, "EMBODYHPC_RL_SIZES"),
    ({"EMBODYHPC_RL_SIZES": "actor=1,actor=1,env=1"}, "EMBODYHPC_RL_SIZES"),
    ({"EMBODYHPC_RL_SIZES": "actor=0,rollout=1,env=1"}, "EMBODYHPC_RL_SIZES"),
    ({"EMBODYHPC_RL_SIZES": SIZES}, "SLURM_PROCID"),  # no rank at all
    ({"EMBODYHPC_RL_SIZES": SIZES, "SLURM_PROCID": "-1"}, "SLURM_PROCID"),
    ({"EMBODYHPC_RL_SIZES": SIZES, "SLURM_PROCID": "6"}, "SLURM_PROCID"),  # past the last rank
    ({"EMBODYHPC_RL_SIZES": SIZES, "SLURM_PROCID": "0", "SLURM_NTASKS": "5"}, "SLURM_NTASKS"),  # sizes disagree
    ({"EMBODYHPC_RL_SIZES": SIZES, "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "0",
      "SUBMITIT_LOCAL_NTASKS": "2"}, "SUBMITIT_LOCAL_NTASKS"),
    (het_env("learner", 0), "EMBODYHPC_RL_ROLE"),
    (het_env("actor", 0, SLURM_HET_SIZE="2"), "SLURM_HET_SIZE"),  # a 2-group job cannot hold 3 roles
    (het_env("actor", 0, SLURM_HET_SIZE=None), "SLURM_HET_SIZE"),
    # the groups in another order than actor, rollout, env: group 0 has the rollout's 3 tasks
    (het_env("actor", 0, SLURM_NTASKS_HET_GROUP_0="3", SLURM_NTASKS_HET_GROUP_1="2"), "SLURM_NTASKS_HET_GROUP_0"),
    (het_env("actor", 0, SLURM_NTASKS_HET_GROUP_2=None), "SLURM_NTASKS_HET_GROUP_2"),
    # one role exported to every group: rank 3 is a rollout rank, not an actor's
    (het_env("actor", 3), "SLURM_PROCID"),
    (het_env("env", 4), "SLURM_PROCID"),
])
def test_missing_or_contradictory_variables_are_one_line_errors_naming_the_variable(env, variable):
    with pytest.raises(UserError) as caught:
        role_from_environment(env)
    line = caught.value.one_line()
    assert "\n" not in line and line.startswith(f"{variable}:"), line


def test_describe_prints_and_writes_the_role_as_json(tmp_path, monkeypatch, capsys):
    for name, value in het_env("rollout", 4).items():
        monkeypatch.setenv(name, value)
    assert main(["--describe", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["role"], printed["role_rank"], printed["global_rank"]) == ("rollout", 2, 4)
    assert printed["sizes"] == SIZE_MAP and printed["host"]
    assert json.loads((tmp_path / "role-4.json").read_text()) == printed
    monkeypatch.setenv("EMBODYHPC_RL_ROLE", "actor")  # contradicts SLURM_PROCID=4
    assert main(["--describe"]) == 2
    assert "SLURM_PROCID" in capsys.readouterr().err
    assert main([]) == 2
