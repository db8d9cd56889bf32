"""``megascale-data prepare``: raw text/JSONL/image folders → Parquet with cost columns."""

from __future__ import annotations

import argparse
import sys

from megascale_data_ext.errors import MegascaleDataError

NAME = "prepare"
HELP = (
    "Convert text files, JSONL (text + optional image paths) or captioned image folders into Parquet "
    "shards with precomputed cost columns (num_tokens, image_patches) for ahead-of-fetch balancing."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megascale_data_ext.sources.tokenizer import tokenizer_types

    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help=".txt, .jsonl files or directories")
    parser.add_argument("--output", required=True, metavar="DIR", help="directory for the Parquet shards")
    parser.add_argument("--kind", choices=["text", "image-text"], default="text", help="payload columns to write")
    # Megatron's preprocess_data.py spellings: --tokenizer-model / --vocab-file name the file.
    parser.add_argument("--tokenizer", "--tokenizer-model", "--vocab-file", dest="tokenizer", default=None,
                        metavar="PATH", help="tokenizer.json, SentencePiece .model or GPT-2 vocab.json "
                        "(default: byte-level); a source's `tokenizer` key")
    parser.add_argument("--tokenizer-type", default=None, choices=tokenizer_types(),
                        help="Megatron's tokenizer type (default: from the file); a source's `tokenizer_type` key")
    parser.add_argument("--merge-file", default=None, metavar="PATH",
                        help="GPT2BPETokenizer merges.txt (default: beside the vocab file); a source's `merge_file`")
    parser.add_argument("--patch-size", type=int, default=16, help="ViT patch edge in pixels (default 16)")
    parser.add_argument("--max-image-patches", type=int, default=1024, help="patch cap per image (default 1024)")
    parser.add_argument("--row-group-rows", type=int, default=1024, help="rows per Parquet row group")
    parser.add_argument("--rows-per-file", type=int, default=100_000, help="rows per Parquet file")
    parser.add_argument("--split-lines", action="store_true", help="one document per line of .txt inputs")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSONL fields holding the text (Megatron's --json-keys; several are joined by a "
                             "blank line; default: text)")
    parser.add_argument("--image-key", default="image", metavar="KEY",
                        help="JSONL field with image path(s) for --kind image-text (default: image)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from megascale_data_ext.sources.prepare import format_summary, prepare

    try:
        result = prepare(
            args.input,
            args.output,
            kind=args.kind,
            tokenizer=args.tokenizer,
            tokenizer_type=args.tokenizer_type,
            merge_file=args.merge_file,
            patch_size=args.patch_size,
            max_image_patches=args.max_image_patches,
            row_group_rows=args.row_group_rows,
            rows_per_file=args.rows_per_file,
            split_lines=args.split_lines,
            json_keys=args.json_keys,
            image_key=args.image_key,
            progress=not args.no_progress,
        )
    except MegascaleDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result, args.output))
    return 0
