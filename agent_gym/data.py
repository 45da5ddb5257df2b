"""Loading task data: local JSONL or parquet files, the Hugging Face hub, bundled sets.

Every env takes its data from one of three places, in this order: an explicit path, the
hub (only when asked for and reachable), or the small original set that ships with the
package so that everything runs offline.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from agent_gym.durable import read_jsonl
from agent_gym.extras import install_hint


class DataError(ValueError):
    """Task data cannot be read or does not have the fields an env needs."""


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a ``.jsonl``/``.json`` or ``.parquet`` file. A JSONL line is read as
    untrusted JSON (bounded length and depth, finite numbers: a data file is downloaded or
    handed over), and the first bad one refuses the file, naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        payload = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(payload, list):
            raise DataError(f"{path} must hold a JSON list of records")
        return payload
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: expected a .jsonl, .json or .parquet file")
    records = []
    with path.open("rb") as handle:
        for line in read_jsonl(handle, cut_ok=True):
            if line.problem is not None:
                raise DataError(f"{path}:{line.number}: the line {line.problem}")
            if not isinstance(line.value, dict):
                raise DataError(f"{path}:{line.number}: each line must be a JSON object")
            records.append(line.value)
    return records


def load_hub(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Records of a Hugging Face hub data set (needs the ``hub`` extra and a network)."""
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            f"loading from the hub needs the 'datasets' package: {install_hint('hub')}"
        ) from err
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as err:  # the library raises many kinds when offline
        raise DataError(
            f"could not load {name}/{config or ''} split {split!r} from the hub ({err}); "
            "pass a local data_path instead"
        ) from err


def bundled(name: str) -> list[dict[str, Any]]:
    """One of the original data sets shipped in ``agent_gym/datasets``."""
    resource = resources.files("agent_gym") / "datasets" / f"{name}.jsonl"
    with resources.as_file(resource) as path:
        return load_records(path)


def require_fields(records: list[dict[str, Any]], fields: tuple[str, ...], source: str) -> None:
    for index, record in enumerate(records):
        missing = [name for name in fields if name not in record]
        if missing:
            raise DataError(f"{source}: record {index} lacks the field(s) {missing}")
