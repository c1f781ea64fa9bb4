#!/usr/bin/env bash
# A SLURM on this machine, for CI and for trying the sbatch scripts (Debian, as root): one node,
# or N nodes that are each a Linux network namespace of this machine.
#
#   scripts/slurm/local_cluster.sh start [--nodes N]   # install slurm-wlm + munge if missing,
#                                                      # start daemons (N: default 1)
#   scripts/slurm/local_cluster.sh status   # daemons and `sinfo -N -l`
#   scripts/slurm/local_cluster.sh stop     # stop what start started (daemons by pid, the
#                                           # network from its record)
#   eval "$(scripts/slurm/local_cluster.sh env)"   # export SLURM_CONF for sbatch/sinfo/squeue
#
# Everything lives in $LOCAL_SLURM_DIR (default /tmp/megatron-pp-slurm): slurm.conf, state and
# spool folders, pid files and logs. Each node gets this machine's CPU count (nproc) and memory;
# jobs with more tasks than CPUs need `sbatch --overcommit` (and on one node `--nodes=1`).
# Proctracking without cgroups (proctrack/linuxproc, task/none), so it also runs inside
# containers. munged is shared with the system (and with the namespaces, through its socket in
# the filesystem): a running one is reused (and left running), else one is started as user munge.
# start is idempotent: daemons already running from $LOCAL_SLURM_DIR are kept (a cluster running
# with another node count must be stopped first).
#
# One node (the default): node $(hostname -s), slurmctld and slurmd on 127.0.0.1, ports
# $LOCAL_SLURM_CTLD_PORT (6817) and $LOCAL_SLURM_SLURMD_PORT (6818); no network setup.
#
# N >= 2 nodes: in the root network namespace a bridge mppbr0 with 10.213.0.1/24, where the one
# slurmctld is reached (SlurmctldHost=$(hostname -s)(10.213.0.1)); for node i = 1..N
#   * network namespace mpp-node<i> (also the SLURM node name), with lo up and eth0 at
#     10.213.0.<10+i>/24, the end of a veth pair whose other end, mppbr0-<i>, is on the bridge
#     (IPv4 only, no default route: a namespace reaches only 10.213.0.0/24 and its loopback);
#   * /etc/netns/mpp-node<i>/hosts, which `ip netns exec` mounts over /etc/hosts: localhost,
#     every node's name and address, and this machine's hostname as that namespace's own address
#     (a process that resolves its own hostname, as gloo does to pick its interface, gets its
#     node's address);
#   * one slurmd, `ip netns exec mpp-node<i> slurmd -N mpp-node<i> -f $DIR/slurm.conf`, so its
#     jobs run in the namespace (and see its hosts file); the cgroup file systems, which that new
#     /sys lacks, are mounted again in ip's private mount namespace first. Spool
#     $DIR/spool/mpp-node<i>, pid file $DIR/slurmd-mpp-node<i>.pid, log $DIR/slurmd-mpp-node<i>.log.
# Partition debug (Default=YES) holds all nodes; start waits until all N are idle.
# start writes each namespace, link and /etc/netns directory to $DIR/resources before making it;
# stop ends the processes left in those namespaces and removes what that record lists (also
# after a failed or half-done start; running stop twice is harmless). Other names for a second
# multi-node cluster beside this one: $LOCAL_SLURM_BRIDGE (mppbr0), $LOCAL_SLURM_NETNS_PREFIX
# (mpp-node), $LOCAL_SLURM_SUBNET (the /24's first three numbers, 10.213.0).
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/megatron-pp-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-6818}
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}
NODE=$(hostname -s)
BRIDGE=${LOCAL_SLURM_BRIDGE:-mppbr0}
NS_PREFIX=${LOCAL_SLURM_NETNS_PREFIX:-mpp-node}
SUBNET=${LOCAL_SLURM_SUBNET:-10.213.0}
NODES_FILE=$DIR/nodes    # the node count of the cluster started from $DIR
RECORD=$DIR/resources    # what start made for N >= 2: "netns|link|dir NAME", one a line
export SLURM_CONF=$CONF

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

