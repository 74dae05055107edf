"""Prepared data at scale: preparing a corpus, a peer's memory over it, a joining peer's first step, and the
windows a swarm reads across a plan change, each against its reference from the same run.

    python3 benchmarks/data.py [--gb 5] [--work DIR] [--part prepare|memory|join|windows|all] [--json]

- corpus: `--gb` GB of generated .jsonl text (documents of Zipf-distributed pseudo-words, each numbered so
  none repeats), written once into --work and reused; a byte-level BPE tokenizer (16,384 ids, with
  <|endoftext|>) trained on its first 16 MB.
- prepare: `hetpeer data prepare` of the whole corpus with that tokenizer, one process a core, in MB/s of
  input. Reference: the tokenizer's own `encode_batch` in one process with TOKENIZERS_PARALLELISM off, on
  the corpus's first 64 MB, times the cores. Goal: at least 80% of it.
- memory: a fresh process builds a model (the tiny GPT with the tokenizer's vocabulary and 512-token
  sequences) and its AdamW, then reads every training window of the prepared corpus in the swarm's order
  through the peer's reader (`ShardedCorpus`), 64 a batch, taking an optimizer step on 4 of them every
  1,000 batches; its resident memory is sampled every 200 batches. Reference: the same process's resident
  memory after its first step. Goal: growth under 200 MB, flat (the last quarter's peak no higher than the
  first's plus 10 MB).
- join: a coordinator serves a bytes-prepared corpus (the first GB of the same text) through a proxy that
  sends at most 100 Mbit/s (user-space token bucket); one peer joins with no data and trains. Measured:
  from the peer's start to its first step, and from its plan (data opened) to its first step, with the MiB
  it downloaded. Reference: the same peer joining with the prepared folder on its disk, same run. Goal:
  under 10 s from join to first step including the download.
- windows: `hetpeer swarm` on the bytes-prepared corpus, 30 steps at batch 16 and stopped, then resumed for
  30 more at batch 12 (plans of another shape), counting the positions of the swarm's order that its
  first-stage peers read twice or never. Goal: 0.

The last line with --json is every figure as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
PROXY_RATE_BYTES_PER_S = 100e6 / 8
MEMORY_PROBE = r"""
import json, os, sys, time
from dataclasses import replace
import numpy as np, torch
from hetpeer.peer.data.fetch import ShardStore
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.peer.model import build_stage
from hetpeer.protocol.dataset import read_folder
from hetpeer.protocol.modelspec import PRESETS

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

