"""Where and how the local backend computes: torch device, precision, threads, CPU defaults.

* **Device** (``resolve_device``): ``auto`` picks CUDA when available, then Apple's MPS, else
  the CPU; ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` are taken as given (and checked).
* **Precision** (``compute_dtype`` / ``autocast``): weights stay float32 (the optimizer's
  master copy); the learner's matrix products run in bfloat16 under autocast on CUDA with
  bf16 support, and stay float32 on CPU and MPS. Logprobs and losses are always computed in
  float32. A sampler may hold its own bfloat16 copy of the weights (``sampler_dtype``):
  decoding reads every weight per token, so half the bytes is up to half the time, and
  where the hardware multiplies bf16 natively (``native_bf16``: CUDA, or a CPU with AMX or
  AVX-512 BF16 units) the products are faster too.
* **Threads** (``default_threads`` / ``apply_threads``): torch's intra-op pool defaults to
  every core, and on a shared machine that oversubscribes: measured on a loaded 2-core box,
  torch's default 2 threads ran 2.3-4x slower than 1 thread at one row and 8-13x slower at 8
  rows. The default is the number of cores this process may use minus the 1-minute load
  average (other processes' runnable threads), at least 1; ``$AGENT_GYM_THREADS`` or an
  explicit count overrides it.
* **Host memory** (``return_freed_memory``): glibc keeps freed heap memory for reuse rather
  than giving it back, and a training run frees a great deal of it in odd sizes from several
  threads; the learner hands it back after every optimizer step.
* **CPU defaults** (``CPU_DEFAULTS`` / ``step_cost``): settings under which one GRPO step
  finishes in minutes on a few CPU cores, and an estimate of a step's cost from the
  throughputs measured by ``benchmarks/bench_local_backend.py``, so a trainer can warn
  before it starts an hour-long step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_gym_train.backends import SAMPLER_PRECISIONS

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
THREADS_ENV = "AGENT_GYM_THREADS"


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda[:N]`` | ``mps`` -> a torch device that exists here."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but this torch build sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("device 'mps' asked for, but MPS is not available here")
    elif device.type != "cpu":
        raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}")
    return device


def return_freed_memory() -> None:
    """Give the heap memory freed so far back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing is done).

    Every step frees a sampler's copy of the weights, its key/value caches and the learner's
    activations, tensors of ever-different sizes freed on the sampler's and the learner's
    threads. glibc keeps such memory in its arenas, and the run's resident memory grows by
    what they retain. ``benchmarks/bench_memory.py`` (Search-v0 GRPO from an SFT checkpoint,
    ``--preset cpu-demo``, the same seeds with and without this call): 5.2 GB after the first
    trained step and 6.1 GB after the last of 12 without it, 1.8 GB throughout with it, 1.3
    GB of tensors either way, the same step time. Hour-long runs were killed for memory.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; absent on macOS and musl
    except (AttributeError, OSError):
        return None


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype matrix products run in on ``device`` (bf16 only where it is native)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# /proc/cpuinfo flags of x86 units that multiply bfloat16 natively (Intel AMX, AVX-512 BF16).
CPU_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware; elsewhere torch emulates it, more
    slowly than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(CPU_BF16_FLAGS & _cpu_flags())
    return False


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:  # not Linux: no flags known, so no native bf16 assumed
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def sampler_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of a sampler's copy of the weights: ``float32`` | ``bfloat16``, the latter
    only where ``device`` has it natively (a clear error, not a silently slower sampler)."""
    if precision not in SAMPLER_PRECISIONS:
        raise ValueError(f"sampler precision {precision!r} is not one of "
                         f"{', '.join(SAMPLER_PRECISIONS)}")
    if precision == "float32":
        return torch.float32
    if not native_bf16(device):
        raise ValueError(f"bfloat16 sampling asked for, but {device.type} here has no native "
                         "bfloat16 units (needs CUDA with bf16, or a CPU with AMX or "
                         "AVX-512 BF16); it would sample slower than float32")
    return torch.bfloat16


@contextlib.contextmanager
def autocast(device: torch.device) -> Iterator[None]:
    """Mixed precision on devices with native bf16; a no-op elsewhere."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """``$AGENT_GYM_THREADS`` if set, else free cores: usable cores minus the 1-minute load."""
    configured = os.environ.get(THREADS_ENV)
    if configured:
        value = int(configured) if configured.strip().isdigit() else 0
        if value < 1:
            raise ValueError(f"${THREADS_ENV} must be a positive integer, got {configured!r}")
        return value
    cores = available_cores()
    try:
        busy = int(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(cores, cores - busy))


def apply_threads(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (process-wide) and return it."""
    count = default_threads() if threads is None else threads
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


