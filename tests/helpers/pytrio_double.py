"""A test double of the pytrio service, for running trainers against pytrio offline.

The trainer talks to pytrio's *real* ``TrainingClient`` and ``SamplingClient``: pytrio's own
code validates every call, plans and splits batches, builds the wire payloads and parses the
responses. Only what lies beyond the network is replaced: the actor coordinators and the
control plane. Every request they receive is encoded to MessagePack with pytrio's codec and
decoded again with pytrio's protocol models (exactly what a server would parse), checked
(e.g. every split request of a logical batch carries the same whole-batch totals), recorded,
and then computed by the local backend so the answers are real. ``forward_backward_custom``
needs nothing of its own here: pytrio's client runs it as a ``forward`` and a weighted
``cross_entropy`` ``forward_backward`` (its ``_forward_backward_custom``), both served below.

Coupled to pytrio 0.2.9's internals (coordinator and runtime hooks) on purpose: the point is
to exercise pytrio's client code, which has no offline mode.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from pytrio import AdamParams, Datum, ModelInput, SamplingClient, SamplingParams, TrainingClient
from pytrio.client.training import _ReadyTrainingActorBinding
from pytrio.errors.base import ValidationError
from pytrio.model.limits import SamplingLimits, TrainingLimits
from pytrio.protocol.actor.events.codec import decode_payload, payload_to_wire_value
from pytrio.protocol.actor.events.event import EventType
from pytrio.protocol.actor.events.tensor import WireTensorData
from pytrio.protocol.actor.events.trainer.forward import TrainerForwardResult
from pytrio.protocol.actor.events.trainer.lora import (
    CheckpointLoraSource,
    FreshLoraSource,
    LoraRunSpec,
)
from pytrio.protocol.actor.sampling_run.sample import (
    ActorSampleResponse,
    ActorSampleSequence,
    SampleRequest,
    Usage,
)
from pytrio.protocol.control.sampling_run.create import SamplingRunCreateResponse
from pytrio.runtime.event_loop import SDKEventLoopRunner
from pytrio.runtime.service import ActorHeartbeatHandle
from pytrio.types import APIFuture

from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.backends.models import load_tokenizer

MAX_SAMPLES_PER_REQUEST = 3  # small, so the SDK must split every realistic batch


class FakePytrioServer:
    """The remote side: model catalogue, checkpoints and a log of decoded requests."""

    def __init__(self, models: dict[str, str], checkpoint_dir: Path) -> None:
        self.models = models  # pytrio model id -> local model spec
        self.local = LocalServiceClient(checkpoint_dir=checkpoint_dir)
        self.checkpoints: dict[str, tuple[str, str]] = {}  # uri -> (model id, local path)
        self.events: list[tuple[EventType, Any]] = []
        self.samples: list[SampleRequest] = []
        self.groups: list[list[Any]] = []
        self.last_sampling_source: tuple[str, str | None] = ("", None)

    def tokenizer(self, model_id: str) -> Any:
        return load_tokenizer(self.spec(model_id))

    def spec(self, model_id: str) -> str:
        if model_id not in self.models:
            raise ValidationError(f"Model {model_id} is not supported by the server",
                                  code="validation.unsupported_model")
        return self.models[model_id]

    def receive(self, event_type: EventType, payload: Any) -> Any:
        """What the actor would parse: the payload through pytrio's wire codec."""
        raw = msgpack.packb(payload_to_wire_value(event_type, payload), use_bin_type=True)
        decoded = decode_payload(event_type, raw)
        assert event_type in type(decoded).event_types
        self.events.append((event_type, decoded))
        return decoded

    def store(self, model_id: str, local_path: str) -> str:
        uri = f"pytrio://fake/{uuid.uuid4().hex[:8]}/{Path(local_path).name}"
        self.checkpoints[uri] = (model_id, local_path)
        return uri

    def count(self, event_type: EventType) -> int:
        return sum(1 for kind, _ in self.events if kind is event_type)