folder, batch = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
manifest, name = read_folder(folder)
spec = replace(PRESETS["tiny"], vocab=manifest.vocab, seq_len=512, name="tiny-bpe")
model = build_stage(spec, 0, spec.layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = ShardedCorpus(ShardStore(manifest, name, local=__import__("pathlib").Path(folder)), folder)
def train(b):  # a micro-batch of 4 of the batch's sequences: a peer's step, with activations of a bounded size
    optimizer.zero_grad()
    loss = model.loss(model(torch.from_numpy(b.tokens[:4])), torch.from_numpy(b.labels[:4])); loss.backward(); optimizer.step()
    return loss

loss = train(data.batch(0, batch, spec.seq_len))
base = rss()
windows = data.windows(spec.seq_len)
samples, steps, started = [], 0, time.perf_counter()
for i, position in enumerate(range(0, windows - batch + 1, batch)):
    b = data.batch(position, batch, spec.seq_len)
    if i % 1000 == 0:
        loss = train(b)
        steps += 1
    if i % 200 == 0:
        samples.append(rss())
samples.append(rss())
print(json.dumps({"base": base, "samples": samples, "windows": windows, "steps": steps, "loss": float(loss),
                  "seconds": time.perf_counter() - started}))
"""


def say(text: str) -> None:
    print(text, flush=True)


# -- the corpus -------------------------------------------------------------------------------------------
def make_corpus(folder: Path, gb: float) -> int:
    """`gb` GB of .jsonl in files of about 64 MB; returns the bytes written (reused when already there)."""
    done = folder / ".complete"
    if done.is_file() and json.loads(done.read_text())["gb"] == gb:
        return json.loads(done.read_text())["bytes"]
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1 / np.arange(1, 27) ** 0.9
    words = ["".join(rng.choice(letters, size=int(rng.integers(1, 10)), p=weights / weights.sum())) for _ in range(20_000)]
    zipf = 1 / np.arange(1, len(words) + 1) ** 1.07
    zipf /= zipf.sum()
    pool = []
    for _ in range(4000):  # documents of 50 to 400 words, recombined below so that no document repeats
        picked = rng.choice(len(words), size=int(rng.integers(50, 400)), p=zipf)
        pool.append(" ".join(words[i] for i in picked) + ".")
    target, written, number, file = int(gb * 1e9), 0, 0, 0
    while written < target:
        lines = []
        size = 0
        while size < 64 * 2**20 and written + size < target:
            a, b = rng.integers(0, len(pool), 2)
            text = f"Document {number}. {pool[a]} {pool[b]}"
            line = json.dumps({"text": text}) + "\n"
            lines.append(line)
            size += len(line)
            number += 1
        (folder / f"part-{file:04d}.jsonl").write_text("".join(lines))
        written += size
        file += 1
    done.write_text(json.dumps({"gb": gb, "bytes": written}))
    return written


def train_tokenizer(corpus: Path, path: Path) -> None:
    if path.is_file():
        return
    import tokenizers

    texts = []
    with open(sorted(corpus.glob("*.jsonl"))[0]) as handle:
        for line in handle:
            texts.append(json.loads(line)["text"])
            if sum(map(len, texts)) > 16e6:
                break
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=16_384, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))


# -- prepare ------------------------------------------------------------------------------------------
def tokenizer_throughput(corpus: Path, tokenizer: Path) -> float:
    """MB/s of input text through the tokenizer's own encode_batch in one process, one thread."""
    code = r"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import tokenizers
tokenizer = tokenizers.Tokenizer.from_file(sys.argv[2])
texts, size = [], 0
with open(sys.argv[1], "rb") as handle:
    for line in handle:
        texts.append(json.loads(line)["text"]); size += len(line)
        if size > 64e6:
            break
batches, held, at = [], 0, 0
for i, t in enumerate(texts):
    held += len(t)
    if held >= 1 << 20 or i - at >= 255:
        batches.append(texts[at:i + 1]); at, held = i + 1, 0
started = time.perf_counter()
for b in batches:
    tokenizer.encode_batch(b, add_special_tokens=False)
print(size / (time.perf_counter() - started) / 1e6)
"""
    out = subprocess.run([sys.executable, "-c", code, str(sorted(corpus.glob("*.jsonl"))[0]), str(tokenizer)],
                         capture_output=True, text=True, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return float(out.stdout.strip())


def run_prepare(corpus: Path, out: Path, tokenizer: Path | None, shard_mb: float = 8.0) -> tuple[float, str]:
    command = [sys.executable, "-m", "hetpeer", "data", "prepare", str(corpus), "--out", str(out), "--shard-mb", str(shard_mb)]
    if tokenizer is not None:
        command += ["--tokenizer", str(tokenizer)]
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if process.returncode != 0:
        raise SystemExit(f"hetpeer data prepare failed:\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}")
    for line in process.stdout.splitlines()[-4:]:
        say(f"  {line}")
    return time.perf_counter() - started, process.stdout.split()[-1]


# -- memory -----------------------------------------------------------------------------------------------
def memory_pass(prepared: Path, batch: int = 64) -> dict:
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(prepared), str(batch)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        raise SystemExit(f"the memory probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- join over a 100 Mbit/s link ------------------------------------------------------------------------
class Proxy:
    """127.0.0.1:port -> target port, sending what comes back at most `rate` bytes a second over all its
    connections together (one link)."""

    def __init__(self, target: int, rate: float) -> None:
        self.target, self.rate = target, rate
        self.lock = threading.Lock()
        self.started, self.sent = time.perf_counter(), 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.threads: list[threading.Thread] = []

    def start(self) -> "Proxy":
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self.threads.append(thread)
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for args in ((client, upstream, False), (upstream, client, True)):
                thread = threading.Thread(target=self._pipe, args=args, daemon=True)
                thread.start()
                self.threads.append(thread)

    def _pipe(self, source: socket.socket, sink: socket.socket, limited: bool) -> None:
        try:
            while data := source.recv(65536):
                if limited:
                    with self.lock:  # the link's schedule: this chunk leaves once the ones before it have
                        now = time.perf_counter()
                        self.started = max(self.started, now - self.sent / self.rate)  # an idle link saves nothing up
                        self.sent += len(data)
                        due = self.started + self.sent / self.rate
                    if due > now:
                        time.sleep(due - now)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def join_time(prepared: Path, work: Path, local: bool) -> dict:
    """A coordinator serving `prepared` through a 100 Mbit/s proxy and one peer joining: seconds from the peer's
    start to its first step, and from its data being opened (its plan) to that step."""
    from hetpeer.peer.launch import free_port

    http = free_port()
    proxy = Proxy(http, PROXY_RATE_BYTES_PER_S).start()
    out = work / ("join-local" if local else "join-fetch")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "hetpeer", "coordinator", "--swarm", "databench", "--home", str(out / "coordinator"),
         "--http", f"127.0.0.1:{http}", "--data", str(prepared), "--data-url", f"http://127.0.0.1:{proxy.port}/data/",
         "--min-peers", "1", "--heartbeat", "1", "--api", "off", "--steps", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    key = dht = None
    for line in coordinator.stdout:
        lines.append(line)
        if m := re.search(r"give peers --coordinator-key\): ([0-9a-f]{64})", line):
            key = m.group(1)
        if m := re.search(r"DHT: (\S+)", line):
            dht = m.group(1)
        if key and dht:
            break
    threading.Thread(target=lambda: [lines.append(l) for l in coordinator.stdout], daemon=True).start()
    command = [sys.executable, "-m", "hetpeer", "join", "--swarm", "databench", "--name", "joiner", "--home", str(out / "peer"),
               "--coordinator-key", key, "--initial-peers", dht, "--heartbeat", "1", "--steps", "3", "--threads", "1",
               "--data-cache", str(out / "cache")] + (["--data", str(prepared)] if local else [])
    started = time.time()
    peer = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    (out / "peer.log").write_text(peer.stdout + peer.stderr)
    coordinator.terminate()
    coordinator.wait(timeout=60)
    proxy.close()
    from datetime import datetime

    from hetpeer.logline import split

    stamps = {}
    for line in peer.stdout.splitlines():
        stamp, text = split(line)
        if stamp is None:
            continue
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        if text.startswith("data:") and "data" not in stamps:
            stamps["data"] = when
        if "step 1/" in text and "first" not in stamps:
            stamps["first"] = when
    if "first" not in stamps:
        raise SystemExit(f"the joining peer never stepped:\n{peer.stdout[-3000:]}\n{peer.stderr[-2000:]}")
    downloaded = sum(f.stat().st_size for f in (out / "cache").rglob("*.bin")) if (out / "cache").exists() else 0
    return {"join_to_first_step_s": stamps["first"] - started,
            "data_to_first_step_s": stamps["first"] - stamps.get("data", stamps["first"]), "downloaded_mib": downloaded / 2**20}


# -- windows across a plan change ------------------------------------------------------------------------
def windows_across_a_change(prepared: Path, work: Path) -> dict:
    run, save = work / "windows-run", work / "windows-save"
    for folder in (run, save):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    common = [sys.executable, "-m", "hetpeer", "swarm", "--peers", "3", "--heartbeat", "1", "--data", str(prepared),
              "--out", str(run), "--save", str(save), "--eval-every", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reads = []
    for steps, batch in ((30, 16), (60, 12)):
        subprocess.run(common + ["--steps", str(steps), "--batch", str(batch)], capture_output=True, text=True, env=env,
                       check=True, timeout=900)
        for log in sorted(run.glob("peer*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if m := re.search(r"  windows (\d+)-(\d+)  ", line):
                    reads += range(int(m.group(1)), int(m.group(2)) + 1)
            log.rename(log.with_suffix(f".{steps}"))
    counts = np.bincount(reads)
    expected = 30 * 16 + 30 * 12
    return {"positions_read": len(reads), "expected": expected, "twice": int((counts > 1).sum()),
            "never": int((counts[:expected] == 0).sum()) + max(0, expected - counts.size)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=5.0, help="GB of generated text (default 5)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hetpeer-data-bench",
                        help="where the corpus and preparations go (kept and reused)")
    parser.add_argument("--part", choices=("prepare", "memory", "join", "windows", "all"), default="all",
                        help="one part (the corpus and preparations an earlier run left in --work are reused)")
    parser.add_argument("--json", action="store_true", help="end with every figure as one JSON line")
    args = parser.parse_args()
    parts = {"prepare", "memory", "join", "windows"} if args.part == "all" else {args.part}
    cores = os.cpu_count() or 1
    figures: dict = {"cores": cores}

    corpus = args.work / "corpus"
    started = time.perf_counter()
    size = make_corpus(corpus, args.gb)
    say(f"corpus: {size / 1e9:.2f} GB of .jsonl in {len(list(corpus.glob('*.jsonl')))} files ({time.perf_counter() - started:.0f} s)")
    tokenizer = args.work / "tokenizer.json"
    train_tokenizer(corpus, tokenizer)

    if "prepare" in parts or ("memory" in parts and not (args.work / "prepared" / "manifest.json").is_file()):
        prepare_part(args, corpus, tokenizer, size, cores, figures)
    if "memory" in parts:
        memory_part(args, figures)
    small = args.work / "corpus-1gb"
    if parts & {"join", "windows"} and not (args.work / "prepared-bytes" / "manifest.json").is_file():
        small.mkdir(exist_ok=True)
        for file in sorted(corpus.glob("*.jsonl"))[:16]:
            if not (small / file.name).exists():
                os.link(file, small / file.name)
        bytes_s, _ = run_prepare(small, args.work / "prepared-bytes", None)
        say(f"prepare (bytes, {sum(f.stat().st_size for f in small.glob('*.jsonl')) / 1e9:.2f} GB): {bytes_s:.0f} s")
    if "join" in parts:
        join_part(args, figures)
    if "windows" in parts:
        windows = windows_across_a_change(args.work / "prepared-bytes", args.work)
        figures["windows"] = windows
        say(f"windows: {windows['positions_read']} positions read over 30 steps at batch 16, a stop, and 30 at batch 12 "
            f"(expected {windows['expected']}): {windows['twice']} twice, {windows['never']} never (goal 0)")
    if args.json:
        print(json.dumps(figures))
    return 0


def prepare_part(args, corpus: Path, tokenizer: Path, size: int, cores: int, figures: dict) -> None:
    own = tokenizer_throughput(corpus, tokenizer)
    subprocess.run(["rm", "-rf", str(args.work / "prepared")], check=True)
    seconds, name = run_prepare(corpus, args.work / "prepared", tokenizer)
    rate = size / seconds / MB
    goal = 0.8 * own * cores
    figures["prepare"] = {"input_gb": size / 1e9, "seconds": seconds, "mb_per_s": rate, "tokenizer_one_process_mb_per_s": own,
                          "goal_mb_per_s": goal, "share_of_tokenizer_times_cores": rate / (own * cores), "dataset": name}
    say(f"prepare: {size / 1e9:.2f} GB in {seconds:.0f} s = {rate:.1f} MB/s; the tokenizer alone in one process "
        f"{own:.1f} MB/s x {cores} cores = {own * cores:.1f}: {rate / (own * cores):.0%} of it (goal 80%: "
        f"{'met' if rate >= goal else 'missed'})")


def memory_part(args, figures: dict) -> None:
    memory = memory_pass(args.work / "prepared")
    samples = memory["samples"]
    growth = max(samples) - memory["base"]
    quarter = max(1, len(samples) // 4)
    drift = max(samples[-quarter:]) - max(samples[:quarter])
    figures["memory"] = {"model_rss_mib": memory["base"] / 2**20, "peak_rss_mib": max(samples) / 2**20,
                         "growth_mib": growth / 2**20, "last_vs_first_quarter_mib": drift / 2**20,
                         "windows_read": memory["windows"], "steps": memory["steps"], "seconds": memory["seconds"]}
    say(f"memory: read all {memory['windows']:,} windows ({memory['seconds']:.0f} s, {memory['steps']} optimizer steps); "
        f"resident {memory['base'] / 2**20:.0f} MiB with the model, peak {max(samples) / 2**20:.0f} MiB: "
        f"+{growth / 2**20:.1f} MiB (goal < 200: {'met' if growth < 200 * 2**20 else 'missed'}); last quarter vs first "
        f"{drift / 2**20:+.1f} MiB")


def join_part(args, figures: dict) -> None:
    for folder in ("join-local", "join-fetch"):
        subprocess.run(["rm", "-rf", str(args.work / folder)], check=True)
    fetched = join_time(args.work / "prepared-bytes", args.work, local=False)
    held = join_time(args.work / "prepared-bytes", args.work, local=True)
    figures["join"] = {"fetch": fetched, "local": held, "link_mbit_s": PROXY_RATE_BYTES_PER_S * 8 / 1e6}
    say(f"join over 100 Mbit/s: `hetpeer join` to its first step {fetched['join_to_first_step_s']:.1f} s (goal < 10: "
        f"{'met' if fetched['join_to_first_step_s'] < 10 else 'missed'}), of which its plan (data opened) to the first step "
        f"{fetched['data_to_first_step_s']:.1f} s with {fetched['downloaded_mib']:.0f} MiB downloaded; with the folder on "
        f"disk {held['join_to_first_step_s']:.1f} s ({held['data_to_first_step_s']:.1f} s): the download cost "
        f"{fetched['join_to_first_step_s'] - held['join_to_first_step_s']:+.1f} s")


if __name__ == "__main__":
    sys.exit(main())
