"""Benchmark data preparation end to end on a synthetic-but-realistic JSONL corpus.

    python tools/bench_prepare.py --corpus /tmp/corpus/c1300.jsonl --size 1.3G --workers 2

The corpus (built once, reused while its parameters match) is the text this machine holds
locally: the .py/.pyi/.md/.rst/.txt/.h files of the installed site-packages and of the
standard library, streamed in a fixed order and cut into documents of 5-25 KB (about 89k
documents per 1.3 GB); when the text runs out it is streamed again, cut at other places.
Deterministic; written where --corpus says,
never in the repository.

It then prepares the corpus (tools/prepare_data.py, data.source=json, BPE 8192 trained on a
sample) in a fresh output root and prints the wall time, tokens, tokens/s end to end, the
tokenizer-training time, the peak memory (sum over the process tree, and the largest single
process, sampled from /proc), the disk left behind besides the output (in the output root
and the HF datasets cache), and the raw ``encode_batch`` speed on a sample for reference. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.errors import cli

SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt", ".h"}
CORPUS_VERSION = 1


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([\d.]+)\s*([kmgt]?)i?b?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1.3G, 500M)")
    return int(float(m.group(1)) * 1000 ** " kmgt".index(m.group(2) or " "))


def source_files() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])]
    files = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            files += [Path(dirpath) / n for n in names if Path(n).suffix in SUFFIXES]
    return sorted(f for f in files if 0 < f.stat().st_size < 2_000_000)


def _texts(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _cut_documents(files: list[Path], seed: int) -> Iterator[tuple[int, str]]:
    """(pass, document) without end: the files' text run together and cut into documents
    of 5-25 KB, each pass over the files cut at other places (its own seeded lengths)."""
    for rounds in itertools.count():
        rng = random.Random(seed * 1000 + rounds)
        buf, need = [], rng.randint(5_000, 25_000)
        for text in _texts(files):
            buf.append(text)
            have = sum(map(len, buf))
            while have >= need:
                joined = "".join(buf)
                doc, rest = joined[:need], joined[need:]
                yield rounds, doc
                buf, have, need = [rest], len(rest), rng.randint(5_000, 25_000)


def build_corpus(path: Path, size: int, seed: int = 0) -> dict:
    """Write ``size`` bytes (about) of JSONL documents to ``path``, unless already there."""
    meta_path = path.with_name(path.name + ".meta.json")
    meta = {"version": CORPUS_VERSION, "size": size, "seed": seed}
    if path.exists() and meta_path.exists() and json.loads(meta_path.read_text()) == meta:
        return {"corpus": str(path), "reused": True, "bytes": path.stat().st_size}
    files = source_files()
    if not files:
        raise SystemExit("no local text files found to build a corpus from")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    written, docs, rounds = 0, 0, -1
    t0 = time.time()
    documents = _cut_documents(files, seed)
    with open(tmp, "w", encoding="utf-8") as out:
        while written < size:
            rounds, doc = next(documents)
            line = json.dumps({"text": doc, "id": docs}, ensure_ascii=False) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    tmp.rename(path)
    meta_path.write_text(json.dumps(meta))
    return {"corpus": str(path), "reused": False, "bytes": written, "documents": docs,
            "passes": rounds + 1, "build_s": round(time.time() - t0, 1)}


def tree_rss(root_pid: int) -> tuple[int, int]:
    """(sum, max) resident set size in bytes over ``root_pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            pid, ppid = int(entry), int(fields[1])
            rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            children.setdefault(ppid, []).append(pid)
        except (OSError, ValueError, IndexError):
            continue
    total, most, todo = 0, 0, [root_pid]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        most = max(most, rss.get(pid, 0))
        todo += children.get(pid, [])
    return total, most


class PeakSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_sum = self.peak_max = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total, most = tree_rss(self.pid)
            self.peak_sum, self.peak_max = max(self.peak_sum, total), max(self.peak_max, most)
            self.stop.wait(self.interval)


