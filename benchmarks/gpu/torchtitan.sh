#!/usr/bin/env bash
# torchtitan 0.3.0 (carried in .gpu/whl with its requirements: prepare.sh) at GPT-2 124M's
# shapes on one GPU (tt_gpt2.py says what matches and what does not); prints its median
# tokens/s after the fifth step. Data: this Python's standard library as JSON lines, the
# tokenizer the project's data preparation trained on it (no network).
set -u
. benchmarks/gpu/lib.sh
T=/tmp/tt; mkdir -p $T/data $T/assets
[ -f data/stdlib/tokenizer.json ] || python3 tools/prepare_data.py data=stdlib > $T/prep.log 2>&1
cp data/stdlib/tokenizer.json $T/assets/
python3 - <<'PY'
import json, sysconfig
from pathlib import Path
with open("/tmp/tt/data/train.json", "w") as f:
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
PY
TT_DATA=$T/data TT_ASSETS=$T/assets timeout "${1:-170}" torchrun --standalone --nproc_per_node=1 \
  -m torchtitan.train --module tt_gpt2 --config gpt2_124m --dump_folder $T/out > "$O/tt124.log" 2>&1
python3 - "$O/tt124.log" <<'PY' | { read -r j; figure tt124 "\"torchtitan\": $j"; }
import json, re, statistics, sys
log = open(sys.argv[1], errors="replace").read()
tps = [float(m.group(2).replace(",", "")) for m in
       re.finditer(r"step:\s*(\d+).*?tps:\s*([\d,]+)", log) if int(m.group(1)) > 5]
mfu = [float(m.group(1)) for m in re.finditer(r"mfu:\s*([\d.]+)%", log)]
size = re.search(r"size: ([\d,]+) total parameters", log)
print(json.dumps({"tokens_per_s": round(statistics.median(tps)) if tps else None,
                  "mfu_pct": mfu[-1] if mfu else None,
                  "params": size.group(1) if size else None, "steps_seen": len(tps)}))
PY
tail -2 "$O/tt124.log"
