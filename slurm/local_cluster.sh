#!/usr/bin/env bash
# A throw-away Slurm on this machine, for tests and for rehearsing a cluster launch on a
# workstation: munged, MariaDB + slurmdbd (sacct, and submitit's view of dead jobs need
# accounting), slurmctld and one slurmd per node, from Debian's packages.
#
#   slurm/local_cluster.sh start     # install if missing (root), configure, start: ~15 s
#   slurm/local_cluster.sh start --nodes 4   # four nodes n1..n4, one slurmd each
#   eval "$(slurm/local_cluster.sh env)"   # export SLURM_CONF for sbatch/srun/sacct
#   slurm/local_cluster.sh status
#   slurm/local_cluster.sh kill-node n2     # a node lost: its slurmd and its job processes, -9
#   slurm/local_cluster.sh revive-node n2   # its slurmd again (the node returns to service)
#   slurm/local_cluster.sh start --nodes 2 --netns   # each node its own network namespace
#   slurm/local_cluster.sh cut-node n2      # (--netns) n2's link down: it lives, unreachable
#   slurm/local_cluster.sh restore-node n2
#   slurm/local_cluster.sh stop      # stops every daemon by its recorded PID, removes state
#
# One node (the default) is this host under its own name. With --nodes N (or
# SLURM_LOCAL_NODES=N) the nodes are n1..nN: N slurmd daemons (`slurmd -N nI`), each on its
# own port, with %n in their per-node paths; the CPUs are split between them (at least one
# each), so jobs of several nodes really spread. They share this host's address (127.0.0.1),
# so the first node's address, the rendezvous, is NodeAddr from `scontrol show node`.
#
# Everything (configs, spool, database, logs, PIDs) lives in one state directory,
# $SLURM_LOCAL_DIR (default /tmp/pretrain-slurm); `start` on a dead cluster begins afresh,
# so job ids restart at 1. Daemons run in the foreground (-F / -D) in the background of
# this script, never as system services (there is no systemd here). Ports (all on
# 127.0.0.1), from SLURM_LOCAL_PORT (default 6817): slurmctld that, slurmd of node I that
# + 1 + 10 (I - 1) (6818, 6828, ...), slurmdbd that + 2 (6819); MariaDB SLURM_LOCAL_DB_PORT
# (default 3306). Two clusters side by side: another state dir and other ports, e.g.
#   SLURM_LOCAL_DIR=/tmp/slurm4 SLURM_LOCAL_PORT=7817 SLURM_LOCAL_DB_PORT=3406 \
#     slurm/local_cluster.sh start --nodes 4
# Why a setting is what it is:
# the comments in write_configs below (found with Debian 12's Slurm 22.05, as root, without
# systemd or cgroups).
set -euo pipefail

STATE=${SLURM_LOCAL_DIR:-/tmp/pretrain-slurm}
CLUSTER=${SLURM_LOCAL_CLUSTER:-pretrain-local}
PORT=${SLURM_LOCAL_PORT:-6817}
DB_PORT=${SLURM_LOCAL_DB_PORT:-3306}
NODES=${SLURM_LOCAL_NODES:-}  # set by --nodes; else what the running cluster was started with
NETNS=${SLURM_LOCAL_NETNS:-}  # 1 (--netns): each node in its own network namespace
# --netns: the nodes' addresses, SUBNET.11, .12, ... on a bridge at SUBNET.1 (this host)
SUBNET=${SLURM_LOCAL_SUBNET:-10.$((PORT % 250)).0}
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
SERVICES=(munged mariadbd slurmdbd slurmctld)  # start order, then the slurmds; stop: reverse

die() { echo "local_cluster: $*" >&2; exit 1; }
log() { echo "local_cluster: $*" >&2; }

pid_of() { cat "$STATE/pids/$1.pid" 2>/dev/null || true; }
# The node names: this host's short name for one node, n1..nN for more.
nodes_count() { cat "$STATE/nodes" 2>/dev/null || echo "${NODES:-1}"; }
node_names() {
  local n i
  n=$(nodes_count)
  if ((n == 1)); then hostname -s; return; fi
  for ((i = 1; i <= n; i++)); do echo "n$i"; done
}
slurmd_port() { echo $((PORT + 1 + 10 * ($1 - 1))); }
netns_on() { [[ $(cat "$STATE/netns" 2>/dev/null || echo "${NETNS:-0}") == 1 ]]; }
ns_of() { echo "pr$PORT-$1"; }      # node nI's network namespace
veth_of() { echo "pv$PORT-${1#n}"; }  # its link's end on this host (on the bridge)
BRIDGE=prb$PORT

