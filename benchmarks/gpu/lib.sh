# Shared by run.sh and side_by_side.sh (sourced from the checkout's root on the GPU machine):
# the wheels on the path, a time budget, and one function per kind of measurement. Each
# measurement prints its figure and appends it as a JSON line to $O/figures.jsonl.
. benchmarks/gpu/setup.sh
O=${OUT:-/tmp/gpu-bench}; mkdir -p "$O"; B0=${BUDGET:-540}; S=$SECONDS
left() { echo $(( B0 - (SECONDS - S) )); }
fits() { [ "$(left)" -gt "$1" ] || { echo "skipped (needs $1 s, $(left) left): $2"; false; }; }
figure() { echo "{\"step\": \"$1\", \"commit\": \"$(git rev-parse --short HEAD 2>/dev/null)\", $2}" \
  | tee -a "$O/figures.jsonl"; }
# the recipe overrides every bench run shares: the embedded corpus, a padded vocab, no epoch cap
C="data=stdlib model.pad_vocab_to=128 data.max_epochs=1000000 train.compile=true --modes trainer"
P124="+recipe=gpt2-124m parallel.micro_batch_size=16 train.global_batch_size=64 precision=bf16"
P13="+recipe=gpt3-1.3b parallel.micro_batch_size=8 train.global_batch_size=32 batch_ramp=none"
R10="model.d_model=320 model.n_layer=8 model.n_head=5 model.seq_len=512 \
parallel.micro_batch_size=32 train.global_batch_size=32 budget=steps budget.steps=100000 \
schedule.warmup_steps=10"

card() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"
}

# bench NAME SECONDS OVERRIDES... : tools/bench.py in its own process, its JSON line kept
bench() {
  local n=$1 t=$2; shift 2
  timeout "$t" python3 tools/bench.py "$@" --json > "$O/$n.jsonl" 2> "$O/$n.err"
  local j; j=$(tail -1 "$O/$n.jsonl")
  [ -n "$j" ] && figure "$n" "\"bench\": $j" || { echo "$n failed:"; tail -3 "$O/$n.err"; }
}

# nanoGPT's train.py (.gpu/peer/) on random tokens at the given shapes: median iteration
# time after the fifth -> tokens/s.  ng SECONDS NAME "FLAGS" TOKENS_PER_ITER
ng_data() {
  mkdir -p /tmp/ng/data/bench && cp .gpu/peer/*.py /tmp/ng/ && (cd /tmp/ng && python3 -c "
import numpy as np; r = np.random.default_rng(0)
for s, n in (('train', 20_000_000), ('val', 1_000_000)):
    r.integers(0, 50257, size=n, dtype=np.uint16).tofile(f'data/bench/{s}.bin')")
}
ng() {
  [ -f /tmp/ng/train.py ] || ng_data
  (cd /tmp/ng && timeout "$1" python3 train.py --dataset=bench --eval_interval=100000 \
     --eval_iters=1 --log_interval=1 --compile=True --wandb_log=False $3 > "$O/$2.log" 2>&1)
  local tps; tps=$(python3 -c "
import re, statistics
t = [float(m.group(2)) for m in re.finditer(r'iter (\d+): loss [\d.]+, time ([\d.]+)ms',
     open('$O/$2.log').read()) if int(m.group(1)) >= 5]
print(round($4 / statistics.median(t) * 1000) if t else 'null')")
  figure "$2" "\"nanogpt_tokens_per_s\": $tps"
}
