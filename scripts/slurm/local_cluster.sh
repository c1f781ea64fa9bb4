#!/usr/bin/env bash
# A one-node SLURM on this machine, for CI and for trying the sbatch scripts (Debian, as root).
#
#   scripts/slurm/local_cluster.sh start    # install slurm-wlm + munge if missing, start daemons
#   scripts/slurm/local_cluster.sh status   # daemons and `sinfo`
#   scripts/slurm/local_cluster.sh stop     # stop the daemons this script started (by pid)
#   eval "$(scripts/slurm/local_cluster.sh env)"   # export SLURM_CONF for sbatch/sinfo/squeue
#
# Everything lives in $LOCAL_SLURM_DIR (default /tmp/megatron-pp-slurm): slurm.conf, state and
# spool folders, pid files and logs. The node gets this machine's CPU count (nproc) and memory;
# jobs with more tasks than CPUs need `sbatch --nodes=1 --overcommit`. Proctracking without
# cgroups (proctrack/linuxproc, task/none), so it also runs inside containers. munged is shared
# with the system: a running one is reused (and left running), else one is started as user munge.
# start is idempotent: daemons already running from $LOCAL_SLURM_DIR are kept.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/megatron-pp-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-6818}
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}
NODE=$(hostname -s)
export SLURM_CONF=$CONF

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }  # alive PIDFILE

stop_pidfile() {  # stop_pidfile PIDFILE NAME: TERM, wait up to 10 s, then KILL
  local pidfile=$1 name=$2 pid i
  if ! alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then log "$name (pid $pid) ignored TERM: KILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$pidfile"
  log "stopped $name (pid $pid)"
}

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || die "slurm-wlm/munge are missing and installing them needs root"
  log "installing slurm-wlm and munge (apt-get)"
  local t0=$SECONDS
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >"$DIR/apt.log" 2>&1 \
    || { tail -20 "$DIR/apt.log" >&2; die "apt-get install slurm-wlm munge failed"; }
  log "installed in $((SECONDS - t0)) s"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    alive "$DIR/munged.pid" || log "munged already running (not ours): reusing it"
    return 0
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: stop may end it
  munge -n </dev/null | unmunge >/dev/null || die "munged started but munge/unmunge fails"
  log "started munged (pid $(cat "$DIR/munged.pid"))"
}

write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 95 / 100 ))
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/jobs"
  cat >"$CONF" <<EOF
# One-node SLURM written by scripts/slurm/local_cluster.sh; state, spool and logs in $DIR.
ClusterName=megatron-pp-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1; }

cmd_start() {
  mkdir -p "$DIR"
  install_packages
  start_munge
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
    log "already running (slurmctld pid $(cat "$DIR/slurmctld.pid"), slurmd pid $(cat "$DIR/slurmd.pid"))"
  else
    stop_pidfile "$DIR/slurmd.pid" slurmd
    stop_pidfile "$DIR/slurmctld.pid" slurmctld
    write_conf
    slurmctld -i -f "$CONF"  # -i: ignore state that a previous run left in $DIR/state
    slurmd -f "$CONF"
  fi
  local t0=$SECONDS state=""
  while [ $((SECONDS - t0)) -lt "$WAIT_S" ]; do
    state=$(node_state)
    case $state in idle*|mixed*|allocated*) break ;; esac
    alive "$DIR/slurmctld.pid" || die "slurmctld exited: see $DIR/slurmctld.log"
    sleep 0.5
  done
  case $state in
    idle*|mixed*|allocated*) ;;
    *) tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
       die "node $NODE is '${state:-unknown}' after ${WAIT_S} s (logs above)" ;;
  esac
  log "node $NODE is $state after $((SECONDS - t0)) s"
  log "config: $CONF   logs: $DIR/slurmctld.log $DIR/slurmd.log"
  log "use it with: export SLURM_CONF=$CONF"
}

cmd_stop() {
  stop_pidfile "$DIR/slurmd.pid" slurmd
  stop_pidfile "$DIR/slurmctld.pid" slurmctld
  stop_pidfile "$DIR/munged.pid" munged
}

cmd_status() {
  local name rc=0
  for name in munged slurmctld slurmd; do
    if alive "$DIR/$name.pid"; then echo "$name: running (pid $(cat "$DIR/$name.pid"))"
    else echo "$name: not running from $DIR"; [ "$name" = munged ] || rc=1; fi
  done
  echo "config: $CONF"
  [ "$rc" = 0 ] && sinfo -N -l || true
  return "$rc"
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env   (state in \$LOCAL_SLURM_DIR, default $DIR)" >&2; exit 2 ;;
esac
