#!/usr/bin/env bash
# Issue 72's GPU list, most important first, in one call from the checkout's root on the GPU
# machine, carrying .gpu (wheels and nanoGPT's files: README.md here):
#   bash benchmarks/gpu/run.sh            # BUDGET=540 s by default; OUT=/tmp/gpu-bench
# Each step writes its figures to $OUT/figures.jsonl as it ends and is skipped when the time
# left would not hold it. pytest -m gpu runs last, or in a second call (README.md).
set -u
. benchmarks/gpu/lib.sh
card | tee "$O/card.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '
  /H200/ {print "h200-141gb"; exit} /H100/ {print "h100-80gb"; exit} {print "h100-80gb"}')

echo "== 1. the default recipe's step: where the host time goes, graphed and eager"
for g in true false; do
  fits 90 "regions cuda_graphs=$g" && timeout 90 python3 benchmarks/gpu/step_regions.py \
    +recipe=tiny train.compile=true train.cuda_graphs=$g --steps 100 --warmup 20 --json \
    --trace "$O/trace_tiny_graphs_$g.json" > "$O/regions_$g.json" 2> "$O/regions_$g.err" \
    && figure "regions_graphs_$g" "\"regions\": $(tail -1 "$O/regions_$g.json")" \
    || tail -3 "$O/regions_$g.err"
done
fits 60 "tiny eager" && bench tiny_eager 60 +recipe=tiny train.cuda_graphs=false $C --steps 200 --warmup 20
fits 60 "tiny graphed" && bench tiny_graphs 60 +recipe=tiny train.cuda_graphs=true $C --steps 200 --warmup 20
python3 tools/plan.py +recipe=tiny train.cuda_graphs=true --gpu "$GPU" --json 2>/dev/null \
  | python3 -c "import json, sys; d = json.load(sys.stdin); print(json.dumps(
      {'host_s': d['step_model']['host'], 'cuda_graphs': d['cuda_graphs']}))" > "$O/plan_tiny.json" \
  && figure plan_tiny "\"plan\": $(cat "$O/plan_tiny.json")"

echo "== 2. the 10M rung, K streams on the card, one thread each (tools/ladder.py --per-device)"
fits 150 "10M streams" && K=${STREAMS:-4} bash benchmarks/gpu/streams.sh 120 $R10 $C

echo "== 3. GPT-2 124M: this project, nanoGPT's train.py, torchtitan 0.3.0, same shapes"
fits 150 "124M trainer" && bench p124 150 $P124 $C --steps 20 --warmup 5
fits 120 "124M nanoGPT" && ng 120 ng124 \
  "--batch_size=16 --block_size=1024 --gradient_accumulation_steps=4 --max_iters=30" 65536
fits 180 "124M torchtitan" && timeout 180 bash benchmarks/gpu/torchtitan.sh > "$O/tt124.log" 2>&1; \
  tail -3 "$O/tt124.log"

echo "== 4. fp8 against bf16 at 1.3B (batch_ramp=none: the full batch every step)"
fits 130 "1.3B bf16" && bench p13 130 $P13 precision=bf16 $C --steps 8 --warmup 3
fits 130 "1.3B fp8" && bench p13fp8 130 $P13 precision=fp8 $C --steps 8 --warmup 3

echo "== 5. the gpu tier"
fits 200 "pytest -m gpu" && timeout $(( $(left) - 10 )) python3 -m pytest -m gpu -q \
  -p no:cacheprovider --timeout 150 > "$O/pytest_gpu.log" 2>&1; tail -5 "$O/pytest_gpu.log"
echo "elapsed $((SECONDS - S)) s; figures in $O/figures.jsonl"
