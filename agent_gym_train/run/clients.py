"""The backend contract: what a run needs from a service, training and sampling client
(pytrio's, or the local backend's in ``agent_gym_train.backends``), and the training client
a run opens: its last checkpoint's, or a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pytrio import AdamParams, Datum, ModelInput, SamplingParams
from pytrio.types import (
    APIFuture,
    ForwardBackwardOutput,
    OptimStepResponse,
    SampleResponse,
    SaveWeightsResponse,
)

from agent_gym_train.run.files import Checkpoint, RunConfigError, checkpoint_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_gym_train.run.args import RunArgs


class Sampler(Protocol):
    """What rollouts and the critic need from a sampling client (pytrio's or the local one)."""

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = ...,
    ) -> SampleResponse: ...

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]: ...

    def get_tokenizer(self) -> PreTrainedTokenizerBase: ...


@dataclass(frozen=True)
class VersionedSampler:
    """A sampler and the version of the weights it samples (updates applied to them)."""

    sampler: Sampler
    version: int


class TrainingClient(Protocol):
    """What a run needs from a training client (pytrio's or the local one)."""

    def get_tokenizer(self) -> PreTrainedTokenizerBase: ...

    def forward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, object] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, object] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward_custom(
        self, data: list[Datum], loss_fn: Callable[..., Any],
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]: ...

    def load_state(self, path: str) -> APIFuture[Any]: ...

    def save_weights_and_get_sampling_client(self) -> Sampler: ...


class ServiceClient(Protocol):
    """What a run needs from a service client (``pytrio.ServiceClient`` or the local one)."""

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None
    ) -> TrainingClient: ...

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient: ...

    def create_sampling_client(self, base_model: str, model_path: str | None = None) -> Sampler: ...


@runtime_checkable
class FullFineTuning(Protocol):
    """A service that also trains every weight (the local backend; pytrio trains LoRA only)."""

    def create_full_training_client(
        self, base_model: str, seed: int | None = None
    ) -> TrainingClient: ...


def training_client(
    service: ServiceClient, args: RunArgs, checkpoint: Path
) -> tuple[TrainingClient, Checkpoint | None]:
    """The training client the last checkpoint saved, with its optimizer, and that
    checkpoint, when there is one (a run continues where it stopped); else a fresh one."""
    if checkpoint.is_file():
        saved = Checkpoint.read(checkpoint)
        for key in args.IDENTITY:
            if saved.args.get(key) != getattr(args, key):
                raise RunConfigError(
                    f"{checkpoint.parent} holds a run with {key}={saved.args.get(key)!r}, not "
                    f"{getattr(args, key)!r}: continue it with the same {key} or give another "
                    "--out"
                )
        return service.create_training_client_from_state_with_optimizer(saved.path), saved
    if args.lora_rank > 0:
        training = service.create_lora_training_client(
            args.model, rank=args.lora_rank, seed=args.seed)
    elif isinstance(service, FullFineTuning):
        training = service.create_full_training_client(args.model, seed=args.seed)
    else:
        raise RunConfigError(f"the {args.backend} backend trains LoRA adapters only")
    if args.init_from is not None:
        try:  # weights only: the backend refuses a checkpoint of another model or rank
            training.load_state(checkpoint_path(args.init_from)).result()
        except RunConfigError as err:
            raise RunConfigError(f"--init-from {err}") from err
        except (ValueError, OSError) as err:
            raise RunConfigError(f"--init-from {args.init_from}: {err}") from err
    return training, None
