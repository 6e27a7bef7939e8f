#!/usr/bin/env bash
# tools/slurm-local.sh — disposable two-node Slurm cluster (with accounting) on a single
# Debian 12 host, for tests and CI, plus one node for heterogeneous jobs only (see below).
# Needs root; uses neither systemd nor cgroups.
#
# Usage: tools/slurm-local.sh <command>
#   install   Install the Debian packages (slurmctld, slurmd, slurm-client, munge, slurmdbd,
#             mariadb-server). Quick no-op when they are already present.
#   start     Generate configs under $SLURM_LOCAL_DIR (default /tmp/slurm-local) and start
#             munged, mariadbd, slurmdbd, slurmctld and one slurmd per node (n1, n2, n3), waiting
#             until the nodes are idle and sacct answers. Daemons already running are kept.
#             Prints the `export SLURM_CONF=...` line clients need.
#   stop      Cancel all jobs, stop every daemon started here, remove namespaces and bridge.
#   restart   stop, then start.
#   status    List daemons, `sinfo -N`, and whether sacct answers.
#             Exit 0 = all up, 1 = partly up / broken, 3 = not running.
#   env       Print `export SLURM_CONF=<base>/etc/slurm.conf` (use: eval "$(... env)").
#
# Layout: every node nI is a slurmd in its own network namespace "slurm-nI" (10.77.0.(10+I)),
# with its own hostname and a private /etc/hosts (UTS + mount namespace), joined by the
# bridge slbr0 (10.77.0.1, where slurmctld and slurmdbd listen).
# Partitions: debug (the default) holds n1..nN, N = SLURM_LOCAL_NODES; het holds those and
# SLURM_LOCAL_HET_NODES more (n3). Slurm starts a heterogeneous job only with every component on
# nodes of its own (the backfill scheduler, the only one that starts them, excludes the nodes of
# the components it started before: _het_job_start_now in sched/backfill, 22.05 and since), so a
# 3-group job (the RL job: actor, rollout, env) needs 3 nodes; no partition or QOS setting lets
# components share a node (measured: OverSubscribe=FORCE pends on Resources, a NoReserve QOS
# starts 2 components and leaves the third BadConstraints). The extra node is in het only, so
# every job of the default partition sees the same 2 nodes as before.
# Knobs (environment):
#   SLURM_LOCAL_DIR, SLURM_LOCAL_NODES (2), SLURM_LOCAL_HET_NODES (1), SLURM_LOCAL_NODE_CPUS (max(nproc,4)),
#   SLURM_LOCAL_NODE_MEM_MB (4000), SLURM_LOCAL_NODE_GPUS (0: fake gres/gpu devices),
#   SLURM_LOCAL_SUBNET (10.77.0), SLURM_LOCAL_MYSQL_PORT (13306).
# Node CPUs/memory may exceed the real machine: slurmd runs with config_overrides.
set -euo pipefail

BASE=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
NODES=${SLURM_LOCAL_NODES:-2}
HET_NODES=${SLURM_LOCAL_HET_NODES:-1}
ALL_NODES=$((NODES + HET_NODES))
_ncpu=$(nproc); [ "$_ncpu" -lt 4 ] && _ncpu=4
CPUS=${SLURM_LOCAL_NODE_CPUS:-$_ncpu}
MEM=${SLURM_LOCAL_NODE_MEM_MB:-4000}
GPUS=${SLURM_LOCAL_NODE_GPUS:-0}
NET=${SLURM_LOCAL_SUBNET:-10.77.0}
DBPORT=${SLURM_LOCAL_MYSQL_PORT:-13306}
BRIDGE=slbr0 CTL_IP=$NET.1 CONF=$BASE/etc/slurm.conf DB_SOCK=$BASE/run/mysqld.sock
MUNGE_DIR=$BASE/munge MUNGE_SOCK=$BASE/munge/munge.socket.2
export SLURM_CONF=$CONF