running() {  # running PID: it exists and is no zombie (this machine's init reaps them late)
  kill -0 "$1" 2>/dev/null && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" != Z ]
}
alive() { [ -s "$1" ] && running "$(cat "$1")"; }  # alive PIDFILE

stop_pidfile() {  # stop_pidfile PIDFILE NAME: TERM, wait up to 10 s, then KILL
  local pidfile=$1 name=$2 pid i
  if ! alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 100); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then log "$name (pid $pid) ignored TERM: KILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$pidfile"
  log "stopped $name (pid $pid)"
}

recorded_nodes() {  # the node count recorded in $DIR (1 when none)
  local n
  n=$(cat "$NODES_FILE" 2>/dev/null || true)
  [[ $n =~ ^[1-9][0-9]*$ ]] && echo "$n" || echo 1
}

node_names() {  # node_names N: the SLURM node names of an N-node cluster, one a line
  if [ "$1" = 1 ]; then echo "$NODE"; else seq -f "$NS_PREFIX%g" "$1"; fi
}

node_addr() { echo "$SUBNET.$((10 + $1))"; }  # node_addr I (N >= 2)

slurmd_pidfile() {  # slurmd_pidfile NAME N
  if [ "$2" = 1 ]; then echo "$DIR/slurmd.pid"; else echo "$DIR/slurmd-$1.pid"; fi
}

all_running() {  # all_running N: slurmctld and the N slurmds alive from $DIR
  local name
  alive "$DIR/slurmctld.pid" || return 1
  for name in $(node_names "$1"); do alive "$(slurmd_pidfile "$name" "$1")" || return 1; done
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

# --- the network of an N >= 2 node cluster -------------------------------------------------

netns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF -- "$1"; }
link_exists() { ip link show dev "$1" >/dev/null 2>&1; }

record() {  # record KIND NAME: before making it, so stop removes it even if start dies here
  grep -qxF -- "$1 $2" "$RECORD" 2>/dev/null || echo "$1 $2" >>"$RECORD"
}

