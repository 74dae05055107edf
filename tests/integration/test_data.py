"""Prepared data as users drive it (`python -m hetpeer data prepare`, `hetpeer swarm --data`): the command and its
resumption after Ctrl+C; shards fetched over HTTP from the coordinator, checked, and kept in a bounded cache; and a
swarm whose peers start without the corpus, stop, and resume with another batch without reading a window twice or
skipping one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetpeer.coordinator.web import DashboardServer
from hetpeer.logline import unstamp
from hetpeer.peer.data.order import BLOCK_SHARDS
from hetpeer.peer.data.fetch import DataFetchError, ShardStore, open_store
from hetpeer.peer.data.prepare import Settings, prepare
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.protocol.dataset import MANIFEST, read_folder, served_files

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300
SEQ = 16


def hetpeer(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetpeer", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def finish(process: subprocess.Popen) -> tuple[str, str]:
    try:
        return process.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"hung for {HANG_GUARD_S} s:\n{out}\n{err}")


def corpus(folder: Path, files: int, documents: int) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "swarm", "peer", "lane", "stage", "shard", "window"]
    for f in range(files):
        lines = (json.dumps({"text": " ".join(rng.choice(words, 40 + d % 50))}) + "\n" for d in range(documents))
        (folder / f"part{f:02d}.jsonl").write_text("".join(lines))
    return folder


def test_prepare_from_the_command_line_goes_on_after_ctrl_c(tmp_path):
    data = corpus(tmp_path / "text", files=1, documents=200)
    bad = finish(hetpeer("data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "x")))
    assert "hetpeer data: error: input" in bad[1] and "missing" in bad[1] and "Traceback" not in bad[1]
    bad = finish(hetpeer("data", "prepare", str(data), "--out", str(tmp_path / "x"), "--validation", "0.7"))
    assert "--validation: must be in [0, 0.5)" in bad[1]

    big = corpus(tmp_path / "big", files=12, documents=6000)  # a dozen parts, seconds of work on two cores
    process = hetpeer("data", "prepare", str(big), "--out", str(tmp_path / "out"), "--shard-mb", "0.5", "--workers", "2")
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:  # interrupted once some parts are done (each leaves its record)
        records = list((tmp_path / "out" / "progress").glob("*.json")) if (tmp_path / "out" / "progress").is_dir() else []
        if records or process.poll() is not None:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = finish(process)
    if process.returncode == 130:  # it was still working: it says how to go on, and did not write a manifest
        assert "interrupted" in out + err and not (tmp_path / "out" / MANIFEST).exists()
    out, err = finish(hetpeer("data", "prepare", str(big), "--out", str(tmp_path / "out"), "--shard-mb", "0.5"))
    assert "Traceback" not in err and re.search(r"dataset [0-9a-f]{64}", out), out + err
    assert process.returncode == 0 or "done before, going on" in out
    manifest, name = read_folder(tmp_path / "out")
    assert out.split()[-1] == name and manifest.documents == 12 * 6000
    clean, clean_name = prepare([big], tmp_path / "clean", Settings(None, shard_tokens=2**19), workers=2, say=lambda _: None)
    assert clean_name == name  # resumed or not, the same dataset


@pytest.fixture()
def served(tmp_path):
    data = corpus(tmp_path / "text", files=2, documents=300)
    manifest, name = prepare([data], tmp_path / "prepared", Settings(None, shard_tokens=4096, validation=0.05), workers=1,
                             say=lambda _: None)
    server = DashboardServer(lambda: None, "127.0.0.1:0", data=(tmp_path / "prepared", served_files(manifest))).start()
    try:
        yield manifest, name, f"http://127.0.0.1:{server.port}/data/", tmp_path / "prepared"
    finally:
        server.shutdown()


def test_shards_come_over_http_checked_and_the_cache_stays_within_its_bound(served, tmp_path):
    manifest, name, url, folder = served
    largest = max(manifest.shard_bytes(s) for s in manifest.train)
    store = open_store(name, url, None, tmp_path / "cache", cache_bytes=3 * BLOCK_SHARDS * largest)
    data = ShardedCorpus(store, url)
    try:
        local = ShardedCorpus(ShardStore(manifest, name, local=folder), str(folder))
        for position in range(0, data.windows(SEQ), 64):  # a whole epoch
            assert np.array_equal(data.batch(position, 64, SEQ).tokens, local.batch(position, 64, SEQ).tokens)
    finally:
        data.close()
    # counted once the store has stopped: while it runs, its next downloads come in and its evictions go on
    held = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*.bin"))
    assert len(manifest.train) > 4 * BLOCK_SHARDS  # it could not all stay
    assert 0 < held <= 3 * BLOCK_SHARDS * largest and store.downloaded_bytes >= sum(manifest.shard_bytes(s) for s in manifest.train)
    assert not list((tmp_path / "cache").rglob("*.part"))  # downloads under way finished or were cleaned up
    with pytest.raises(DataFetchError, match="is not the plan's dataset"):
        open_store("0" * 64, url, None, tmp_path / "cache2", 10**9)
    with pytest.raises(DataFetchError, match=f"cannot hold the {3 * BLOCK_SHARDS} shards"):
        open_store(name, url, None, tmp_path / "cache3", largest)


def test_a_shard_the_server_changed_is_refused_and_not_kept(served, tmp_path):
    manifest, name, url, folder = served
    victim = folder / manifest.train[0].file
    victim.write_bytes(bytes(b ^ 0xFF for b in victim.read_bytes()))
    store = open_store(name, url, None, tmp_path / "cache", 10**9)
    with pytest.raises(DataFetchError, match=f"gave up on {manifest.train[0].file}.*does not match the manifest's sha256"):
        store.path(manifest.train[0])
    store.close()
    assert not (tmp_path / "cache" / name / manifest.train[0].file).exists()


def windows_read(out: Path) -> list[tuple[int, int]]:
    """[first, last] of every step's windows that a first-stage peer of the swarm in `out` printed."""
    found = []
    for log in sorted(out.glob("peer*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if match := re.search(r"step \d+/\d+ .* tok/s  windows (\d+)-(\d+)  ", unstamp(line)):
                found.append((int(match.group(1)), int(match.group(2))))
    return found


@pytest.mark.slow
def test_a_swarm_fetches_the_corpus_stops_and_resumes_without_repeating_or_skipping_a_window(tmp_path):
    data = corpus(tmp_path / "text", files=2, documents=400)
    out, err = finish(hetpeer("data", "prepare", str(data), "--out", str(tmp_path / "prepared"), "--shard-mb", "0.05",
                              "--validation", "0.05"))
    assert "dataset " in out, out + err
    run, save = tmp_path / "run", tmp_path / "save"
    common = ["swarm", "--peers", "2", "--heartbeat", "1", "--stages", "1", "--data", str(tmp_path / "prepared"),
              "--out", str(run), "--save", str(save), "--eval-every", "5"]
    out, err = finish(hetpeer(*common, "--steps", "10", "--batch", "16", start_new_session=True))
    assert "Traceback" not in out + err and "step 10/10" in out, out + err
    first = windows_read(run)
    for log in run.glob("peer*.log"):
        log.rename(log.with_suffix(".first"))
    out, err = finish(hetpeer(*common, "--steps", "20", "--batch", "12", start_new_session=True))
    assert "Traceback" not in out + err and "step 20/20" in out, out + err
    assert "resumed from the peers' checkpoints at step 10" in (run / "coordinator.log").read_text()
    second = windows_read(run)
    read = sorted(p for first_, last in first + second for p in range(first_, last + 1))
    assert read == list(range(10 * 16 + 10 * 12))  # every position once: none twice, none skipped
    downloaded = [p for p in run.glob("peer*/data/shards/*/train/*.bin")]
    assert downloaded  # the peers started without the corpus and fetched what they read


@pytest.mark.slow
def test_a_plan_change_mid_epoch_neither_repeats_nor_skips_a_window(tmp_path):
    """The test is the coordinator: it signs a plan of two lanes at batch 8, and while the peers train, one from
    step S with the lanes swapped at batch 6 and the data position the coordinator gives it (`Plan.data_position_at`:
    the unit tests hold the coordinator to that). The peers read the prepared folder from their disks."""
    from hetpeer.protocol.control import ControlPlane, key_digest
    from hetpeer.protocol.modelspec import PRESETS
    from hetpeer.protocol.plan import Plan, StagePlan

    data = corpus(tmp_path / "text", files=1, documents=300)
    prepare([data], tmp_path / "prepared", Settings(None, shard_tokens=4096, validation=0.05), workers=1, say=lambda _: None)
    control = ControlPlane("datachange", tmp_path / "coordinator.key").start()
    peers, logs = [], []
    try:
        for i in range(2):
            logs.append((tmp_path / f"p{i}.log").open("w"))
            peers.append(subprocess.Popen(
                [sys.executable, "-m", "hetpeer", "join", "--swarm", "datachange", "--name", f"p{i}", "--home", str(tmp_path / f"p{i}"),
                 "--coordinator-key", key_digest(control.public_key), "--initial-peers", control.visible_maddrs()[0],
                 "--heartbeat", "1", "--steps", "24", "--threads", "1", "--slowdown", "40", "--data", str(tmp_path / "prepared")],
                stdout=logs[-1], stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        deadline = time.monotonic() + HANG_GUARD_S

        def records() -> dict:
            while time.monotonic() < deadline:
                found = control.read_peers(max_age_s=30)[0]
                if len(found) == 2:
                    return found
                time.sleep(0.5)
            raise AssertionError("the peers never announced themselves")

        ids = sorted(records())
        tiny = PRESETS["tiny"]
        first = Plan("time", "tiny", tiny.layers, 8, 2, 2, "fp32", (StagePlan(0, 0, tiny.layers, tuple(ids), "gossip"),), epoch=1)
        assert control.publish_plan(first, ttl_s=600)
        while time.monotonic() < deadline and max(r.step for r in records().values()) < 3:
            time.sleep(0.5)
        # well ahead, as a coordinator's start step is: a peer reads plans once a heartbeat and records lag by one, so
        # the plan must reach both before either gets there (a peer past it would run that step under both plans);
        # at about 0.5 s a step (--slowdown 40) ten steps are five heartbeats
        start = max(r.step for r in records().values()) + 10
        second = Plan("time", "tiny", tiny.layers, 6, 2, 2, "fp32", (StagePlan(0, 0, tiny.layers, tuple(reversed(ids)), "gossip"),),
                      epoch=2, start_step=start, data_position=first.data_position_at(start))
        assert control.publish_plan(second, ttl_s=600)
        for peer in peers:
            assert peer.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / "p0.log").read_text()[-3000:]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
        for log in logs:
            log.close()
        control.shutdown()
    read = []
    for i in range(2):
        for line in (tmp_path / f"p{i}.log").read_text(errors="replace").splitlines():
            if match := re.search(r" e(\d) stage 1 lane \d +step \d+/\d+ .* tok/s  windows (\d+)-(\d+)  ", line):
                read += [(int(match.group(1)), p) for p in range(int(match.group(2)), int(match.group(3)) + 1)]
    assert {e for e, _ in read} == {1, 2}  # both plans ran
    positions = sorted(p for _, p in read)
    assert positions == list(range(start * 8 + (24 - start) * 6))  # none twice, none skipped, across the change
