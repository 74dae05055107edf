"""`hetpeer data prepare` as a library: every input format in, shards and a manifest out, documents ended by the
end-of-text id, a validation split chosen by document, runs that go on after an interruption, and bad input named."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hetpeer.peer.data import prepare as preparing
from hetpeer.peer.data.errors import CorpusError
from hetpeer.peer.data.prepare import PrepareError, Settings, prepare
from hetpeer.protocol.dataset import MANIFEST, Manifest, ManifestError, read_folder, served_files
from test_corpus import DOCS, bpe_tokenizer, write_parquet

TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) + "\n" for i in range(300)]


def documents_in(folder: Path, split: str = "train") -> list[bytes]:
    """The documents of a bytes-prepared folder's split, in shard order (each ends with the id 0)."""
    manifest, _ = read_folder(folder)
    stream = b"".join((folder / s.file).read_bytes() for s in getattr(manifest, split))
    assert stream == b"" or stream.endswith(b"\0")
    return stream.split(b"\0")[:-1]


def quiet(_: str) -> None:
    pass


def test_every_format_goes_in_and_each_document_comes_out_once(tmp_path):
    pa = pytest.importorskip("pyarrow")
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.txt").write_text(TEXTS[0])
    (data / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[1:50]))
    with gzip.open(data / "c.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS[50:100])
    write_parquet(data / "d.parquet", TEXTS[100:150], row_group_size=7)
    (data / "e.bin").write_bytes(b"\0\1\2 binary, skipped")
    hf = tmp_path / "hf"  # what a dataset's save_to_disk writes: Arrow stream files its state.json lists
    hf.mkdir()
    table = pa.table({"text": TEXTS[150:200], "id": list(range(50))})
    with pa.ipc.new_stream(str(hf / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=9)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    inputs = [data, hf]
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "f.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[200:300]).encode()))
    inputs.append(tmp_path / "f.jsonl.zst")
    said = []
    manifest, name = prepare(inputs, tmp_path / "out", Settings(None, shard_tokens=2048, validation=0.1), workers=2,
                             say=said.append)
    found = documents_in(tmp_path / "out") + documents_in(tmp_path / "out", "validation")
    assert sorted(found) == sorted(t.encode() for t in TEXTS)
    assert manifest.documents == 300 and manifest.dtype == "uint8" and manifest.eot == 0 and manifest.vocab == 256
    assert 10 <= len(documents_in(tmp_path / "out", "validation")) <= 60  # about a tenth
    assert any("1 file(s) skipped" in line for line in said)
    assert all(s.tokens <= 2048 + 1024 for s in manifest.train[:-1])  # shards of about the size asked for
    raw = (tmp_path / "out" / MANIFEST).read_bytes()
    assert Manifest.from_bytes(raw, "x") == manifest and len(name) == 64
    assert served_files(manifest) >= {MANIFEST, manifest.train[0].file}


def test_the_result_does_not_depend_on_the_workers_and_an_interrupted_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(preparing, "PART_BYTES", 4096)  # many parts: a big file is cut at line ends
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "long.txt").write_text("".join(TEXTS))
    inputs = [tmp_path / "big.jsonl", tmp_path / "long.txt"]
    settings = Settings(None, shard_tokens=1024, validation=0.05)
    one, name_one = prepare(inputs, tmp_path / "one", settings, workers=1, say=quiet)
    two, name_two = prepare(inputs, tmp_path / "two", settings, workers=2, say=quiet)
    assert name_one == name_two and len(one.train) > 10
    assert sorted(documents_in(tmp_path / "one") + documents_in(tmp_path / "one", "validation")) == sorted(
        [t.encode() for t in TEXTS] + ["".join(TEXTS).encode()])
    # interrupted: the manifest not yet written, one part's record missing, a half-written shard of it left behind
    out = tmp_path / "two"
    (out / MANIFEST).unlink()
    (out / "progress" / "000003.json").unlink()
    (out / "train" / "000003-00009.bin").write_bytes(b"cut short")
    said = []
    again, name_again = prepare(inputs, out, settings, workers=2, say=said.append)
    assert name_again == name_one and again == one  # the same shards, the same manifest: the same dataset
    parts = len(preparing.plan_parts(inputs)[0])
    assert any(f"; {parts - 1} done before, going on" in line for line in said)  # only the part without a record is redone
    assert not (out / "train" / "000003-00009.bin").exists()  # the cut-short part was done again
    # changed settings are a new preparation: nothing of the old one is taken
    other, name_other = prepare(inputs, out, Settings(None, shard_tokens=4096, validation=0.05), workers=1, say=quiet)
    assert name_other != name_one
    assert {p.name for p in (out / "train").iterdir()} == {Path(s.file).name for s in other.train}


def test_a_tokenizer_gives_its_ids_and_ends_each_document(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = bpe_tokenizer(tmp_path, DOCS * 20)
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    with pytest.raises(PrepareError, match="no end-of-text token.*--eot"):
        prepare([tmp_path / "d.jsonl"], tmp_path / "out", Settings(path), say=quiet)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    eot = tokenizer.token_to_id("<|endoftext|>")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS * 5))
    manifest, _ = prepare([tmp_path / "d.jsonl"], tmp_path / "out", Settings(path, validation=0), workers=1, say=quiet)
    ids = np.concatenate([np.fromfile(tmp_path / "out" / s.file, dtype=np.uint16) for s in manifest.train])
    expected = [i for t in DOCS * 5 for i in [*tokenizer.encode(t, add_special_tokens=False).ids, eot]]
    assert ids.tolist() == expected and manifest.eot == eot and manifest.dtype == "uint16"
    assert manifest.tokenizer == "tokenizer.json" and (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()
    with pytest.raises(PrepareError, match="--eot names a token"):
        prepare([tmp_path / "d.jsonl"], tmp_path / "o2", Settings(None, eot="</s>"), say=quiet)


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("bad.jsonl", '{"text": "ok"}\n{not json\n', ["bad.jsonl:2", "not a JSON object"]),
        ("bad.jsonl", '{"text": "ok"}\n{"body": 1}\n', ["bad.jsonl:2", "no \"text\" string"]),
        ("bad.parquet", b"not parquet", ["bad.parquet is not a Parquet file"]),
        ("binary.dat", b"\0\0\0", ["binary.dat is not text"]),
        ("gone.txt", None, ["'", "gone.txt", "does not exist"]),
    ],
)
def test_bad_inputs_are_named(tmp_path, name, content, words):
    if content is not None:
        (tmp_path / name).write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(CorpusError) as error:  # PrepareError, or the document readers' CorpusError
        prepare([tmp_path / name], tmp_path / "out", Settings(None), workers=1, say=quiet)
    for word in words:
        assert word in str(error.value)
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_settings_out_of_range_are_refused():
    with pytest.raises(PrepareError, match=r"validation share must be in \[0, 0.5\)"):
        Settings(None, validation=0.5)
    with pytest.raises(PrepareError, match="at least 1024 tokens"):
        Settings(None, shard_tokens=10)


