"""``UnicodeText``, the text space of every agent_gym env, and its shared memory."""

import multiprocessing
import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import shared_memory


class UnicodeText(spaces.Text):
    """Any unicode string up to ``max_length`` characters, which Gymnasium's ``Text`` rejects
    outside its charset; ``sample()`` yields short printable ones, keeping check_env cheap."""

    def __init__(self, max_length: int, sample_max_length: int = 64, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)
        self.sample_max_length = min(sample_max_length, max_length)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(0, self.sample_max_length + 1))
        return super().sample(mask=(length, None)) if length else ""

    def __repr__(self) -> str:
        return f"UnicodeText({self.max_length})"


class SharedTexts(Sequence[str]):
    """An async vector env's shared buffer of texts (lengths and code points, which Gymnasium's
    charset indices cannot hold), decoded on access: a live view, never a stale copy."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        row = self._rows[index]
        return row[1 : 1 + row[0]].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[str, ...]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"SharedTexts({tuple(self)!r})"


@shared_memory.create_shared_memory.register(UnicodeText)
def _create_unicode_memory(space: UnicodeText, n: int = 1, ctx: Any = multiprocessing) -> Any:
    return ctx.Array("i", n * (space.max_length + 1))


@shared_memory.read_from_shared_memory.register(UnicodeText)
def _read_unicode_memory(space: UnicodeText, memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(np.frombuffer(memory.get_obj(), np.int32).reshape(n, space.max_length + 1))


@shared_memory.write_to_shared_memory.register(UnicodeText)
def _write_unicode_memory(space: UnicodeText, index: int, value: str, memory: Any) -> None:
    codes = np.frombuffer(value.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    row = np.frombuffer(memory.get_obj(), dtype=np.int32)[index * (space.max_length + 1) :]
    row[0] = len(codes)
    row[1 : 1 + len(codes)] = codes