class FakeTrainingActor:
    """The ``ActorTrainingRunCoordinator`` seen by one real ``TrainingClient``."""

    def __init__(self, server: FakePytrioServer, model_id: str, trainer: LocalTrainingClient):
        self.server = server
        self.model_id = model_id
        self.trainer = trainer

    async def submit(self, event_type: EventType, payload: Any) -> APIFuture[dict[str, object]]:
        decoded = self.server.receive(event_type, payload)
        if event_type is EventType.TRAINER_OPTIMIZE_STEP:
            params = AdamParams(**decoded.adam_params.model_dump())
            metrics = self.trainer.optim_step(params).result().metrics
            return APIFuture.completed({"result": {"metrics": metrics}})
        if event_type is EventType.TRAINER_SAVE_STATE:
            saved = self.trainer.save_state(decoded.name, overwrite=decoded.overwrite).result()
        elif event_type is EventType.TRAINER_SAVE_WEIGHTS:
            saved = self.trainer.save_weights_for_sampler(decoded.name).result()
        else:
            raise AssertionError(f"unexpected actor event {event_type.value}")
        uri = self.server.store(self.model_id, saved.path)
        checkpoint = {"uri": uri, "model_id": self.model_id, "size_bytes": saved.size}
        return APIFuture.completed({"result": {"checkpoint": checkpoint}})

    async def submit_group(
        self, event_type: EventType, payloads: list[Any]
    ) -> APIFuture[list[dict[str, object]]]:
        decoded = [self.server.receive(event_type, p) for p in payloads]
        self.server.groups.append(decoded)
        datums = [_datum(item) for request in decoded for item in request.data]
        total = decoded[0].gradient_accumulation
        assert all(request.gradient_accumulation == total for request in decoded), (
            "every request of a logical batch carries the same whole-batch totals"
        )
        assert total.total_samples == len(datums)
        assert total.total_active_tokens == sum(_counted(item) for r in decoded for item in r.data)
        assert all(len(request.data) <= MAX_SAMPLES_PER_REQUEST for request in decoded)
        loss = decoded[0].loss
        run = self.trainer.forward_backward if event_type is EventType.TRAINER_FORWARD_BACKWARD \
            else self.trainer.forward
        output = run(datums, loss.type, loss.config or None).result()
        responses, start = [], 0
        for request in decoded:
            part = output.loss_fn_outputs[start : start + len(request.data)]
            start += len(request.data)
            counted = sum(_counted(item) for item in request.data)
            loss_sum = float(sum(sum(o["elementwise_loss"].data) for o in part))
            result = {
                "loss_fn_outputs": [
                    {k: WireTensorData.from_numpy(v.to_numpy()).model_dump() for k, v in o.items()}
                    for o in part
                ],
                "metrics": {"loss_sum": loss_sum, "loss_mean": loss_sum / max(counted, 1),
                            "token_count": counted},
            }
            TrainerForwardResult.model_validate(result)
            responses.append({"result": result})
        return APIFuture.completed(responses)


class FakeSamplingActor:
    """The ``ActorSamplingRunCoordinator`` of one sampling run."""

    def __init__(self, server: FakePytrioServer, sampler: Any) -> None:
        self.server = server
        self.sampler = sampler

    async def submit(self, request: SampleRequest) -> APIFuture[ActorSampleResponse]:
        request = SampleRequest.model_validate_json(request.model_dump_json())
        self.server.samples.append(request)
        settings = dict(request.sampling_params)
        if "stop_token_ids" in settings:
            settings["stop"] = settings.pop("stop_token_ids")
        tokens = [t for chunk in request.prompt.chunks for t in chunk.tokens]
        response = self.sampler.sample(
            ModelInput.from_ints(tokens), request.num_samples, SamplingParams(**settings),
            include_prompt_logprobs=request.return_prompt_logprobs,
        ).result()
        return APIFuture.completed(
            ActorSampleResponse(
                request_id=request.request_id,
                sequences=[
                    ActorSampleSequence(
                        tokens=s.tokens,
                        text=s.text if request.return_text else None,
                        logprobs=s.logprobs if request.return_token_logprobs else [],
                        stop_reason=s.stop_reason,
                    )
                    for s in response.sequences
                ],
                prompt_logprobs=response.prompt_logprobs or None,
                usage=Usage(input_tokens=len(tokens), output_tokens=response.output_tokens),
            )
        )


