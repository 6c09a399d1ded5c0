#!/usr/bin/env bash
# K bench processes of one recipe on one GPU at once, each with one CPU thread (as
# `tools/ladder.py --per-device K` runs its streams): aggregate tokens/s and MFU.
#   K=4 bash benchmarks/gpu/streams.sh SECONDS OVERRIDES...     (sourced lib.sh's $O)
set -u
. benchmarks/gpu/lib.sh
t=$1; shift; K=${K:-4}
for i in $(seq 1 "$K"); do
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout "$t" python3 tools/bench.py "$@" \
    --steps 300 --warmup 30 --json > "$O/stream$i.jsonl" 2> "$O/stream$i.err" &
done
wait
python3 - "$O" "$K" <<'PY' | { read -r j; figure "streams_$K" "\"streams\": $j"; }
import json, sys
rows = [json.loads(open(f"{sys.argv[1]}/stream{i}.jsonl").read().splitlines()[-1])
        for i in range(1, int(sys.argv[2]) + 1)]
print(json.dumps({"k": len(rows), "tokens_per_s": [r["tokens_per_s"] for r in rows],
                  "total_tokens_per_s": round(sum(r["tokens_per_s"] for r in rows)),
                  "aggregate_mfu": round(sum(r["mfu"] for r in rows), 4),
                  "threads": [r["threads"] for r in rows]}))
PY
