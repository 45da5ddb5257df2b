"""A local training backend with pytrio's client surface, on torch + transformers.

``LocalServiceClient`` stands where ``pytrio.ServiceClient`` stands, so every trainer runs
and is tested offline on the same calls it makes against the service:
``create_lora_training_client`` -> ``forward_backward(datums, loss_fn, loss_fn_config)``,
``forward_backward_custom(datums, loss_fn, loss_fn_config)`` (a loss written in torch),
``optim_step(AdamParams)``, ``save_weights_and_get_sampling_client()`` -> ``sample(...)``,
``compute_logprobs``, ``save_state`` / ``load_state(_with_optimizer)`` and
``create_training_client_from_state(_with_optimizer)``. Inputs and outputs are pytrio's own
types; batches are validated and counted by pytrio's own planner, so a batch the service
would reject is rejected here with the same message. Calls run eagerly and return completed
``APIFuture``s (``.result()`` works as with the service).

Beyond pytrio: ``create_full_training_client`` fine-tunes every weight (useful for tiny
models), and a ``base_model`` is any spec of ``agent_gym_train.backends.models``
(``smollm2``, ``tiny``, a local Hugging Face directory). Checkpoint paths are plain directories.

The learner computes only what the trained positions depend on, with the same loss and
gradient as the full-logits pass: the LM head and log-softmax run only where a target trains
(``agent_gym_train.backends.logprobs``), rows stop at their last trained position, and rows opening
with the same untrained prompt (a GRPO group, TEMPO's branches from one saved state) run that
prompt once per call, whatever microbatches they fall into
(``agent_gym_train.backends.prefix``). Checkpoints: ``agent_gym_train.backends.checkpoints``.
``device`` and ``threads`` pick where it runs (``agent_gym_train.backends.runtime``).
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from pytrio import AdamParams, Datum
from pytrio.client.training import CustomLossFn, _invoke_custom_loss
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import ValidationError
from pytrio.model.limits import TrainingLimits
from pytrio.types import (
    APIFuture,
    ForwardBackwardOutput,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent_gym_train.backends import IGNORE_TARGET
from agent_gym_train.backends.checkpoints import (
    TrainingSetup,
    load_checkpoint,
    read_setup,
    save_checkpoint,
)
from agent_gym_train.backends.logprobs import split_model, target_logprobs
from agent_gym_train.backends.losses import check_loss, token_losses
from agent_gym_train.backends.models import DEFAULT_MODEL, cache_dir, load_model, load_tokenizer
from agent_gym_train.backends.prefix import (
    MIN_SHARED_PREFIX,
    SharedPrefix,
    recompute_layers,
    shared_prefixes,
)
from agent_gym_train.backends.runtime import (
    apply_threads,
    autocast,
    resolve_device,
    return_freed_memory,
    sampler_dtype,
)
from agent_gym_train.backends.sampler import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_ROWS,
    LocalSamplingClient,
    sampling_copy,
)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


CPU_MICROBATCH_TOKENS = 1024


class LocalServiceClient:
    """Creates local training and sampling clients.

    Args:
        checkpoint_dir: where ``save_state``/``save_weights_for_sampler`` write; each
            training client gets its own sub-directory. Default: ``<cache>/checkpoints``.
        microbatch_tokens: padded tokens per forward pass inside one ``forward_backward``
            (bounds memory; the gradient does not depend on it). ``None``: 1024 on CPU,
            where the saved activations of SmolLM2-135M cost about 1.2 MB a token and a
            4096-token pass peaked at 11.4 GB against 5.2 GB at 1024 for the same CPU time
            (8 datums x 500 tokens, LoRA r32); 4096 on an accelerator.
        device: ``auto`` (CUDA, then MPS, else CPU) | ``cpu`` | ``cuda[:N]`` | ``mps``.
        threads: torch intra-op threads for this process; ``None`` = the thread policy's
            default (``runtime.default_threads``: free cores, or ``$AGENT_GYM_THREADS``).
        logit_chunk: trained positions per LM-head chunk in the learner (bounds the logits
            held at once: ``logit_chunk x vocabulary`` floats). ``None``: 512, or 128 with
            ``activation_checkpointing``, whose point is memory: there a 512-position chunk
            was 0.3 of a 1.0 GB peak (SmolLM2-135M, 1024-token microbatches), for the same time.
        activation_checkpointing: recompute each decoder layer's activations in the backward
            pass instead of keeping them (``recompute_layers``): the same gradient for a
            third of the peak memory and about 1.4x the learner's time (SmolLM2-135M on a CPU).
        sampler_max_rows / kv_cache_bytes / scoring_cache_bytes: each sampler's batch size
            and the memory of its two prefix caches (see ``LocalSamplingClient``).
        sampler_precision: ``float32`` (samplers hold the learner's exact weights, so an
            on-policy importance ratio is 1) or ``bfloat16`` (a rounded copy, faster to
            decode where the hardware has bf16 units: ``runtime.sampler_dtype``; the sampled
            tokens' logprobs are the copy's, so the learner's ratio to them corrects the
            rounding as it corrects staleness: ``Objective.truncated``).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        microbatch_tokens: int | None = None,
        *,
        device: str | torch.device = "auto",
        threads: int | None = None,
        logit_chunk: int | None = None,
        activation_checkpointing: bool = False,
        sampler_max_rows: int = DEFAULT_MAX_ROWS,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        scoring_cache_bytes: int | None = None,
        sampler_precision: str = "float32",
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir or cache_dir() / "checkpoints")
        self.device = resolve_device(device)
        if microbatch_tokens is None:
            microbatch_tokens = CPU_MICROBATCH_TOKENS if self.device.type == "cpu" else 4096
        self.microbatch_tokens = microbatch_tokens
        self.threads = apply_threads(threads)
        if logit_chunk is None:
            logit_chunk = 128 if activation_checkpointing else 512
        if logit_chunk < 1:
            raise ValueError(f"logit_chunk must be at least 1, got {logit_chunk}")
        self.logit_chunk = logit_chunk
        self.activation_checkpointing = activation_checkpointing
        self.sampler_max_rows = sampler_max_rows
        self.kv_cache_bytes = kv_cache_bytes
        self.scoring_cache_bytes = scoring_cache_bytes
        self.sampler_dtype = sampler_dtype(sampler_precision, self.device)

    def make_sampler(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_id: str
    ) -> LocalSamplingClient:
        """A sampling client on ``model`` with this service's batching and cache settings."""
        return LocalSamplingClient(
            model, tokenizer, model_id, max_rows=self.sampler_max_rows,
            kv_cache_bytes=self.kv_cache_bytes, scoring_cache_bytes=self.scoring_cache_bytes,
        )

    def get_supported_models(self) -> list[str]:
        return [DEFAULT_MODEL, "tiny"]

    def create_lora_training_client(
        self,
        base_model: str = DEFAULT_MODEL,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> LocalTrainingClient:
        if rank < 1:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("LoRA needs at least one of train_mlp, train_attn, train_unembed")
        setup = TrainingSetup(base_model, rank, seed, train_mlp, train_attn, train_unembed)
        return LocalTrainingClient(setup, self)

    def create_full_training_client(
        self, base_model: str = DEFAULT_MODEL, seed: int | None = None
    ) -> LocalTrainingClient:
        """Fine-tune every weight (not offered by pytrio)."""
        return LocalTrainingClient(TrainingSetup(base_model, 0, seed), self)

    def create_sampling_client(
        self, base_model: str = DEFAULT_MODEL, model_path: str | None = None
    ) -> LocalSamplingClient:
        if model_path is None:
            tokenizer = load_tokenizer(base_model)
            model = load_model(base_model, tokenizer).to(self.device, self.sampler_dtype)
            return self.make_sampler(model, tokenizer, base_model)
        setup = read_setup(model_path)
        if setup.base_model != base_model:
            raise ValueError(
                f"{model_path} holds weights for {setup.base_model!r}, not {base_model!r}"
            )
        client = LocalTrainingClient(setup, self)
        client.load_state(model_path).result()
        return client.save_weights_and_get_sampling_client()

    def create_training_client_from_state(self, path: str) -> LocalTrainingClient:
        client = LocalTrainingClient(read_setup(path), self)
        client.load_state(path).result()
        return client

    def create_training_client_from_state_with_optimizer(self, path: str) -> LocalTrainingClient:
        client = LocalTrainingClient(read_setup(path), self)
        client.load_state_with_optimizer(path).result()
        return client


class LocalTrainingClient:
    """One training run: a model (LoRA-wrapped or fully trainable) and its optimizer."""

    def __init__(self, setup: TrainingSetup, service: LocalServiceClient) -> None:
        self.setup = setup
        self.model_id = setup.base_model
        self._service = service
        self._dir = service.checkpoint_dir / f"run-{uuid.uuid4().hex[:12]}"
        self.tokenizer = load_tokenizer(setup.base_model)
        self.device = service.device
        model = load_model(setup.base_model, self.tokenizer)
        with torch.random.fork_rng(devices=[]):
            if setup.seed is not None:
                torch.manual_seed(setup.seed)
            self.model = self._make_trainable(model).to(self.device)
        self._body, self._head = split_model(self.model)
        if service.activation_checkpointing:
            recompute_layers(self._body)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._optimizer: torch.optim.AdamW | None = None
        self.vocab_size = min(len(self.tokenizer), model.get_input_embeddings().num_embeddings)
        self._limits = TrainingLimits(
            max_batch_size=None,
            max_tokens_per_request=None,
            max_seq_len=getattr(model.config, "max_position_embeddings", None),
        )

    def _make_trainable(self, model: PreTrainedModel) -> torch.nn.Module:
        if not self.setup.lora_rank:
            return model.requires_grad_(True)
        targets = [
            *(ATTENTION_MODULES if self.setup.train_attn else ()),
            *(MLP_MODULES if self.setup.train_mlp else ()),
            *(("lm_head",) if self.setup.train_unembed else ()),
        ]
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        if not present.intersection(targets):
            raise ValueError(
                f"{self.setup.base_model} has none of the modules LoRA targets ({targets})"
            )
        config = LoraConfig(
            r=self.setup.lora_rank,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=[t for t in targets if t in present],
        )
        with warnings.catch_warnings():
            # peft warns that a tied lm_head adapter complicates merging; it is never merged.
            warnings.filterwarnings("ignore", message=".*tie(d)?_word_embeddings.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return get_peft_model(model, config)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    # ----------------------------------------------------------------- forward / backward
    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        return APIFuture.completed(self._run(data, loss_fn, loss_fn_config, auto_shift, False))

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of the batch's ``loss_mean`` (see ``losses``)."""
        return APIFuture.completed(self._run(data, loss_fn, loss_fn_config, auto_shift, True))

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        result = await asyncio.to_thread(self._run, data, loss_fn, loss_fn_config, auto_shift, True)
        return APIFuture.completed(result)

    def forward_backward_custom(
        self,
        data: Sequence[Datum],
        loss_fn: CustomLossFn,
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """A loss written in torch, run exactly as pytrio's client runs it.

        ``loss_fn(data, logprobs[, loss_fn_config])`` gets the datums and, per datum, a
        leaf tensor of the learner's target logprobs (0 where the target is ``-100``: only
        trained positions are computed) and returns ``(scalar loss, metrics)``. As in
        pytrio's ``TrainingClient._forward_backward_custom``: one ``forward``; the loss and
        its gradient ``g`` with respect to those logprobs, here; then one
        ``forward_backward`` of ``cross_entropy`` with weights ``-g``, whose parameter
        gradient is ``g`` pushed through the model divided by that pass's token count (the
        positions where ``g`` is nonzero). The metrics are that pass's, updated with the
        loss's own. pytrio's own helper decides whether the config is passed.
        """
        return APIFuture.completed(self._run_custom(list(data), loss_fn, loss_fn_config))

    async def forward_backward_custom_async(
        self,
        data: Sequence[Datum],
        loss_fn: CustomLossFn,
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        result = await asyncio.to_thread(self._run_custom, list(data), loss_fn, loss_fn_config)
        return APIFuture.completed(result)

    def _run_custom(
        self, data: list[Datum], loss_fn: CustomLossFn, loss_fn_config: dict[str, object] | None
    ) -> ForwardBackwardOutput:
        if not data:
            raise ValidationError("training data cannot be empty",
                                  code="validation.empty_training_data")
        scored = self._run(data, "cross_entropy", None, False, False)
        logprobs = [
            torch.tensor(out["logprobs"].data, dtype=torch.float32)
            .reshape(out["logprobs"].shape).requires_grad_(True)
            for out in scored.loss_fn_outputs
        ]
        loss, custom_metrics = _invoke_custom_loss(loss_fn, data, logprobs, loss_fn_config)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("a custom loss must return (a scalar torch tensor, a metrics dict)")
        loss.backward()
        linear: list[Datum] = []
        for datum, logprob in zip(data, logprobs, strict=True):
            if logprob.grad is None:
                raise ValidationError(
                    "Custom loss output has no gradients. Ensure loss_fn returns a tensor "
                    "with gradients.", code="validation.missing_custom_loss_gradient")
            linear.append(Datum(
                model_input=datum.model_input,
                loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"],
                                "weights": TensorData.from_torch(-logprob.grad.detach())},
            ))
        result = self._run(linear, "cross_entropy", None, False, True)
        return ForwardBackwardOutput(loss_fn_outputs=result.loss_fn_outputs,
                                     metrics={**result.metrics, **custom_metrics})

    def _run(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, object] | None,
        auto_shift: bool,
        backward: bool,
    ) -> ForwardBackwardOutput:
        if auto_shift:
            raise ValueError(
                "the local backend takes pre-shifted datums (auto_shift=False), as "
                "agent_gym_train.run.episode builds them"
            )
        loss_fn = loss_fn.strip().lower()
        config = check_loss(loss_fn, loss_fn_config)
        if not all(isinstance(d, Datum) for d in data):
            raise TypeError("forward_backward takes a list of pytrio.Datum")
        plan = plan_training_batch(
            list(data), loss_fn=loss_fn, auto_shift=False, limits=self._limits,
            tokenizer_vocab_size=self.vocab_size,
        )
        samples = [s for chunk in plan.chunks for s in chunk.samples]
        denominator = plan.totals.total_active_tokens
        outputs: list[dict[str, TensorData]] = [{} for _ in samples]
        loss_sum = 0.0
        trains = [_trains(s, loss_fn) for s in samples]
        leads = [s.model_input.to_ints()[: t.index(True)] if True in t else None
                 for s, t in zip(samples, trains, strict=True)]
        # Rows opening with the same untrained tokens (a GRPO group's prompt, TEMPO branches'
        # resumed history) run that prefix once for all their microbatches, not once each.
        for rows, shared in shared_prefixes(leads, MIN_SHARED_PREFIX):
            with torch.set_grad_enabled(backward), autocast(self.device):
                prefix = (SharedPrefix(self._body, leads[rows[0]], self.device)
                          if shared else None)
            budget = max(1, self._service.microbatch_tokens - shared)
            suffixes = [len(samples[r].model_input) - shared for r in rows]
            for part in microbatches(suffixes, budget):
                batch = [samples[rows[i]] for i in part]
                counted = [trains[rows[i]] for i in part]
                with torch.set_grad_enabled(backward):
                    terms, logprobs, lengths = self._losses(batch, counted, loss_fn, config,
                                                            prefix)
                    total = terms.sum()
                    if backward and denominator and total.requires_grad:  # else nothing trains
                        (total / denominator).backward()
                loss_sum += float(total.detach())
                for i, (row, length) in enumerate(zip(part, lengths, strict=True)):
                    outputs[rows[row]] = {
                        "logprobs": TensorData.from_torch(logprobs[i, :length].detach().cpu()),
                        "elementwise_loss": TensorData.from_torch(
                            terms[i, :length].detach().cpu()
                        ),
                    }
            if prefix is not None and backward:
                prefix.backward()
            prefix = None  # released before the next group's prefix is built
        return ForwardBackwardOutput(
            loss_fn_outputs=outputs,
            metrics={
                "loss_sum": loss_sum,
                "loss_mean": loss_sum / denominator if denominator else 0.0,
                "token_count": float(denominator),
            },
        )

    def _losses(
        self, batch: Sequence[Any], trains: Sequence[Sequence[bool]], loss_fn: str,
        config: dict[str, float], prefix: SharedPrefix | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Per-token losses and target logprobs of one microbatch (``trains``: its rows'
        trained positions, ``_trains``) whose rows all open with ``prefix`` (already
        computed), or share nothing."""
        lengths = [len(s.model_input) for s in batch]
        width = max(lengths)

        def padded(
            rows: Sequence[Sequence[float]], fill: float | bool, dtype: torch.dtype
        ) -> torch.Tensor:
            out = torch.full((len(rows), width), fill, dtype=dtype)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=dtype)
            return out

        ids = padded([s.model_input.to_ints() for s in batch], 0, torch.long)
        targets = padded([s.target_tokens for s in batch], IGNORE_TARGET, torch.long)
        counted = padded(trains, False, torch.bool)
        if loss_fn == "cross_entropy":
            inputs = {"weights": padded([s.weights for s in batch], 0.0, torch.float32)}
        else:
            inputs = {
                "logprobs": padded([s.logprobs for s in batch], 0.0, torch.float32),
                "advantages": padded([s.advantages for s in batch], 0.0, torch.float32),
            }
        device = self.device
        ids, targets, counted = (t.to(device) for t in (ids, targets, counted))
        inputs = {k: v.to(device) for k, v in inputs.items()}
        logprobs = torch.zeros(counted.shape, dtype=torch.float32, device=device)
        with autocast(device):
            rows, positions, hidden = self._trained_hidden(ids, counted, prefix)
            # Only positions that train reach the LM head (see agent_gym_train.backends.logprobs).
            picked = target_logprobs(self._head, hidden, targets[rows, positions],
                                     self._service.logit_chunk)
        logprobs = logprobs.index_put((rows, positions), picked)
        return token_losses(loss_fn, logprobs, inputs, counted, config), logprobs, lengths

    def _trained_hidden(
        self, ids: torch.Tensor, counted: torch.Tensor, prefix: SharedPrefix | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Final hidden states at the counted positions: (rows, positions, [M, hidden]).

        Only what those positions depend on is computed: a row runs up to its last counted
        position (later ones cannot influence it), rows with nothing counted not at all,
        and a shared ``prefix`` not again (the rows continue from its keys and values).
        """
        flags = counted.cpu()
        members = flags.any(dim=1).nonzero()[:, 0].tolist()
        if not members:  # nothing trains in this microbatch
            empty = torch.zeros(0, dtype=torch.long, device=ids.device)
            return empty, empty, torch.zeros(0, 0, device=ids.device)
        last = flags.shape[1] - 1 - flags.flip(1).int().argmax(dim=1)
        index = torch.tensor(members, device=ids.device)
        ends = (last[members] + 1).to(ids.device)
        width = int(ends.max())
        columns = torch.arange(width, device=ids.device)
        mask = (columns[None] < ends[:, None]).long()
        start = prefix.length if prefix is not None else 0
        if prefix is not None:
            hidden = self._body(
                input_ids=ids[index, start:width], attention_mask=mask,
                position_ids=columns[start:][None].expand(len(members), -1),
                cache=prefix.cache(len(members)), use_cache=True,
            ).last_hidden_state
        else:
            hidden = self._body(input_ids=ids[index, :width], attention_mask=mask,
                                use_cache=False).last_hidden_state
        local = counted[index, :width].nonzero(as_tuple=True)
        return index[local[0]], local[1], hidden[local[0], local[1] - start]

    # ----------------------------------------------------------------- optimizer
    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradients, then clear them."""
        if not isinstance(adam_params, AdamParams):
            raise TypeError("optim_step takes a pytrio.AdamParams")
        optimizer = self._ensure_optimizer()
        for group in optimizer.param_groups:
            group["lr"] = adam_params.learning_rate
            group["betas"] = (adam_params.beta1, adam_params.beta2)
            group["eps"] = adam_params.eps
            group["weight_decay"] = adam_params.weight_decay
        limit = adam_params.grad_clip_norm if adam_params.grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, limit)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return_freed_memory()  # this step's activations, the previous sampler's caches
        return APIFuture.completed(
            OptimStepResponse(
                metrics={"grad_norm": float(norm), "learning_rate": adam_params.learning_rate}
            )
        )

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return await asyncio.to_thread(self.optim_step, adam_params)

    def _ensure_optimizer(self) -> torch.optim.AdamW:
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        return self._optimizer

    # ----------------------------------------------------------------- sampling
    def save_weights_and_get_sampling_client(self, name: str | None = None) -> LocalSamplingClient:
        """A sampler on a frozen copy of the current weights (``sampling_copy``), in the
        service's sampler precision."""
        snapshot = sampling_copy(self.model, self._service.sampler_dtype)
        return self._service.make_sampler(snapshot, self.tokenizer, self.model_id)

    def create_sampling_client(self, model_path: str) -> LocalSamplingClient:
        return self._service.create_sampling_client(self.model_id, model_path)

    def save_adapter(self, path: Path) -> None:
        """The LoRA adapter as it is now, in PEFT's format (what an inference engine loads:
        ``agent_gym_train.backends.vllm``). The embedding stays the base model's: no
        adapter trains it, so it is not saved."""
        if not self.setup.lora_rank:
            raise ValueError("full fine-tuning has no adapter to save: an inference engine "
                             "would reload every weight after each update")
        self.model.save_pretrained(path, save_embedding_layers=False)

    # ----------------------------------------------------------------- checkpoints
    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        """Weights and optimizer state, for resuming; ``ttl_seconds`` is ignored locally."""
        path, size = save_checkpoint(self._dir, name, self.model, self.setup,
                                     overwrite=overwrite, optimizer=self._ensure_optimizer)
        return APIFuture.completed(SaveWeightsResponse(path=path, model=self.model_id, size=size))

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        path, size = save_checkpoint(self._dir, f"sampler-{name}", self.model, self.setup,
                                     overwrite=False)
        return APIFuture.completed(
            SaveWeightsForSamplerResponse(path=path, model=self.model_id, size=size)
        )

    def load_state(self, path: str) -> APIFuture[dict[str, object]]:
        load_checkpoint(path, self.model, self.setup)
        return APIFuture.completed({})

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict[str, object]]:
        load_checkpoint(path, self.model, self.setup, optimizer=self._ensure_optimizer)
        return APIFuture.completed({})

def _trains(sample: Any, loss_fn: str) -> list[bool]:
    """Which positions of a sample train: a target, with a nonzero weight under
    ``cross_entropy`` (a zero-weight position adds nothing, so nothing is computed for it)."""
    if loss_fn == "cross_entropy":
        return [t != IGNORE_TARGET and w != 0
                for t, w in zip(sample.target_tokens, sample.weights, strict=True)]
    return [t != IGNORE_TARGET for t in sample.target_tokens]


def microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive runs of indices whose padded size (rows x longest) stays within ``budget``."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        if current and max(longest, length) * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups
