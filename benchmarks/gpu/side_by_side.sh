#!/usr/bin/env bash
# nanoGPT's train.py and this project at the same shapes on one GPU, in one call, most
# important first (the comparison docs/benchmarks.md keeps per card); each step is skipped
# when the time left (BUDGET seconds, default 540) would not hold it. From the checkout's
# root, carrying .gpu (README.md here):  bash benchmarks/gpu/side_by_side.sh
set -u
. benchmarks/gpu/lib.sh
card | tee "$O/card.txt"
echo "== default run"
( time timeout 100 python3 train.py ) > "$O/default.log" 2>&1
grep -E "val_loss|tok/s" "$O/default.log" | tail -2; tail -3 "$O/default.log"
fits 150 "124M trainer" && bench p124 150 $P124 $C --steps 20 --warmup 5
fits 120 "124M nanoGPT" && ng 120 ng124 \
  "--batch_size=16 --block_size=1024 --gradient_accumulation_steps=4 --max_iters=30" 65536
fits 130 "1.3B bf16" && bench p13 130 $P13 precision=bf16 $C --steps 8 --warmup 3
fits 130 "1.3B fp8" && bench p13fp8 130 $P13 precision=fp8 $C --steps 8 --warmup 3
fits 110 "1.3B nanoGPT" && ng 110 ng13 "--n_layer=24 --n_head=16 --n_embd=2048 --block_size=2048 \
  --batch_size=8 --gradient_accumulation_steps=4 --max_iters=14" 65536
fits 60 "tiny" && bench tiny 60 +recipe=tiny $C --steps 50 --warmup 10
fits 100 "124M document mask" && bench p124doc 100 $P124 model.attention_mask=document $C \
  --steps 10 --warmup 3
echo "elapsed $((SECONDS - S)) s; figures in $O/figures.jsonl"