class FakeControl:
    def __init__(self, server: FakePytrioServer) -> None:
        self.server = server

    async def create_sampling_run(
        self, session: str, *, base_model: str, source_checkpoint_uri: str | None = None
    ) -> SamplingRunCreateResponse:
        self.server.spec(base_model)
        self.server.last_sampling_source = (
            self.server.checkpoints[source_checkpoint_uri] if source_checkpoint_uri
            else (base_model, None)
        )
        now = datetime.now(UTC)
        return SamplingRunCreateResponse(
            sampling_run_cuid=f"sr-{uuid.uuid4().hex[:8]}",
            service_session_cuid=session, workspace_cuid="ws-test", status="READY",
            run_index=0, model_spec_cuid="ms-test", model_alias=base_model, model_id=base_model,
            sampler={"max_batch_size": 64, "max_tokens_per_request": 65536, "max_seq_len": 8192},
            actor={"actor_cuid": "actor-test", "endpoint": "https://actor.invalid",
                   "connect_mode": "direct", "tls_enabled": False},
            actor_jwt={"token": "jwt", "expires_at": now + timedelta(hours=1)},
            created_at=now,
            init_metadata={"source_checkpoint_uri": source_checkpoint_uri},
        )

    async def renew_sampling_run(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("no renewal expected in tests")


class FakeRuntime:
    """The parts of pytrio's ``ServiceRuntime`` that its clients call."""

    def __init__(self, server: FakePytrioServer) -> None:
        self.server = server
        self.event_loop = SDKEventLoopRunner()
        self.control_client = FakeControl(server)
        self.telemetry = None

    def create_actor_sampling_run_coordinator(
        self, actor: Any, actor_jwt: Any, renew: Any, *, sampling_run_cuid: str
    ) -> FakeSamplingActor:
        # pytrio creates the run, then its coordinator: the run just created is this one.
        model_id, local_path = self.server.last_sampling_source
        spec = self.server.spec(model_id)
        return FakeSamplingActor(self.server, self.server.local.create_sampling_client(spec, local_path))


class FakeServiceClient:
    """Stands in for ``pytrio.ServiceClient``; hands out pytrio's real clients."""

    def __init__(self, server: FakePytrioServer) -> None:
        self.server = server
        self.runtime = FakeRuntime(server)

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None,
        train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
    ) -> TrainingClient:
        if not 4 <= rank <= 64:
            raise ValidationError("rank must be in [4, 64]", code="validation.invalid_rank")
        trainer = self.server.local.create_lora_training_client(
            self.server.spec(base_model), rank, seed, train_mlp, train_attn, train_unembed
        )
        lora = LoraRunSpec(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                           FreshLoraSource())
        return self._client(base_model, lora, trainer)

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient:
        model_id, local_path = self.server.checkpoints[path]
        trainer = self.server.local.create_training_client_from_state_with_optimizer(local_path)
        setup = trainer.setup
        lora = LoraRunSpec(model_id, setup.lora_rank, setup.seed, setup.train_mlp,
                           setup.train_attn, setup.train_unembed, CheckpointLoraSource(path))
        return self._client(model_id, lora, trainer)

    def create_sampling_client(self, base_model: str, model_path: str | None = None) -> SamplingClient:
        run = self.runtime.event_loop.run_sync(
            self.runtime.control_client.create_sampling_run(
                "ss-test", base_model=base_model, source_checkpoint_uri=model_path
            )
        )
        actor = self.runtime.create_actor_sampling_run_coordinator(
            run.actor, run.actor_jwt, None, sampling_run_cuid=run.sampling_run_cuid
        )
        return SamplingClient(run.sampling_run_cuid, base_model, actor,
                              SamplingLimits(64, 65536, 8192), self.runtime)

    def _client(self, model_id: str, lora: LoraRunSpec, trainer: LocalTrainingClient) -> TrainingClient:
        binding = _ReadyTrainingActorBinding(
            coordinator=FakeTrainingActor(self.server, model_id, trainer),
            heartbeat_handle=ActorHeartbeatHandle(),
        )
        return TrainingClient(
            training_run_cuid=f"tr-{uuid.uuid4().hex[:8]}",
            model_id=model_id,
            lora=lora,
            actor_binding=binding,
            runtime=self.runtime,
            service_session_cuid="ss-test",
            limits=TrainingLimits(MAX_SAMPLES_PER_REQUEST, 65536, 8192),
            model_alias=model_id,
        )


def _datum(item: Any) -> Datum:
    """The datum a wire item carries: cross_entropy's weights, or a policy loss's inputs."""
    tokens = [t for chunk in item.model_input.chunks for t in chunk.tokens]
    inputs = {"target_tokens": np.asarray(item.target_ids, dtype=np.int64)}
    if item.weights is not None:
        inputs["weights"] = np.asarray(item.weights, dtype=np.float32)
    else:
        inputs["logprobs"] = np.asarray(item.logprobs, dtype=np.float32)
        inputs["advantages"] = np.asarray(item.advantages, dtype=np.float32)
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _counted(item: Any) -> int:
    """Targets the service normalises by: not -100 and, with weights, weighted."""
    weights = item.weights if item.weights is not None else [1.0] * len(item.target_ids)
    return sum(1 for t, w in zip(item.target_ids, weights, strict=True) if t != -100 and w != 0)
