#!/usr/bin/env bash
# The torchft Lighthouse of a ft.mode=torchft run, kept alive: run it on a
# host outside the compute nodes (the login or service node, beside slurmctld), where no
# node failure reaches it; if it exits it is started again at the same address. The running
# groups outlive that: each retries its quorum (ft.quorum_retries) until the new Lighthouse
# answers, then trains on (docs/reliability.md#torchft: an 11 s pause for a 3 s outage).
#   [FT_HEARTBEAT_TIMEOUT_MS=1000] [FT_JOIN_TIMEOUT_MS=2000] \
#     slurm/ft_lighthouse.sh [PORT] [MIN_REPLICAS]   # default 29510, 1
# then export TORCHFT_LIGHTHOUSE=http://$(hostname):PORT for slurm/ft_group.sbatch.
set -uo pipefail
PORT=${1:-29510}
MIN=${2:-1}
LIGHTHOUSE=${LIGHTHOUSE:-torchft_lighthouse}
# A replica silent for FT_HEARTBEAT_TIMEOUT_MS (1 s; torchft's default 5 s) is dead: the
# quorum after a lost node waits that long, with the survivors, for its heartbeat to stop
# (the groups heartbeat every 0.1 s from a thread of their own; one that misses a second of
# them is left out of a step and heals at the next). A quorum after a change waits at most
# FT_JOIN_TIMEOUT_MS (2 s) for a live straggler before it goes ahead without it.
while true; do
  "$LIGHTHOUSE" --bind "[::]:$PORT" --min_replicas "$MIN" \
    --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-2000}" \
    --heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-1000}" --quorum_tick_ms 100
  echo "ft_lighthouse: the lighthouse exited ($?); starting it again in 1 s" >&2
  sleep 1
done