say() { echo "[slurm-local] $*" >&2; }
fail() { say "error: $*"; exit 1; }
pid_in() { cat "$1" 2>/dev/null || true; }
running() { local p; p=$(pid_in "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
retry() { # retry SECONDS command... : poll every 0.2 s until the command succeeds
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do [ "$SECONDS" -ge "$deadline" ] && return 1; sleep 0.2; done
}
node_names() { local i; for ((i = 1; i <= ALL_NODES; i++)); do echo "n$i"; done; }
node_ip() { echo "$NET.$((10 + ${1#n}))"; }

do_install() {
  local b ok=1
  for b in slurmctld slurmd sbatch slurmdbd mariadbd munged nsenter ip; do command -v "$b" >/dev/null || ok=0; done
  [ "$ok" = 1 ] && { say "packages already installed"; return 0; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge \
    slurmdbd mariadb-server iproute2 util-linux
}

gen_configs() {
  mkdir -p "$BASE"/{etc,state,log,run,spool,jobcomp} "$MUNGE_DIR"
  chmod 755 "$BASE" "$MUNGE_DIR"   # munged insists its socket dir is world-searchable
  local n
  { echo "127.0.0.1 localhost"; echo "$CTL_IP $(hostname -s)"
    for n in $(node_names); do echo "$(node_ip "$n") $n"; done; } > "$BASE/etc/hosts"
  cat > "$CONF" <<EOF
# written by tools/slurm-local.sh; regenerated on every start
ClusterName=local
SlurmctldHost=$(hostname -s)($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_IP
AccountingStoragePort=6819
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/jobcomp/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
PropagateResourceLimits=NONE
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,sched_min_interval=0,bf_interval=1,batch_sched_delay=0
# dependents of a failed job are cancelled instead of pending forever
DependencyParameters=kill_invalid_depend
# finished jobs must stay in slurmctld memory long enough for afterok checks
MinJobAge=300
ReturnToService=2
KillWait=5
OverTimeLimit=0
InactiveLimit=0
SlurmdTimeout=30
MessageTimeout=10
EOF
  local gres=""
  rm -f "$BASE/etc/gres.conf"
  if [ "$GPUS" -gt 0 ]; then
    # gres/gpu wants a device file per GPU; char device 1,3 (like /dev/null) will do
    mkdir -p "$BASE/dev"; local g
    for ((g = 0; g < GPUS; g++)); do [ -c "$BASE/dev/gpu$g" ] || mknod "$BASE/dev/gpu$g" c 1 3; done
    echo "GresTypes=gpu" >> "$CONF"; gres="Gres=gpu:$GPUS"
    echo "NodeName=n[1-$ALL_NODES] Name=gpu File=$BASE/dev/gpu[0-$((GPUS - 1))]" > "$BASE/etc/gres.conf"
  fi
  for n in $(node_names); do
    echo "NodeName=$n NodeAddr=$(node_ip "$n") CPUs=$CPUS RealMemory=$MEM $gres State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
  echo "PartitionName=het Nodes=ALL MaxTime=INFINITE State=UP" >> "$CONF"   # heterogeneous jobs (see the top)
  cat > "$BASE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$BASE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$BASE/etc/slurmdbd.conf"   # slurmdbd rejects a readable-by-others config
}

up_munge() {
  [ -f "$MUNGE_DIR/munge.key" ] || mungekey --create --keyfile="$MUNGE_DIR/munge.key"
  chmod 600 "$MUNGE_DIR/munge.key"
  running "$MUNGE_DIR/munged.pid" && return 0
  munged --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" --pid-file="$MUNGE_DIR/munged.pid" \
    --log-file="$BASE/log/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
  munge -S "$MUNGE_SOCK" -n | unmunge -S "$MUNGE_SOCK" >/dev/null || fail "munge round trip failed"
}

up_network() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || {
    ip link add "$BRIDGE" type bridge; ip addr add "$CTL_IP/24" dev "$BRIDGE"; ip link set "$BRIDGE" up; }
  local n ns
  for n in $(node_names); do
    ns=slurm-$n
    [ -e "/run/netns/$ns" ] && continue
    ip netns add "$ns"
    ip link add "veth-$ns" type veth peer name eth0 netns "$ns"
    ip link set "veth-$ns" master "$BRIDGE" up
    ip -n "$ns" addr add "$(node_ip "$n")/24" dev eth0
    ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up
  done
}

sql() { mariadb --no-defaults -S "$DB_SOCK" -uroot -e "$1"; }

up_accounting() {
  if ! running "$BASE/run/mysqld.pid"; then
    [ -d "$BASE/mysql/mysql" ] || mariadb-install-db --no-defaults --user=root --datadir="$BASE/mysql" \
      --auth-root-authentication-method=socket > "$BASE/log/mariadb-install.log" 2>&1
    setsid -f mariadbd --no-defaults --user=root --datadir="$BASE/mysql" --socket="$DB_SOCK" \
      --pid-file="$BASE/run/mysqld.pid" --bind-address=127.0.0.1 --port="$DBPORT" \
      --log-error="$BASE/log/mysqld.err" --skip-log-bin --innodb-buffer-pool-size=128M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1
    retry 60 sql 'SELECT 1' || fail "mariadb not answering (see $BASE/log/mysqld.err)"
    local h
    for h in 127.0.0.1 localhost; do
      sql "CREATE USER IF NOT EXISTS 'slurm'@'$h' IDENTIFIED BY 'slurm';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'$h';"
    done
  fi
  if ! running "$BASE/run/slurmdbd.pid"; then
    slurmdbd   # no -f flag: finds slurmdbd.conf next to $SLURM_CONF
    retry 30 sacctmgr -n list cluster || fail "slurmdbd not answering (see $BASE/log/slurmdbd.log)"
  fi
}

up_slurm() {
  running "$BASE/run/slurmctld.pid" || slurmctld -f "$CONF"
  local n
  for n in $(node_names); do
    running "$BASE/run/slurmd-$n.pid" && continue
    mkdir -p "$BASE/spool/$n"
    # nsenter rather than `ip netns exec`, which remounts /sys and breaks slurmd's cgroup probe
    nsenter --net="/run/netns/slurm-$n" unshare --mount --uts --propagation private \
      sh -c "mount --bind '$BASE/etc/hosts' /etc/hosts && hostname $n && exec slurmd -f '$CONF' -N $n"
  done
  # every node registered and responding (busy is fine: start may run under live jobs); sinfo -N lists a node
  # once per partition it is in
  retry 60 sh -c "[ \$(sinfo -h -N -o '%N %T' | sort -u | grep -cE ' (idle|mixed|allocated|completing)\$') = $ALL_NODES ]" \
    || { sinfo -N >&2; fail "nodes did not come up"; }
  retry 30 sacct -n -X -S now || fail "sacct not answering"
}

do_start() {
  local t0=$SECONDS
  command -v slurmctld >/dev/null || fail "Slurm missing: run '$0 install' first"
  gen_configs; up_munge; up_network; up_accounting; up_slurm
  say "cluster up in $((SECONDS - t0))s"
  sinfo -N >&2
  echo "export SLURM_CONF=$CONF"
}

stop_pid() { # stop_pid PIDFILE [GRACE_SECONDS]
  running "$1" || return 0
  local p; p=$(pid_in "$1"); kill "$p" 2>/dev/null || true
  retry "${2:-15}" sh -c "! kill -0 $p" || kill -9 "$p" 2>/dev/null || true
}

do_stop() {
  local n
  if running "$BASE/run/slurmctld.pid"; then
    scancel $(squeue -h -o %A 2>/dev/null | sort -u) 2>/dev/null || true
    retry 20 sh -c '[ -z "$(squeue -h 2>/dev/null)" ]' || say "jobs still queued after 20s"
    scontrol shutdown >/dev/null 2>&1 || true   # takes slurmctld and all slurmd down
  fi
  for n in $(node_names); do stop_pid "$BASE/run/slurmd-$n.pid"; done
  stop_pid "$BASE/run/slurmctld.pid"
  for n in $(node_names); do   # leftovers in a node namespace (slurmstepd, tasks) are ours
    [ -e "/run/netns/slurm-$n" ] || continue
    ip netns pids "slurm-$n" | xargs -r kill -9 2>/dev/null || true
    ip link del "veth-slurm-$n" 2>/dev/null || true
    ip netns del "slurm-$n"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  stop_pid "$BASE/run/slurmdbd.pid"
  if running "$BASE/run/mysqld.pid"; then
    mariadb-admin --no-defaults -S "$DB_SOCK" -uroot shutdown >/dev/null 2>&1 || true
    stop_pid "$BASE/run/mysqld.pid" 30
  fi
  running "$MUNGE_DIR/munged.pid" && \
    { munged --stop --socket="$MUNGE_SOCK" >/dev/null 2>&1 || stop_pid "$MUNGE_DIR/munged.pid"; }
  say "stopped"
}

do_status() {
  local f up=0 down=0
  for f in "$MUNGE_DIR/munged.pid" "$BASE"/run/{mysqld,slurmdbd,slurmctld}.pid \
           $(node_names | sed "s|^|$BASE/run/slurmd-|; s|\$|.pid|"); do
    if running "$f"; then echo "running  $(basename "$f" .pid) (pid $(pid_in "$f"))"; up=$((up + 1))
    else echo "stopped  $(basename "$f" .pid)"; down=$((down + 1)); fi
  done
  [ "$up" = 0 ] && return 3
  sinfo -N 2>&1 || down=$((down + 1))
  if sacct -n -X -S now >/dev/null 2>&1; then echo "sacct: ok"; else echo "sacct: not answering"; down=$((down + 1)); fi
  [ "$down" = 0 ]
}

case "${1:-}" in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  restart) do_stop; do_start ;;
  status) do_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) echo "usage: $0 install|start|stop|restart|status|env (see --help)" >&2; exit 2 ;;
esac