# With --netns, node nI runs in namespace pr<port>-nI with address SUBNET.(10+I) on eth0, a
# veth pair to the bridge prb<port> (SUBNET.1, where slurmctld is reached): a node whose link
# is cut (cut-node: its host end set down) is unreachable, as over a failed switch port.
make_network() {
  local n=$1 i ns veth
  ip link add "$BRIDGE" type bridge && ip addr add "$SUBNET.1/24" dev "$BRIDGE" &&
    ip link set "$BRIDGE" up || die "could not make bridge $BRIDGE (root, ip from iproute2)"
  { echo "127.0.0.1 localhost"; echo "$SUBNET.1 $(hostname -s)"
    for ((i = 1; i <= n; i++)); do echo "$SUBNET.$((10 + i)) n$i"; done; } >"$STATE/etc/hosts"
  for ((i = 1; i <= n; i++)); do
    ns=$(ns_of "n$i") veth=$(veth_of "n$i")
    ip netns add "$ns" && ip link add "$veth" type veth peer name eth0 netns "$ns" &&
      ip link set "$veth" master "$BRIDGE" && ip link set "$veth" up &&
      ip netns exec "$ns" ip addr add "$SUBNET.$((10 + i))/24" dev eth0 &&
      ip netns exec "$ns" ip link set eth0 up && ip netns exec "$ns" ip link set lo up ||
      die "could not make network namespace $ns"
  done
}

# Every namespace and host link of this port's clusters, whatever the node count recorded:
# `ip netns del` only unlinks a namespace that a process still lives in (a rank or a step
# not reaped yet), and its veth stayed on the host until then, so the next start failed
# ("File exists"). Deleting a veth's host end deletes its pair.
remove_network() {
  local name
  for name in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
                grep "^pv$PORT-"); do
    ip link del "$name" 2>/dev/null || true
  done
  for name in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^pr$PORT-"); do
    ip netns del "$name" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}
# Every daemon in start order: the services, then slurmd (one node) or slurmd-nI.
daemons() {
  local n i
  n=$(nodes_count)
  echo "${SERVICES[@]}"
  if ((n == 1)); then echo slurmd; else for ((i = 1; i <= n; i++)); do echo "slurmd-n$i"; done; fi
}
# A zombie is not alive: a killed daemon (kill-node) stays one until something reaps it, and
# this container's PID 1 may take minutes (revive-node right after kill-node saw "n2 is up").
alive() { local pid; pid=$(pid_of "$1"); [[ -n "$pid" ]] && running "$pid"; }
running() { kill -0 "$1" 2>/dev/null && [[ $(ps -o stat= -p "$1" 2>/dev/null) != Z* ]]; }