def du(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def raw_encode_speed(tokenizer_json: Path, corpus: Path,
                     sample_bytes: int = 64_000_000) -> tuple[float, float]:
    """Tokens per second and per CPU-second of plain ``Tokenizer.encode_batch`` (all cores)
    on the first MBs of text, read beforehand."""
    code = f"""
import json, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({str(tokenizer_json)!r})
texts, n = [], 0
with open({str(corpus)!r}, encoding="utf-8") as f:
    for line in f:
        texts.append(json.loads(line)["text"]); n += len(line)
        if n >= {sample_bytes}: break
t0, c0 = time.time(), time.process_time(); tokens = 0
for i in range(0, len(texts), 256):
    tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
print(tokens / (time.time() - t0), tokens / (time.process_time() - c0))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS",
                                                           "TOKENIZERS_PARALLELISM")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    wall, cpu = out.stdout.split()
    return float(wall), float(cpu)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="JSONL path (built if missing)")
    p.add_argument("--size", type=parse_size, default=parse_size("1.3G"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="data.root for the prepared output (default: beside the corpus; "
                        "emptied first)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--keep", action="store_true", help="keep the prepared output")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for prepare_data.py")
    return p.parse_args(argv)


def run_prepare(cmd: list[str]) -> dict:
    """Run the preparation, its stderr passed through; exit code, wall and CPU seconds, the
    tokenizer-training and planning times it logs, and the sampled peak memory."""
    print("running: " + " ".join(cmd), file=sys.stderr)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    sampler = PeakSampler(proc.pid)
    sampler.start()
    train_s = plan_s = None
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"tokenizer trained in ([\d.]+) s", line)
        if m:
            train_s = float(m.group(1))
        m = re.search(r"planned .* in ([\d.]+) s", line)
        if m:
            plan_s = float(m.group(1))
    rc = proc.wait()
    wall = time.time() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole (waited-for) tree
    sampler.stop.set()
    sampler.join()
    return {"rc": rc, "wall": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "train_s": train_s, "plan_s": plan_s, "peak_sum": sampler.peak_sum,
            "peak_max": sampler.peak_max}


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    corpus = build_corpus(args.corpus.resolve(), args.size)
    print(f"corpus: {corpus}", file=sys.stderr)
    if args.build_only:
        print(json.dumps(corpus))
        return 0
    root = (args.out or args.corpus.parent / f"prepared-{args.corpus.stem}").resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf_cache = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    cache_before = du(hf_cache / "datasets")

    cmd = [sys.executable, str(REPO / "tools" / "prepare_data.py"), "data=local-text",
           "data.name=bench", "data.source=json", f"data.data_files=[{args.corpus.resolve()}]",
           f"data.root={root}", f"data.tokenizer_vocab_size={args.vocab}",
           "data.validation_fraction=0.005", *args.overrides, "--workers", str(args.workers)]
    load_before = os.getloadavg()
    run = run_prepare(cmd)
    if run["rc"] != 0:
        print(f"prepare_data.py failed with exit code {run['rc']}", file=sys.stderr)
        return run["rc"]
    out_dir = root / "bench"
    index = json.loads((out_dir / "index.json").read_text())
    tokens = sum(s["tokens"] for s in index["splits"].values())
    left = {"hf_datasets_cache_growth": du(hf_cache / "datasets") - cache_before,
            "output_root_besides_output": du(root) - du(out_dir)}
    raw, raw_cpu = raw_encode_speed(out_dir / "tokenizer.json", args.corpus)
    load = os.getloadavg()
    wall, cpu_s = run["wall"], run["cpu_s"]
    result = {
        "corpus_bytes": args.corpus.stat().st_size, "workers": args.workers,
        "wall_s": round(wall, 1), "tokens": tokens, "tokens_per_s": round(tokens / wall),
        # CPU seconds of the whole job: on a shared machine, tokens per CPU-second times the
        # cores gives what an idle machine would do (when the job keeps every core busy).
        "cpu_s": round(cpu_s, 1), "tokens_per_cpu_s": round(tokens / cpu_s),
        "tokenizer_train_s": run["train_s"], "plan_s": run["plan_s"],
        "peak_rss_tree_gb": round(run["peak_sum"] / 1e9, 3),
        "peak_rss_max_process_gb": round(run["peak_max"] / 1e9, 3),
        "output_gb": round(du(out_dir) / 1e9, 3),
        "left_behind_bytes": left, "raw_encode_batch_tokens_per_s": round(raw),
        "raw_encode_batch_tokens_per_cpu_s": round(raw_cpu),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load],
    }
    print(
        f"wall {wall:.1f} s, {tokens:,} tokens, {tokens / wall / 1e6:.2f}M tokens/s end to end, "
        f"tokenizer training {run['train_s']} s, peak RSS {run['peak_sum'] / 1e9:.2f} GB (tree) / "
        f"{run['peak_max'] / 1e9:.2f} GB (one process), raw encode_batch "
        f"{raw / 1e6:.2f}M tokens/s",
        file=sys.stderr,
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
