#!/usr/bin/env bash
# The torchft Lighthouse of a ft.mode=torchft run, kept alive: run it on a
# host outside the compute nodes (the login or service node, beside slurmctld), where no
# node failure reaches it; if it exits it is started again at the same address. The running
# groups outlive that: each retries its quorum (ft.quorum_retries) until the new Lighthouse
# answers, then trains on (docs/reliability.md#torchft: an 11 s pause for a 3 s outage).
#   slurm/ft_lighthouse.sh [PORT] [MIN_REPLICAS]   # default 29510, 1
# then export TORCHFT_LIGHTHOUSE=http://$(hostname):PORT for slurm/ft_group.sbatch.
set -uo pipefail
PORT=${1:-29510}
MIN=${2:-1}
LIGHTHOUSE=${LIGHTHOUSE:-torchft_lighthouse}
# A replica silent for 2 s is dropped from the quorum (torchft's default 5 s); the others
# wait at most 2 s more for a straggler before a quorum goes ahead without it.
while true; do
  "$LIGHTHOUSE" --bind "[::]:$PORT" --min_replicas "$MIN" --join_timeout_ms 2000 \
    --heartbeat_timeout_ms 2000 --quorum_tick_ms 100
  echo "ft_lighthouse: the lighthouse exited ($?); starting it again in 1 s" >&2
  sleep 1
done