# wait_for SECONDS WHAT CMD...: poll CMD every 0.2 s; fail with the daemon logs.
wait_for() {
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      tail -n 20 "$STATE"/log/*.log >&2 || true
      die "timed out after ${secs}s waiting for $what"
    fi
    sleep 0.2
  done
}

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ $(id -u) == 0 ]] || die "Slurm packages missing (${missing[*]}) and not root: install them with apt-get"
  command -v apt-get >/dev/null || die "Slurm packages missing (${missing[*]}) and no apt-get (Debian/Ubuntu only)"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; }
}

write_configs() {
  local host nproc mem n=$NODES cpus i nodes_lines="" names
  host=$(hostname -s)
  # the machine's CPUs: nproc counts OMP_NUM_THREADS (1 in a pytest-xdist worker), and a
  # node with fewer CPUs than a job asks for never runs it
  nproc=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
  mem=$((mem * 9 / 10))  # no more than slurmd -C reports, or the node is drained
  mkdir -p "$STATE"/{etc,log,pids,run,spool/ctld,munge,mysql}
  echo "$n" >"$STATE/nodes"
  echo "${NETNS:-0}" >"$STATE/netns"
  local ctld_addr=127.0.0.1
  netns_on && ctld_addr=$SUBNET.1
  if ((n == 1)); then
    mkdir -p "$STATE/spool/d"
    nodes_lines="NodeName=$host NodeAddr=127.0.0.1 CPUs=$nproc RealMemory=$mem State=UNKNOWN"
    names=$host
  else
    # The CPUs and memory shared out (a node with more than this host has would be drained);
    # each node its own port, all this host's name and address.
    cpus=$((nproc / n)); ((cpus >= 1)) || cpus=1
    for ((i = 1; i <= n; i++)); do
      mkdir -p "$STATE/spool/d-n$i"
      nodes_lines+="NodeName=n$i NodeHostname=$host NodeAddr=$(
        netns_on && echo "$SUBNET.$((10 + i))" || echo 127.0.0.1) Port=$(slurmd_port "$i")"
      nodes_lines+=" CPUs=$cpus RealMemory=$((mem / n)) State=UNKNOWN"$'\n'
    done
    names="n[1-$n]"
  fi
  chmod 700 "$STATE" "$STATE/munge"
  cat >"$STATE/etc/slurm.conf" <<EOF
# Generated by slurm/local_cluster.sh: a throw-away cluster of $n node(s) on this host.
ClusterName=$CLUSTER
SlurmctldHost=$host($ctld_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime: a requeued job may start only once its old credential has
# expired (cred_expire + 1 s; the default 120 s made it wait ~3 min). 5 is Slurm's minimum.
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=5
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$STATE/spool/ctld
# %n: the node's name, so several slurmd daemons on one host keep apart (one node: its own).
SlurmdSpoolDir=$STATE/spool/$( ((n == 1)) && echo d || echo 'd-%n')
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd$( ((n == 1)) || echo '-%n').log
# No cgroups in this sandbox: track processes by /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule within seconds of a submission or a requeue (the defaults wait up to 60 s).
SchedulerParameters=sched_interval=2,bf_interval=1
JobRequeue=1
# A node whose slurmd stops answering is DOWN after 10 s (default 300), its jobs then end.
SlurmdTimeout=10
# No mail here; and a cancelled job is killed 2 s after SIGTERM, not 30.
MailProg=/bin/true
KillWait=2
ReturnToService=2
MinJobAge=600
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
# Accounting (slurmdbd + MariaDB) so that sacct works: without it submitit cannot learn the
# state of a job that died without writing a result, and job.result() waits forever.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
# slurmctld reaches slurmdbd through the same munge socket.
AccountingStoragePass=$STATE/munge/munge.socket
# The node(s), on 127.0.0.1; RealMemory above what slurmd -C reports would drain a node.
$nodes_lines
PartitionName=local Nodes=$names Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$STATE/etc/slurmdbd.conf" <<EOF
# Generated by slurm/local_cluster.sh. Must be mode 600 and beside slurm.conf.
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$((PORT + 2))
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
EOF
  chmod 600 "$STATE/etc/slurmdbd.conf"
  echo "export SLURM_CONF=$STATE/etc/slurm.conf" >"$STATE/env.sh"
}

# spawn NAME CMD...: start a foreground daemon in the background, record its PID.
spawn() {
  local name=$1; shift
  setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name.pid"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

all_alive() { local d; for d in $(daemons); do alive "$d" || return 1; done; }

start_slurmd() {  # start_slurmd NODE_NAME: its slurmd (one node: plain slurmd)
  if [[ $(cat "$STATE/nodes") == 1 ]]; then spawn slurmd slurmd -D
  # A host of its own: its network namespace, and a hostname (nI) that resolves, in its view
  # of /etc/hosts, to its address, as on a cluster (torchrun's rendezvous host finds itself
  # so). nsenter, not `ip netns exec`: that one mounts a sysfs of its own, without
  # /sys/fs/cgroup, and slurmd then refuses to start.
  elif netns_on; then
    spawn "slurmd-$1" unshare --uts --mount --propagation private sh -c \
      'hostname "$1" && mount --bind "$2" /etc/hosts && exec nsenter --net="$3" slurmd -D -N "$1"' \
      sh "$1" "$STATE/etc/hosts" "/run/netns/$(ns_of "$1")"
  else spawn "slurmd-$1" slurmd -D -N "$1"; fi
}

start() {
  local want=${NODES:-1}
  if [[ -f $STATE/nodes ]] && all_alive; then
    if [[ $(cat "$STATE/nodes") != "$want" ]]; then
      die "a cluster of $(cat "$STATE/nodes") node(s) already runs in $STATE (stop it first, or set SLURM_LOCAL_DIR and SLURM_LOCAL_PORT for another)"
    fi
    log "already running (state in $STATE)"; env_line; return 0
  fi
  [[ $want =~ ^[1-9][0-9]*$ ]] || die "--nodes $want: a positive number"
  [[ ${NETNS:-0} != 1 ]] || ((want > 1)) || die "--netns needs --nodes 2 or more"
  stop_daemons
  netns_on && remove_network
  rm -rf "$STATE"
  NODES=$want
  install_packages
  write_configs
  export SLURM_CONF=$STATE/etc/slurm.conf
  local t0=$SECONDS
  if netns_on; then make_network "$NODES"; fi  # slurmctld is reached at the bridge's address

  dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/munge/munge.key"
  spawn munged munged -F --force --key-file="$STATE/munge/munge.key" \
    --socket="$STATE/munge/munge.socket" --pid-file="$STATE/run/munged.pid" \
    --seed-file="$STATE/munge/munged.seed" --log-file="$STATE/log/munged.log"
  wait_for 10 munged test -S "$STATE/munge/munge.socket"

  mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" \
    --auth-root-authentication-method=normal --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 ||
    die "mariadb-install-db failed: see $STATE/log/mariadb-install.log"
  spawn mariadbd mariadbd --no-defaults --user=root --datadir="$STATE/mysql" \
    --socket="$STATE/run/mysqld.sock" --port="$DB_PORT" --bind-address=127.0.0.1 \
    --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadb.log" \
    --skip-log-bin --innodb-buffer-pool-size=64M --innodb-flush-log-at-trx-commit=0
  wait_for 30 MariaDB port_open "$DB_PORT"

  spawn slurmdbd slurmdbd -D
  wait_for 30 slurmdbd port_open $((PORT + 2))
  spawn slurmctld slurmctld -D -i
  wait_for 30 slurmctld scontrol ping
  local name
  for name in $(node_names); do start_slurmd "$name"; done
  wait_for 30 "$NODES idle node(s)" bash -c \
    "[[ \$(sinfo -h -N -t idle -o %N | sort -u | wc -l) == $NODES ]]"
  wait_for 30 "accounting (sacct)" sacct -n -X
  log "up in $((SECONDS - t0)) s: $(sinfo -h -o '%P %D node(s) %N, %c CPUs a node, %m MB, %T')"
  env_line
}

# stop_group NAME...: SIGTERM to each at once, then wait (5 s at most) for all of them.
stop_group() {
  local name pid pids=() names=() alive_pids=()
  for name in "$@"; do
    pid=$(pid_of "$name")
    [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null && { pids+=("$pid"); names+=("$name"); }
    rm -f "$STATE/pids/$name.pid"
  done
  for _ in $(seq 50); do
    alive_pids=()
    for pid in "${pids[@]}"; do running "$pid" && alive_pids+=("$pid"); done
    ((${#alive_pids[@]})) || return 0
    sleep 0.1
  done
  log "${names[*]}: ${alive_pids[*]} ignored TERM, killing"
  kill -KILL "${alive_pids[@]}" 2>/dev/null || true
}

# In reverse start order, each layer at once: the slurmds and slurmctld (their last words go
# to slurmdbd), then slurmdbd (to MariaDB, through munge), then MariaDB and munged. One at a
# time it took 11-19 s.
stop_daemons() {
  local all
  read -ra all <<<"$(daemons | tr '\n' ' ')"
  stop_group "${all[@]:4}" slurmctld
  stop_group slurmdbd
  stop_group mariadbd munged
}

stop() {
  [[ -d "$STATE" ]] || { log "not running (no $STATE)"; return 0; }
  stop_daemons
  netns_on && remove_network
  rm -rf "$STATE"
  log "stopped"
}

status() {
  local name rc=0
  [[ -f $STATE/nodes ]] || { echo "not running (no $STATE)"; return 1; }
  for name in $(daemons); do
    if alive "$name"; then echo "$name: running (pid $(pid_of "$name"))"; else echo "$name: stopped"; rc=1; fi
  done
  if ((rc == 0)); then SLURM_CONF=$STATE/etc/slurm.conf sinfo; fi
  return $rc
}

env_line() { echo "export SLURM_CONF=$STATE/etc/slurm.conf"; }

# The processes a node runs for jobs: each job step's slurmstepd (it holds the node's log
# or spool files open) and the step's tasks (SLURMD_NODENAME in their environment), with
# their children.
node_processes() {
  local node=$1 spool="$STATE/spool/d-$1" pid fd
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ $pid == "$$" ]] && continue
    if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "SLURMD_NODENAME=$node"; then
      echo "$pid"; continue
    fi
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]]; then
      for fd in /proc/"$pid"/fd/*; do
        case $(readlink "$fd" 2>/dev/null) in
          "$spool"/* | "$STATE/log/slurmd-$node.log") echo "$pid"; break ;;
        esac
      done
    fi
  done
}

# kill-node NAME: the node is lost at once, as when it loses power: its slurmd and every
# process of its job steps get SIGKILL (no handler runs, nothing is saved, sockets close).
kill_node() {
  local node=${1:?kill-node NAME} pids when
  [[ -f $STATE/pids/slurmd-$node.pid ]] || die "no node $node in $STATE (multi-node clusters only)"
  pids=$(node_processes "$node" | tr '\n' ' ')  # found first: the kill itself is one moment
  when=$(date '+%Y-%m-%d %H:%M:%S.%3N')
  kill -KILL "$(pid_of "slurmd-$node")" $pids 2>/dev/null || true
  log "killed node $node at $when: slurmd and process(es) ${pids:-none}"
}

# revive-node NAME: its slurmd again; the node returns to service (ReturnToService=2).
revive_node() {
  local node=${1:?revive-node NAME}
  [[ -f $STATE/pids/slurmd-$node.pid ]] || die "no node $node in $STATE (multi-node clusters only)"
  alive "slurmd-$node" && { log "$node is up"; return 0; }
  export SLURM_CONF=$STATE/etc/slurm.conf
  start_slurmd "$node"
  wait_for 40 "$node in service" node_in_service "$node"
  log "$node is back"
}

# In service: up and answering (a job queued for it may already have it: not only idle).
node_in_service() {
  sinfo -h -n "$1" -o %T | grep -qxE 'idle|mixed|allocated|completing|planned'
}

# cut-node NAME / restore-node NAME (--netns clusters): its link to the others down or up; the
# node and its processes live on, unreachable (no connection closes: peers time out).
link_node() {
  local node=${1:?cut-node NAME} when
  netns_on || die "cut-node needs a cluster started with --netns"
  [[ -f $STATE/pids/slurmd-$node.pid ]] || die "no node $node in $STATE"
  when=$(date '+%Y-%m-%d %H:%M:%S.%3N')
  ip link set "$(veth_of "$node")" "$2" || die "could not set $node's link $2"
  log "$node's link $2 at $when"
  if [[ $2 == up ]]; then  # back in service once slurmctld hears from it again
    export SLURM_CONF=$STATE/etc/slurm.conf
    # SIGHUP: slurmd re-reads its config and registers at once (ReturnToService=2 brings a
    # DOWN node back on registration); else slurmctld asks a DOWN node only now and then
    # (a restore waited up to 19 s for it).
    kill -HUP "$(pid_of "slurmd-$node")" 2>/dev/null || true
    wait_for 60 "$node in service" node_in_service "$node"
    log "$node is back"
  fi
}

cmd=${1:-}; shift || true
while (($#)); do
  case $1 in
    --nodes) NODES=${2:?--nodes N}; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    --netns) NETNS=1; shift ;;
    *) break ;;
  esac
done
case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) env_line ;;
  install) install_packages ;;
  kill-node) kill_node "$@" ;;
  revive-node) revive_node "$@" ;;
  cut-node) link_node "$1" down ;;
  restore-node) link_node "$1" up ;;
  *) echo "usage: $0 start [--nodes N] [--netns]|stop|status|env|install|kill-node NAME|revive-node NAME|cut-node NAME|restore-node NAME  (state dir: $STATE)" >&2; exit 2 ;;
esac