net_check_free() {  # net_check_free N: refuse names and addresses that are taken (not ours:
  local n=$1 i ns  # ours were removed before this runs)
  [ "$(id -u)" = 0 ] || die "--nodes $n makes network namespaces and needs root"
  command -v ip >/dev/null || die "--nodes $n needs ip (iproute2)"
  [[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "LOCAL_SLURM_SUBNET=$SUBNET: want A.B.C"
  [ $((10 + n)) -le 254 ] || die "--nodes $n: at most 244 nodes in $SUBNET.0/24"
  [ ${#BRIDGE} -le 12 ] || die "LOCAL_SLURM_BRIDGE=$BRIDGE: at most 12 characters (veth names)"
  link_exists "$BRIDGE" && die "link $BRIDGE exists and is not this cluster's (another" \
    "LOCAL_SLURM_DIR's? set LOCAL_SLURM_BRIDGE/_NETNS_PREFIX/_SUBNET for a second cluster)"
  if ip -4 addr show | grep -q "inet ${SUBNET//./\\.}\." || [ -n "$(ip -4 route show "$SUBNET.0/24")" ]; then
    die "$SUBNET.0/24 is already in use on this machine (ip addr / ip route): set LOCAL_SLURM_SUBNET"
  fi
  for i in $(seq "$n"); do
    ns=$NS_PREFIX$i
    netns_exists "$ns" && die "network namespace $ns exists and is not this cluster's"
    link_exists "$BRIDGE-$i" && die "link $BRIDGE-$i exists and is not this cluster's"
    [ -e "/etc/netns/$ns" ] && die "/etc/netns/$ns exists and is not this cluster's"
  done
  return 0
}

write_hosts() {  # write_hosts N I: /etc/hosts as node I's namespace sees it
  local n=$1 own=$2 i names
  names=$(hostname)
  [ "$(hostname -s)" = "$names" ] || names="$names $(hostname -s)"
  echo "# /etc/hosts in network namespace $NS_PREFIX$own (ip netns exec), written by"
  echo "# scripts/slurm/local_cluster.sh for the cluster in $DIR. This machine's hostname is this"
  echo "# namespace's own address here."
  echo "127.0.0.1 localhost"
  echo "::1 localhost ip6-localhost ip6-loopback"
  for i in $(seq "$n"); do
    if [ "$i" = "$own" ]; then echo "$(node_addr "$i") $NS_PREFIX$i $names"
    else echo "$(node_addr "$i") $NS_PREFIX$i"; fi
  done
}

no_ipv6() {  # no_ipv6 LINK: IPv4 only (no link-local address, router solicitations, ...)
  [ ! -w "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ] || echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6"
}

net_up() {  # net_up N: the bridge, and per node a namespace, a veth pair and its hosts file
  local n=$1 i ns veth addr
  net_check_free "$n"
  if [ ! -d /etc/netns ]; then record dir /etc/netns; mkdir /etc/netns; fi
  record link "$BRIDGE"
  ip link add name "$BRIDGE" type bridge
  no_ipv6 "$BRIDGE"
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set dev "$BRIDGE" up
  for i in $(seq "$n"); do
    ns=$NS_PREFIX$i veth=$BRIDGE-$i addr=$(node_addr "$i")
    record netns "$ns"
    ip netns add "$ns"
    record link "$veth"
    ip link add name "$veth" type veth peer name eth0 netns "$ns"
    no_ipv6 "$veth"
    ip netns exec "$ns" bash -c "$(declare -f no_ipv6); no_ipv6 eth0"
    ip link set dev "$veth" master "$BRIDGE" up
    ip -n "$ns" link set dev lo up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set dev eth0 up
    record dir "/etc/netns/$ns"
    mkdir -p "/etc/netns/$ns"
    write_hosts "$n" "$i" >"/etc/netns/$ns/hosts"
  done
  log "network: bridge $BRIDGE $SUBNET.1/24; namespaces ${NS_PREFIX}1..$n at" \
    "$(node_addr 1)..$(node_addr "$n")"
}

netns_pids() {  # netns_pids NS: the processes (no zombies) in network namespace NS
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null || true); do running "$pid" && echo "$pid"; done
  return 0
}

end_netns_processes() {  # end_netns_processes NS: TERM what still runs in NS, KILL after 5 s
  local ns=$1 pids i
  pids=$(netns_pids "$ns" | paste -sd' ')
  [ -n "$pids" ] || return 0
  log "ending processes left in $ns: $pids"
  kill -TERM $pids 2>/dev/null || true
  for i in $(seq 50); do
    pids=$(netns_pids "$ns" | paste -sd' ')
    [ -n "$pids" ] || return 0
    sleep 0.1
  done
  log "still running in $ns after TERM: KILL $pids"
  kill -KILL $pids 2>/dev/null || true
  sleep 0.2
}

net_down() {  # remove what $RECORD lists, last made first (missing ones skipped); idempotent
  [ -s "$RECORD" ] || { rm -f "$RECORD"; return 0; }
  local lines line kind name failed=0
  mapfile -t lines < <(tac "$RECORD")
  for line in "${lines[@]}"; do
    kind=${line%% *} name=${line#* }
    case $kind in
      netns)
        netns_exists "$name" || continue
        end_netns_processes "$name"
        if ip netns del "$name"; then log "removed network namespace $name"; else failed=1; fi ;;
      link)
        link_exists "$name" || continue
        if ip link del dev "$name"; then log "removed link $name"; else failed=1; fi ;;
      dir)
        case $name in
          /etc/netns/?*) [ -e "$name" ] || continue
                         if rm -rf -- "$name"; then log "removed $name"; else failed=1; fi ;;
          /etc/netns) rmdir -- "$name" 2>/dev/null && log "removed $name" || true ;;  # if empty
          *) log "warning: not removing $name (not under /etc/netns)" ;;
        esac ;;
      *) log "warning: $RECORD: unknown line '$line'" ;;
    esac
  done
  if [ "$failed" = 0 ]; then rm -f "$RECORD"
  else log "warning: some of $RECORD could not be removed: run stop again"; return 1; fi
}

# --- slurm ------------------------------------------------------------------------------------

