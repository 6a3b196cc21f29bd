#!/usr/bin/env bash
# A throw-away Slurm cluster on this one machine: slurmctld and two slurmd (two nodes), configured
# under DIR (SLURM_CONF=DIR/slurm.conf), nothing written to /etc, no munge (auth/none). For trying
# launch/slurm/train.sbatch without a cluster, and for tests/tools/test_slurm.py.
#
#   bash launch/slurm/local_cluster.sh start DIR         # prints the SLURM_CONF to export, exit 0 once both nodes are idle
#   SLURM_CONF=DIR/slurm.conf sbatch --cpus-per-task=2 launch/slurm/train.sbatch model=tiny parallel=tp
#   bash launch/slurm/local_cluster.sh stop DIR          # cancels the jobs, stops every daemon by pid
#   bash launch/slurm/local_cluster.sh run DIR -- CMD... # start, run CMD with SLURM_CONF set, stop (however CMD ends)
#
# Settings (environment): LOCAL_CLUSTER_CPUS (CPUs each node declares, default 2; a node may claim
# more than the machine has: SlurmdParameters=config_overrides), LOCAL_CLUSTER_TIMEOUT (seconds to
# wait for the nodes, default 30). Needs Debian's slurm-wlm (22.05; built with multiple-slurmd
# support, so one host can run several slurmd -N NAME). The first node is named after `hostname -s`:
# the batch script runs there and torchrun's c10d rendezvous host must be this machine's own name.
# Jobs' final states go to DIR/jobcomp.txt (jobcomp/filetxt): `sbatch --wait` exits 0 even for a
# cancelled job, so read the state there.
set -euo pipefail

usage() { echo "usage: $0 start DIR | stop DIR | run DIR -- CMD..." >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
conf=$dir/slurm.conf
cpus=${LOCAL_CLUSTER_CPUS:-2}
timeout=${LOCAL_CLUSTER_TIMEOUT:-30}
export SLURM_CONF=$conf

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

node_names() {
    local host; host=$(hostname -s)
    echo "$host" "$host-n1"
}

write_conf() {
    local user host; user=$(id -un); host=$(hostname -s)
    mkdir -p "$dir/state" "$dir/log" "$dir/spool"
    cat > "$conf" <<EOF
# Written by launch/slurm/local_cluster.sh: a throw-away cluster, removed with its directory.
ClusterName=sandbox
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MinJobAge=5
KillWait=5
ReturnToService=2
SlurmdParameters=config_overrides
EOF
    local name
    for name in $(node_names); do
        echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN" >> "$conf"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$conf"
}

# Every pid this cluster started: the daemons (their pid files) and anything running with this
# SLURM_CONF in its environment (slurmstepd and the jobs' processes), except this script and its callers.
cluster_pids() {
    local f pid ancestors=" " p=$$
    while [ "$p" -gt 1 ] 2>/dev/null; do
        ancestors+="$p "
        p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || echo 0)
    done
    for f in "$dir"/*.pid; do
        [ -f "$f" ] && pid=$(cat "$f") && [ -d "/proc/$pid" ] && echo "$pid"
    done
    for f in /proc/[0-9]*/environ; do
        pid=${f#/proc/}; pid=${pid%/environ}
        [[ $ancestors == *" $pid "* ]] && continue
        { tr '\0' '\n' < "$f"; } 2>/dev/null | grep -qxF "SLURM_CONF=$conf" && echo "$pid"
    done
    return 0
}

stop() {
    [ -f "$conf" ] || return 0
    if [ -f "$dir/slurmctld.pid" ] && [ -d "/proc/$(cat "$dir/slurmctld.pid")" ]; then
        timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
        local deadline=$((SECONDS + 15))
        while [ $SECONDS -lt $deadline ] && [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ]; do sleep 0.5; done
    fi
    local pids deadline
    pids=$(cluster_pids | sort -u)
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while [ $SECONDS -lt $deadline ] && [ -n "$(cluster_pids)" ]; do sleep 0.2; done
    pids=$(cluster_pids | sort -u)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    rm -f "$dir"/*.pid
    echo "local_cluster: stopped ($dir)" >&2
}

start() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        || { echo "local_cluster: slurmctld/slurmd not found: apt-get install slurm-wlm" >&2; exit 1; }
    [ -f "$dir/slurmctld.pid" ] && [ -d "/proc/$(cat "$dir/slurmctld.pid")" ] \
        && { echo "local_cluster: already running in $dir (stop it first)" >&2; exit 1; }
    trap 'echo "local_cluster: start failed, stopping what started" >&2; tail -n 5 "$dir"/log/*.log >&2 || true; stop' ERR
    write_conf
    slurmctld
    local name
    for name in $(node_names); do slurmd -N "$name"; done
    local deadline=$((SECONDS + timeout)) states=""
    while [ $SECONDS -lt $deadline ]; do
        states=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true)
        [ "$(grep -c ' idle$' <<< "$states")" -eq 2 ] && break
        sleep 0.5
    done
    if [ "$(grep -c ' idle$' <<< "$states")" -ne 2 ]; then
        echo "local_cluster: the nodes are not idle after ${timeout} s: ${states:-no answer from slurmctld}" >&2
        false
    fi
    trap - ERR
    echo "local_cluster: 2 nodes ($(node_names | tr ' ' ',')) x $cpus CPUs up; export SLURM_CONF=$conf" >&2
}

case $action in
    start) start ;;
    stop) stop ;;
    run)
        shift 2
        [ "${1:-}" = "--" ] && shift
        [ $# -ge 1 ] || usage
        trap stop EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        start
        "$@"
        ;;
    *) usage ;;
esac