def test_a_record_in_a_later_part_is_named_by_its_byte_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(preparing, "PART_BYTES", 64)
    (tmp_path / "late.jsonl").write_text(json.dumps({"text": "x" * 100}) + "\n" + '{"body": 1}\n')
    with pytest.raises(CorpusError, match=r"late.jsonl at byte 113 has no \"text\" string"):
        prepare([tmp_path / "late.jsonl"], tmp_path / "out", Settings(None), workers=1, say=quiet)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda w: w["train"][0].update(file="../../etc/passwd"), "file must be train/"),
        (lambda w: w["train"][0].update(sha256="XYZ"), "sha256 must be 64"),
        (lambda w: w.update(dtype="float32"), "dtype must be one of"),
        (lambda w: w["tokenizer"].update(vocab=70_000), "vocab must be 2 to 256"),
        (lambda w: w["train"].append(dict(w["train"][0])), "listed twice"),
        (lambda w: w["train"][0].update(tokens=0), "tokens must be 1 to"),
        (lambda w: w.update(train=[]), "no training shard"),
        (lambda w: w.update(format="other"), "not a hetpeer shard manifest"),
    ],
)
def test_a_manifest_is_parsed_strictly(change, words):
    good = Manifest("bytes", "", 256, 0, "uint8", (preparing.Shard("train/000000-00000.bin", 10, "a" * 64),), ())
    wire = json.loads(good.to_bytes())
    change(wire)
    with pytest.raises(ManifestError, match=words):
        Manifest.from_bytes(json.dumps(wire).encode(), "the manifest")
    with pytest.raises(ManifestError, match="is not JSON"):
        Manifest.from_bytes(b"{", "the manifest")