write_conf() {  # write_conf N
  local n=$1 cpus mem_mb title ctld_addr spool slurmd_pid slurmd_log node_lines partition i
  cpus=$(nproc)
  mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 95 / 100 ))
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/jobs"
  if [ "$n" = 1 ]; then
    title="One-node SLURM" ctld_addr=127.0.0.1 spool=$DIR/spool
    slurmd_pid=$DIR/slurmd.pid slurmd_log=$DIR/slurmd.log partition=$NODE
    node_lines="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  else
    title="$n-node SLURM (each node a network namespace on bridge $BRIDGE)"
    ctld_addr=$SUBNET.1 spool=$DIR/spool/%n slurmd_pid=$DIR/slurmd-%n.pid
    slurmd_log=$DIR/slurmd-%n.log partition=$(node_names "$n" | paste -sd,)
    node_lines=$(for i in $(seq "$n"); do
      echo "NodeName=$NS_PREFIX$i NodeAddr=$(node_addr "$i") CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
    done)
  fi
  # How soon a lost node is declared down (and its job ended NODE_FAIL): the node-lost test
  # (tests/test_slurm.py) needs its survivors to report before that (2 x --p2p-timeout-s + 6 s
  # at most: 12 s at its 3 s) and checks the values below against it (`scontrol show config`).
  # (slurmctld 22.05, Debian bookworm's, measured 2026-12-04 on 2 cores.)
  # * SlurmdTimeout 15 s (SLURM's default 300 s): slurmctld's ping round, every SlurmdTimeout/3
  #   (5 s), declares a node down once the round before it found the node silent for
  #   SlurmdTimeout: never sooner than SlurmdTimeout + one round (20 s) after its last answer.
  # * AcctGatherNodeFreq 2 s: slurmctld asks every responding node for its energy counters
  #   (none here) every 2 s, so a node's last answer is at most ~3 s old when it is cut off
  #   (a ping round only asks a node silent for a round, i.e. every other round: its last answer
  #   could be 10 s old and the node declared down 10 s after the cut). Not 1 s: slurmctld's
  #   background loop, once a second, starts this request before the ping round, which waits
  #   while such a request is out; at 1 s the rounds never ran.
  # * MessageTimeout 5 s (default 10 s): a request to the lost node gives up after 6 s
  #   (connects of TCPTimeout, 2 s, for MessageTimeout s) and holds the next round off until
  #   then; at 10 s that took 12 s and the node was declared down 29-47 s after the cut.
  #   At 3 s (two connects: 4 s) a round lasts 6 s, not 8 (each round: the ping's connects,
  #   then one 1 s turn, then one more, in which the energy request that slurmctld's loop
  #   starts first holds the ping), yet the node was declared down 24.5-25.7 s after the cut
  #   (3 trials, 2026-12-05): within the spread at 5 s, so 5 s stays.
  # So the lost node is declared down at least 20 - 3 - 1 (whole seconds) = 16 s after its link
  # goes, and in practice 24-26 s (the energy request, then two ping rounds, each 8 s to give
  # up on it; idle, and with 4 busy loops beside).
  # KillWait 2 s (default 30 s): srun waits KillWait + 2 s for the lost node's tasks (whose
  # exit can no longer reach it) once the job has ended; the train ranks need no grace period.
  # SchedulerParameters batch_sched_delay=0 (default 3 s): slurmctld schedules batch jobs at
  # most once per batch_sched_delay: a job submitted as the one before it ended (its node still
  # completing) started 3 s later; now within slurmctld's 1 s loop.
  # UnkillableStepTimeout 180 s: the lost node's slurmstepd, back on the network, retries its
  # step-completion message for over a minute and does not answer the kill SLURM sends
  # meanwhile; at the default 60 s SLURM then drains the node ("Kill task failed") under the
  # next test's job
  cat >"$CONF" <<EOF
# $title written by scripts/slurm/local_cluster.sh; state, spool and logs in $DIR.
ClusterName=megatron-pp-local
SlurmctldHost=$NODE($ctld_addr)
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
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$slurmd_log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SlurmctldTimeout=30
SlurmdTimeout=15
AcctGatherNodeFreq=2
MessageTimeout=5
TCPTimeout=2
UnkillableStepTimeout=180
InactiveLimit=0
KillWait=2
$node_lines
PartitionName=debug Nodes=$partition Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

