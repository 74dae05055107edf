"""`hetpeer data prepare`: tokenize a corpus once into shards that peers fetch (docs/data.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetpeer.cli.common import UserError, positive_float, positive_int


def add_commands(commands) -> None:
    """Add `hetpeer data` to the subcommands."""
    data = commands.add_parser("data", help="prepare a corpus for a swarm",
                               description="Prepare a corpus for a swarm (docs/data.md).")
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="tokenize text into shards of token ids and a manifest",
        description="Tokenize INPUT files and folders (UTF-8 text files, .jsonl, .jsonl.gz and .jsonl.zst with a \"text\" "
        "string a line, .parquet with a \"text\" column, Hugging Face dataset folders from save_to_disk) into shards of "
        "token ids under --out, with manifest.json listing each shard's token count and sha256, and a validation split "
        "set aside by document. Uses a process per core; run the same command again after Ctrl+C to go on where it "
        "stopped. Prints the dataset's name (its manifest's sha256), which plans carry.",
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files and folders of text")
    prepare.add_argument("--out", type=Path, required=True, metavar="DIR", help="the prepared folder (made, or gone on with)")
    prepare.add_argument("--tokenizer", type=Path, metavar="PATH",
                         help="a tokenizer.json (or a model folder holding one); default: bytes (ids 0-255, 0 ending documents)")
    prepare.add_argument("--eot", metavar="TOKEN",
                         help="the tokenizer's end-of-text token (default: the first it has of <|endoftext|>, </s>, "
                         "<|end_of_text|>, <eos>, <|eos|>, [EOS])")
    prepare.add_argument("--shard-mb", type=positive_float, default=8.0, metavar="MB",
                         help="about how large each shard is, in MiB of token ids (default 8: a joining peer's first "
                         "step waits for the 4 shards it reads, 32 MiB)")
    prepare.add_argument("--validation", type=_share, default=0.01, metavar="SHARE",
                         help="share of documents set aside for validation, in [0, 0.5) (default 0.01)")
    prepare.add_argument("--workers", type=positive_int, metavar="N", help="processes (default: one per core)")
    prepare.set_defaults(run=_prepare)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 0.5), got {text!r}") from None
    if not 0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5), got {text}")
    return value


def _prepare(args: argparse.Namespace) -> int:
    import numpy as np

    from hetpeer.logline import stamp
    from hetpeer.peer.data.corpus import CorpusError
    from hetpeer.peer.data.prepare import Settings, describe_tokenizer, prepare

    try:
        itemsize = np.dtype(describe_tokenizer(Settings(args.tokenizer, eot=args.eot)).dtype).itemsize
        settings = Settings(args.tokenizer, shard_tokens=max(1024, int(args.shard_mb * 2**20 / itemsize)),
                            validation=args.validation, eot=args.eot)
        manifest, name = prepare(args.inputs, args.out, settings, workers=args.workers, say=lambda line: print(stamp(line), flush=True))
    except CorpusError as error:  # PrepareError and the manifest's errors among them
        raise UserError(str(error)) from None
    except KeyboardInterrupt:
        print("hetpeer data prepare: interrupted; run the same command again to go on from the parts done")
        return 130
    print(stamp(f"prepared {manifest.describe()}, {manifest.documents:,} documents, into {args.out}"))
    if args.validation > 0 and not manifest.validation:
        print(stamp(f"no document fell in the validation share of {args.validation:g}: peers hold out the last training "
                    "shard for validation instead"))
    print(f"dataset {name}")
    return 0
