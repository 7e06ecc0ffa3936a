"""Where a job's rows come from: a dataset location opened as a `RowTable` (tables.py), and the Hugging Face hub
ids refused as one.

A location (a JobSpec's `data`) is one of:
- a JSONL file or a file holding one JSON array (rows.py; a path or a storage URI),
- a `.csv` or `.tsv` file with a header row (csv_table.py; a path or a storage URI),
- a `.parquet` file (a path or a storage URI, read through `pyarrow.fs` one row group at a time),
- an `.arrow` file (Arrow IPC, file or stream format; memory-mapped, local),
- a folder written by `datasets.Dataset.save_to_disk` or `DatasetDict.save_to_disk` (memory-mapped through
  `datasets.load_from_disk`, local), whose `split` is chosen,
- a folder of `.parquet` / `.jsonl` / `.json` / `.csv` / `.tsv` / `.arrow` files (one kind), split by file name as the
  `datasets` library does (`data/train-00000-of-00002.parquet`, `test.jsonl`, `train/part-0.parquet`); a
  folder under a storage URI is split the same way by `train`/`test`/... keywords in the file names.
A Hugging Face hub id (`tatsu-lab/alpaca`, `hf://datasets/...`) is refused: nothing is downloaded at run time."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from actors.data.csv_table import DELIMITERS, CsvTable
from actors.data.rows import DataError, DataUnreadable
from actors.data.tables import ArrowTable, ConcatTable, JsonlTable, ParquetTable, RowTable, _reading_error
from actors.storage.storage_errors import StorageError, StorageUnreachable
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import is_uri

DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".csv", ".tsv")
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
"""JSON files of a `datasets` folder or a hub snapshot that describe the data rather than hold it."""
HUB_SCHEMES = ("hf", "hf-hub", "huggingface")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --------------------------------------------------------------------------------------------- hub ids


def hub_id_problem(data: str) -> str | None:
    """Why `data` (as written) is refused when it names a Hugging Face hub dataset rather than a file or a
    folder: an `hf://` URI, or an `owner/name` id that is not an existing path. None otherwise."""
    text = str(data)
    if is_uri(text):
        if urlsplit(text).scheme.lower() not in HUB_SCHEMES:
            return None
        name = text.split("://", 1)[1].removeprefix("datasets/")
    else:
        if Path(text).expanduser().exists() or not _HUB_ID.match(text) or text.lower().endswith(DATA_SUFFIXES):
            return None
        name = text
    return (f"'{text}' is no file or folder here and looks like a Hugging Face hub dataset; aspen downloads "
            "nothing at run time: save it to a "
            f"folder first (python -c \"import datasets; datasets.load_dataset('{name}').save_to_disk('data/"
            f"{name.rsplit('/', 1)[-1]}')\") and set data to that folder (or to its parquet files)")


# --------------------------------------------------------------------------------------------- opening


def _check_no_split(source: str, split: str) -> None:
    """A split other than the default asked of data that has no splits is refused (not silently ignored)."""
    if split != "train":
        raise DataError(f"{source}: split '{split}' was asked for, but this data has no splits (one file, a saved "
                        "Dataset, or a folder whose file names name no split); remove split or point data at the "
                        "split's own file", source=source)


def _arrow_file(path: Path) -> ArrowTable:
    import pyarrow as pa

    source = str(path)
    try:
        mapped = pa.memory_map(source)
        try:
            table = pa.ipc.open_file(mapped).read_all()
        except pa.ArrowInvalid:
            mapped.seek(0)
            table = pa.ipc.open_stream(mapped).read_all()   # what datasets writes (data-00000-of-00001.arrow)
    except (OSError, ValueError) as error:
        raise DataError(f"{source}: not a readable Arrow IPC file: pyarrow says: {error}", source=source) from error
    return ArrowTable(source, table.num_rows, lambda a, b: table.slice(a, b - a), [source])


def _saved_dataset(folder: Path, split: str) -> ArrowTable:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise DataError(f"{folder}: not a readable saved dataset (datasets.load_from_disk says: {error})",
                        source=str(folder)) from error
    source = str(folder)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{folder}: the dataset has no split '{split}'; its splits: {', '.join(loaded)} (set "
                            "split to one of them)", source=source)
        dataset = loaded[split]
        source = f"{folder} (split {split})"
    else:
        _check_no_split(source, split)
        dataset = loaded
    arrow = dataset.with_format("arrow")
    # its Arrow files (those of the chosen split); a dataset that names none: every file of the folder
    files = [entry["filename"] for entry in dataset.cache_files] or [
        str(f) for f in sorted(folder.rglob("*")) if f.is_file() and not f.name.startswith(".")]
    return ArrowTable(source, len(arrow), lambda a, b: arrow[a:b], files)


def _kind_table(source: str, suffix: str, opener: Callable[[], Any], local: Path | None) -> RowTable:
    if suffix == ".parquet":
        return ParquetTable(source, opener)
    if suffix == ".arrow":
        if local is None:
            raise DataError(f"{source}: an .arrow file is read memory-mapped from a local disk; copy it to one, or "
                            "convert it to parquet (which is read from storage URIs)", source=source)
        return _arrow_file(local)
    if suffix in DELIMITERS:
        return CsvTable(source, opener, DELIMITERS[suffix])
    return JsonlTable(source, opener)


def _split_files(folder: str, files: list[str], split: str) -> list[str]:
    """The data files of `split` among `files` (paths under `folder`), by the `datasets` library's file-name
    conventions; every file when no name names a split."""
    from datasets.data_files import SPLIT_KEYWORDS

    def split_of(relative: str) -> str | None:
        words = re.split(r"[^a-z0-9]+", relative.lower())
        for name, keywords in SPLIT_KEYWORDS.items():
            if any(keyword in words for keyword in keywords):
                return str(name)
        return None

    by_split: dict[str, list[str]] = {}
    for file in files:
        relative = file[len(folder):].lstrip("/")
        by_split.setdefault(split_of(relative) or "", []).append(file)
    if set(by_split) == {""}:
        _check_no_split(folder, split)
        return sorted(files)
    named = sorted(s for s in by_split if s)
    if split not in by_split:
        raise DataError(f"{folder}: the folder has no split '{split}'; its splits (by file name): "
                        f"{', '.join(named)} (set split to one of them)", source=folder)
    return sorted(by_split[split])


def _folder_of_files(source: str, files: list[str], split: str,
                     make: Callable[[str, str], RowTable]) -> RowTable:
    data = [f for f in files if f.lower().endswith(DATA_SUFFIXES) and Path(f).name not in METADATA_FILES]
    if not data:
        raise DataError(f"{source}: the folder holds no data files ({', '.join(DATA_SUFFIXES)}) and is not a saved "
                        "dataset (datasets' save_to_disk writes dataset_dict.json or state.json)", source=source)
    chosen = _split_files(source, data, split)
    kinds = sorted({Path(f).suffix.lower() for f in chosen})
    if len(kinds) > 1 and set(kinds) != {".json", ".jsonl"}:
        raise DataError(f"{source}: the folder mixes {' and '.join(kinds)} files; keep one kind of file in it",
                        source=source)
    parts = [make(f, Path(f).suffix.lower()) for f in chosen]
    return parts[0] if len(parts) == 1 else ConcatTable(source, parts)


def _open_local(path: Path, split: str) -> RowTable:
    source = str(path)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _saved_dataset(path, split)
        files = [str(f) for f in sorted(path.rglob("*"))
                 if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)]
        return _folder_of_files(source, files, split,
                                lambda f, suffix: _kind_table(f, suffix, lambda: open(f, "rb"), Path(f)))
    if not path.exists():
        problem = hub_id_problem(source)
        if problem is not None:
            raise DataError(problem, source=source)
        raise DataError(f"{source}: file not found; check the dataset path", source=source)
    _check_no_split(source, split)
    return _kind_table(source, path.suffix.lower(), lambda: open(path, "rb"), path)


def _open_uri(uri: str, split: str) -> RowTable:
    import pyarrow.fs as pafs

    problem = hub_id_problem(uri)
    if problem is not None:
        raise DataError(problem, source=uri)
    try:
        location = StorageLocation(uri)
        info = location.fs.get_file_info(location.path)
    except StorageUnreachable:
        raise
    except StorageError as error:
        raise DataUnreadable(f"the dataset {error}", source=uri, fix=error.fix) from error
    except OSError as error:
        raise _reading_error(uri, "looking it up", error) from error
    fs = location.fs

    def make(path: str, suffix: str) -> RowTable:
        full = f"{uri.split('://', 1)[0]}://{path}" if path != location.path else uri
        opener = (lambda: fs.open_input_file(path)) if suffix == ".parquet" else (lambda: fs.open_input_stream(path))
        return _kind_table(full, suffix, opener, None)

    if info.type == pafs.FileType.NotFound:
        raise DataUnreadable(f"{uri}: not found; check the dataset URI", source=uri, fix="the URI")
    if info.type == pafs.FileType.Directory:
        try:
            infos = fs.get_file_info(pafs.FileSelector(location.path, recursive=True))
        except OSError as error:
            raise _reading_error(uri, "listing", error) from error
        files = [i.path for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")]
        return _folder_of_files(uri, files, split, make)
    _check_no_split(uri, split)
    return make(location.path, Path(location.path).suffix.lower())


def open_table(data: str | Path, split: str = "train") -> RowTable:
    """The rows at `data` (a path or a storage URI; see the module's docstring for what it may be), of
    `split` where the data has splits; a `DataError` naming the location and the fix otherwise."""
    text = str(data)
    return _open_uri(text, split) if is_uri(text) else _open_local(Path(text).expanduser(), split)