cgroup_mounts() {  # the file systems mounted on and under /sys/fs/cgroup: "TYPE SOURCE DIR OPTS"
  awk '$2 == "/sys/fs/cgroup" || index($2, "/sys/fs/cgroup/") == 1 { print $3, $1, $2, $4 }' \
    /proc/self/mounts
}

start_slurmds() {  # start_slurmds N
  local n=$1 name mounts
  if [ "$n" = 1 ]; then slurmd -f "$CONF"; return 0; fi
  # `ip netns exec` mounts a new /sys (in a mount namespace of its own), without the cgroup file
  # systems under it, and slurmd refuses to start without them (even with proctrack/linuxproc and
  # task/none): they are mounted again there, as here, before slurmd starts.
  mounts=$(cgroup_mounts)
  for name in $(node_names "$n"); do
    mkdir -p "$DIR/spool/$name"
    ip netns exec "$name" bash -c '
      while read -r type src dir opts; do
        [ -n "$type" ] || continue
        [ "$type" != tmpfs ] || opts=mode=755
        mkdir -p "$dir" && mount -t "$type" -o "$opts" "$src" "$dir" || exit 1
      done <<<"$1"
      shift
      exec "$@"' cgroup-mounts "$mounts" slurmd -N "$name" -f "$CONF" \
      || die "slurmd of $name did not start: see $DIR/slurmd-$name.log (then run stop)"
  done
}

up_nodes() {  # up_nodes N: how many of the N nodes are idle, mixed or allocated
  { sinfo -h -N -o '%N %T' 2>/dev/null || true; } \
    | awk 'NR == FNR { ours[$1] = 1; next } ($1 in ours) && $2 ~ /^(idle|mixed|allocated)/ { print $1 }' \
      <(node_names "$1") - | sort -u | wc -l
}

# (|| true: before slurmctld answers, sinfo fails, and under set -e that ended start silently)
node_state() { { sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true; } | head -n 1; }

slurm_logs() {  # slurm_logs N: the daemons' log files
  local name
  echo "$DIR/slurmctld.log"
  if [ "$1" = 1 ]; then echo "$DIR/slurmd.log"
  else for name in $(node_names "$1"); do echo "$DIR/slurmd-$name.log"; done; fi
}

wait_for_nodes() {  # wait_for_nodes N: until all N nodes are up, or die after $WAIT_S s
  local n=$1 t0=$SECONDS state="" up=0 name
  while [ $((SECONDS - t0)) -lt "$WAIT_S" ]; do
    if [ "$n" = 1 ]; then
      state=$(node_state)
      case $state in idle*|mixed*|allocated*) break ;; esac
    else
      up=$(up_nodes "$n")
      [ "$up" -lt "$n" ] || break
      for name in $(node_names "$n"); do
        alive "$(slurmd_pidfile "$name" "$n")" && continue
        [ $((SECONDS - t0)) -lt 5 ] && continue  # slurmd writes its pid file once daemonized
        tail -n 20 "$DIR/slurmd-$name.log" >&2 || true
        die "slurmd of $name is not running: see $DIR/slurmd-$name.log (then run stop)"
      done
    fi
    alive "$DIR/slurmctld.pid" || die "slurmctld exited: see $DIR/slurmctld.log"
    sleep 0.5
  done
  if [ "$n" = 1 ]; then
    case $state in
      idle*|mixed*|allocated*) ;;
      *) tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
         die "node $NODE is '${state:-unknown}' after ${WAIT_S} s (logs above)" ;;
    esac
    log "node $NODE is $state after $((SECONDS - t0)) s"
    log "config: $CONF   logs: $DIR/slurmctld.log $DIR/slurmd.log"
  else
    if [ "$up" -lt "$n" ]; then
      sinfo -N -l >&2 || true
      tail -n 20 $(slurm_logs "$n") >&2 || true
      die "$up of $n nodes up after ${WAIT_S} s (logs above; run stop to remove the network)"
    fi
    all_running "$n" || die "a slurmd exited (node state lags): see $DIR/slurmd-*.log, then run stop"
    log "all $n nodes (${NS_PREFIX}1..$n) are up after $((SECONDS - t0)) s"
    log "config: $CONF   logs: $DIR/slurmctld.log $DIR/slurmd-${NS_PREFIX}<i>.log"
  fi
  log "use it with: export SLURM_CONF=$CONF"
}