@dataclass(frozen=True)
class StepShape:
    """What one GRPO step asks of the backend."""

    batch_size: int  # tasks (groups)
    group_size: int  # branches per task
    max_tokens: int  # per reply
    max_turns: int = 1
    prompt_tokens: int = 200  # typical opening prompt

    @property
    def rows(self) -> int:
        return self.batch_size * self.group_size


# Settings under which a GRPO step on GSM8K-v0 with SmolLM2-135M finishes in a few minutes on
# one or two CPU threads (see benchmarks/results/local_backend.json for the measured step).
# 256 tokens, not fewer: at 128 every reply of that step was cut before its answer.
CPU_DEFAULTS = StepShape(batch_size=2, group_size=4, max_tokens=256, max_turns=1)

# SmolLM2-135M on one CPU thread of this machine's class (Xeon, AVX-512, no bf16 units),
# from benchmarks/results/local_backend.json (one row: 11-16 tokens per CPU second; 14 rows
# of Search-v0 rollouts: 66): a decode step of B rows costs about
# DECODE_STEP_S + DECODE_ROW_S * B seconds, and the learner processes about
# LEARNER_TOKENS_S tokens/s (forward + backward, LoRA r32: 2,400 tokens in 23 CPU seconds).
DECODE_STEP_S = 0.08
DECODE_ROW_S = 0.012
LEARNER_TOKENS_S = 110.0
REFERENCE_PARAMS = 135e6
WARN_STEP_SECONDS = 600.0


def step_cost(shape: StepShape, *, threads: int = 1, params: float = REFERENCE_PARAMS) -> float:
    """Rough seconds for one step on CPU: sampling every row to ``max_tokens`` in one batch
    (64 rows at a time) plus the learner on every token; scales with model size and threads."""
    scale = (params / REFERENCE_PARAMS) / max(1, threads)
    rows = shape.rows
    waves = -(-rows // 64)
    per_wave = min(rows, 64)
    decode = waves * shape.max_turns * shape.max_tokens * (DECODE_STEP_S + DECODE_ROW_S * per_wave)
    tokens = rows * (shape.prompt_tokens + shape.max_turns * shape.max_tokens)
    return scale * (decode + tokens / LEARNER_TOKENS_S)


def cpu_step_warning(
    device: torch.device, shape: StepShape, *, threads: int = 1, params: float = REFERENCE_PARAMS
) -> str | None:
    """A warning naming the expected step cost when GPU-scale settings meet a CPU, else None."""
    if device.type != "cpu":
        return None
    seconds = step_cost(shape, threads=threads, params=params)
    if seconds < WARN_STEP_SECONDS:
        return None
    d = CPU_DEFAULTS
    return (
        f"these settings ({shape.batch_size} tasks x {shape.group_size} branches x "
        f"{shape.max_turns} turn(s) x {shape.max_tokens} tokens) are GPU-scale: one step on "
        f"this CPU with {threads} thread(s) is expected to take about {seconds / 60:.0f} min. "
        f"CPU defaults: --batch-size {d.batch_size} --group-size {d.group_size} "
        f"--max-tokens {d.max_tokens}, or use --device cuda"
    )