stop_slurm() {  # every slurmd whose pid file is in $DIR, then slurmctld
  local pidfile name
  for pidfile in "$DIR"/slurmd.pid "$DIR"/slurmd-*.pid; do
    [ -e "$pidfile" ] || continue
    name=${pidfile##*/slurmd}
    name=${name%.pid}
    stop_pidfile "$pidfile" "slurmd${name:+ ${name#-}}"
  done
  stop_pidfile "$DIR/slurmctld.pid" slurmctld
}

cmd_start() {  # cmd_start N
  local n=$1 prev
  set -o errtrace
  trap 'log "error: start failed at line $LINENO ($BASH_COMMAND); \"$0 stop\" removes what it made"' ERR
  mkdir -p "$DIR"
  install_packages
  start_munge
  prev=$(recorded_nodes)
  if all_running "$prev"; then
    [ "$prev" = "$n" ] || die "a $prev-node cluster is running from $DIR: stop it first to start a $n-node one"
    if [ "$n" = 1 ]; then
      log "already running (slurmctld pid $(cat "$DIR/slurmctld.pid"), slurmd pid $(cat "$DIR/slurmd.pid"))"
    else
      log "already running (slurmctld pid $(cat "$DIR/slurmctld.pid"), $n slurmds)"
    fi
  else
    stop_slurm
    net_down
    echo "$n" >"$NODES_FILE"
    write_conf "$n"
    [ "$n" = 1 ] || net_up "$n"
    # -c: clear what a previous run left in $DIR/state (its jobs, and nodes it drained: -i would
    # only ignore errors reading it, and a node drained there stays drained here)
    slurmctld -c -f "$CONF"
    start_slurmds "$n"
  fi
  wait_for_nodes "$n"
}

cmd_stop() {
  local rc=0
  stop_slurm
  net_down || rc=1
  stop_pidfile "$DIR/munged.pid" munged
  [ "$rc" = 0 ] && rm -f "$NODES_FILE"
  return "$rc"
}

cmd_status() {
  local n name pidfile rc=0
  n=$(recorded_nodes)
  for name in munged slurmctld; do
    if alive "$DIR/$name.pid"; then echo "$name: running (pid $(cat "$DIR/$name.pid"))"
    else echo "$name: not running from $DIR"; [ "$name" = munged ] || rc=1; fi
  done
  if [ "$n" = 1 ]; then
    if alive "$DIR/slurmd.pid"; then echo "slurmd: running (pid $(cat "$DIR/slurmd.pid"))"
    else echo "slurmd: not running from $DIR"; rc=1; fi
  else
    for name in $(node_names "$n"); do
      pidfile=$(slurmd_pidfile "$name" "$n")
      if alive "$pidfile"; then echo "slurmd $name: running (pid $(cat "$pidfile"), in network namespace $name)"
      else echo "slurmd $name: not running from $DIR"; rc=1; fi
    done
    echo "network: bridge $BRIDGE $SUBNET.1/24, namespaces ${NS_PREFIX}1..$n at $(node_addr 1)..$(node_addr "$n")"
  fi
  echo "config: $CONF"
  [ "$rc" = 0 ] && sinfo -N -l || true
  return "$rc"
}

usage() {
  echo "usage: $0 start [--nodes N]|stop|status|env   (state in \$LOCAL_SLURM_DIR, default $DIR)" >&2
  exit 2
}

cmd=${1:-}
[ $# -eq 0 ] || shift
nodes=1
while [ $# -gt 0 ] && [ "$cmd" = start ]; do
  case $1 in
    --nodes) [ $# -ge 2 ] || usage; nodes=$2; shift 2 ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) usage ;;
  esac
done
[ $# -eq 0 ] || usage
[[ $nodes =~ ^[1-9][0-9]*$ ]] || { log "error: --nodes $nodes: want a number >= 1"; usage; }

case $cmd in
  start) cmd_start "$nodes" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) usage ;;
esac
