"""`HfEngine`: the transformers backend of the rollout server (reference and tests, not throughput).

Every blocking call (generate, weight apply) runs on ONE dedicated worker thread, so `/health` stays
responsive and an update committed during a generation waits for it: in-flight requests finish on the old
weights and no request sees a mix.

A causal LM loads as `AutoModelForCausalLM`; a vision-language checkpoint (Qwen-VL, `is_vl_checkpoint`) as
`AutoModelForImageTextToText` with its `AutoProcessor`, and serves image prompts. A request is resolved and
checked exactly as the vLLM engine does it (`vllm.inputs.resolve_prompt`: chat template, ms-swift `images`
placed, one `<|image_pad|>` per image, the same 400s), then encoded by
`shared_schemas.torch_common.prompts.MessageEncoder.encode`, the encoder of the learner's teacher forcing and
colocated HF engine: the processor expands each placeholder to the image's token count, so `prompt_token_ids`
are the expanded ids (what vLLM returns, and what the learner's alignment check re-encodes). Images are
decoded by `vllm.inputs.load_image` (an unreadable one is a 400 `bad_image`);
`server.vllm.mm_processor_kwargs` go into every processor call, as vLLM passes them. The decode loop
(`hf_decode`) takes each image prompt's vision tensors and M-RoPE positions as a `VisionRow`. Image prompts
need `messages`: `prompt_token_ids` with `images` is a 400 `images_need_messages` here (the processor expands
text, not ids; the vLLM backend takes them).

Model, encoder, end-of-rollout ids, decode loop and results are the `hf_decoder.HfDecoder` this engine holds,
the same decoder as the learner's colocated HF backend's (`learner.rollout.colocate.hf`); the engine adds
the worker thread, the request checks above and the weight syncs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from rollout_server.config import ServerConfig
from rollout_server.engines.base import (
    AdapterUpdate,
    BucketLayout,
    EngineHealth,
    FullUpdate,
    ParamSpec,
    ReceivedUpdate,
    Rendezvous,
    SharedUpdate,
    StagedUpdate,
    check_adapter_request,
    check_prompt_lengths,
)
from rollout_server.engines.hf_decoder import EncodedRequest, HfDecoder
from rollout_server.engines.vllm.inputs import load_image, resolve_prompt
from rollout_server.errors import BadRequestError, EngineError, LoraDisabledError, SyncValidationError
from rollout_server.weights.group_receive import open_receiver_group, receive_buckets
from shared_schemas.buckets import dtype_code
from shared_schemas.checkpoints import is_vl_checkpoint
from shared_schemas.infer import InferBatch, InferRequest, InferResult
from shared_schemas.torch_common.process_group import retire_group
from shared_schemas.torch_common.prompts import ChatTemplateError, MessageEncoder

logger = logging.getLogger(__name__)

__all__ = ["HfEngine"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""`server.dtype` → the dtype the model is loaded in; any other value (`auto`) keeps the checkpoint's own."""


class HfEngine:
    """A transformers causal LM (or Qwen-VL model) behind the `Engine` protocol.

    Args:
        model: a loaded causal LM or image-text-to-text model, in eval mode.
        tokenizer: its tokenizer (chat template included).
        model_name: what `/health` reports as `model` (the resolved local directory).
        max_model_len: prompt + new tokens limit.
        batch_size: rows (request × completion) per decode call.
        default_seed: base seed when a request config has none.
        processor: the model's HF processor (a vision-language model); None = text prompts only (images are a
            400 `images_unsupported`, as on a vLLM server of a text model).
        processor_kwargs: extra keyword arguments of every processor call (`server.vllm.mm_processor_kwargs`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        batch_size: int = 8,
        default_seed: int = 0,
        processor: Any | None = None,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._model = model
        self._decoder = HfDecoder(
            model,
            tokenizer,
            encoder=MessageEncoder.for_model(
                model, tokenizer, processor, processor_kwargs=processor_kwargs, load_image=load_image
            ),
            batch_size=batch_size,
            default_seed=default_seed,
            no_eos=lambda: EngineError(
                "the model defines no eos token id; set eos_token_id in its generation_config"
            ),
        )
        self._placeholder_id = (
            getattr(model.config, "image_token_id", None) if processor is not None else None
        )
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._version = 0
        self._closed = False
        self._group: Any = (
            None  # collective weight-sync group (`weights.group_receive`), joined at a sync's begin
        )
        self._group_token: str | None = None
        self._received: dict[str, torch.Tensor] = {}
        self.last_update_stages: dict[str, float] = {}
        """The last collective receive's staging figures (`staging_device_bytes`, `staging_host_bytes`) and
        the last apply's `commit_copy_s`, added to the sync's `stages`."""
        self._receive_stages: dict[str, float] = {}
        self._received_buffers: list[torch.Tensor] = []
        self._live_buffers: list[torch.Tensor] = []
        """Bucket buffers the parameters are views of since the last swapped commit (see `_swap_in`)."""
        self._spare_buffers: list[torch.Tensor] = []
        """Bucket buffers no parameter reads any more: the next collective receive lands in them."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._specs = {name: (dtype_code(t.dtype), tuple(t.shape)) for name, t in model.state_dict().items()}

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> HfEngine:
        """Loads model and tokenizer (and a VL model's processor) from `cfg.model_path` (local files only;
        blocking, ~seconds). Without torchvision a Qwen-VL processor needs the import shim that
        `python -m rollout_server` installs for a VL checkpoint (`shared_schemas/vlm_shim/`)."""
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForImageTextToText,
            AutoProcessor,
            AutoTokenizer,
        )

        path = cfg.model_path
        if not path.is_dir():
            raise FileNotFoundError(
                f"server.model {cfg.model!r} resolves to {path}, which is not a directory"
            )
        dtype = _TORCH_DTYPES.get(cfg.dtype, "auto")
        processor = None
        if is_vl_checkpoint(path):
            processor = AutoProcessor.from_pretrained(path, local_files_only=True)
            tokenizer = processor.tokenizer
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        if torch.cuda.is_available():
            model = model.to("cuda")
            _one_cpu_thread()
        model.eval()
        return cls(
            model,
            tokenizer,
            model_name=str(path),
            max_model_len=cfg.vllm.max_model_len,
            batch_size=cfg.hf.batch_size,
            default_seed=cfg.seed,
            processor=processor,
            processor_kwargs=cfg.vllm.mm_processor_kwargs,
        )

    @property
    def lora_enabled(self) -> bool:
        """Always False: this backend serves full weights only."""
        return False

    @property
    def weight_version(self) -> int:
        """Version of the weights served now."""
        return self._version

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """State-dict names (tied duplicates included) → (dtype code, shape)."""
        return self._specs

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._closed:
            raise EngineError("engine is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request on the worker thread; see `Engine.generate`."""
        check_adapter_request(batch.request_config.adapter, self.lora_enabled, ())
        return await self._run(self._generate_sync, batch)

    def _generate_sync(self, batch: InferBatch) -> list[InferResult]:
        version = self._version
        cfg = batch.request_config
        encoded = [self._encode(r, batch.first_index + i) for i, r in enumerate(batch.infer_requests)]
        check_prompt_lengths(
            [len(ids) for ids, _ in encoded], cfg.max_tokens, self._max_model_len, batch.first_index
        )
        return self._decoder.generate(batch, encoded, version=version)

    def _encode(self, request: InferRequest, index: int) -> EncodedRequest:
        """Prompt ids of one request and, for an image prompt, its vision inputs (see the module doc).

        Raises:
            BadRequestError: what the vLLM engine refuses (`resolve_prompt`), an unreadable image, or images
                beside `prompt_token_ids`.
        """
        resolved = resolve_prompt(
            self._decoder.tokenizer, request, index, placeholder_id=self._placeholder_id
        )
        if not resolved.refs:
            return resolved.prompt_token_ids, None
        if resolved.messages is None:
            raise BadRequestError(
                f"request {index}: server.backend 'hf' takes images only with chat messages (the processor"
                " expands the placeholders of the prompt text); send messages instead of prompt_token_ids, or"
                " serve with server.backend: vllm",
                type="images_need_messages",
            )
        try:
            return self._decoder.encode_messages(resolved.messages, index)
        except ChatTemplateError as exc:
            raise EngineError(str(exc)) from exc

    @property
    def collective_ranks(self) -> int:
        """One receiver: this server process."""
        return 1

    def holds_group(self, group: str) -> bool:
        """Whether this process joined weight-sync group `group` at an earlier sync."""
        return self._group_token == group

    async def receive_collective(
        self, rendezvous: Rendezvous, first_rank: int, buckets: BucketLayout
    ) -> None:
        """Collective transport: receives every bucket on a thread of its own (generation goes on) into the
        model's device and stages it (`rendezvous.staging`: GPU or pinned host memory) for
        `apply_update(ReceivedUpdate)`; the same receive function as the vLLM workers'.
        """
        try:
            await asyncio.to_thread(self._receive, rendezvous, first_rank, buckets)
        except Exception as exc:
            self._group = self._group_token = None  # retired by `_receive` when a broadcast failed
            raise EngineError(
                f"receiving weights over the {rendezvous.backend} group at {rendezvous.master_address}:"
                f"{rendezvous.master_port} failed ({type(exc).__name__}: {exc})"
            ) from exc

    def _receive(self, rendezvous: Rendezvous, first_rank: int, buckets: BucketLayout) -> None:
        self._received = {}
        self._receive_stages = {}
        if self._group_token != rendezvous.group:
            self._group = None  # the previous group (no broadcast pending) is torn down before the new one
            self._group = open_receiver_group(rendezvous, first_rank)
            self._group_token = rendezvous.group
        device = next(self._model.parameters()).device
        spare, self._spare_buffers = self._spare_buffers, []
        try:
            received = receive_buckets(
                self._group,
                buckets,
                device=device,
                timeout_s=rendezvous.timeout_s,
                staging=rendezvous.staging,
                reuse=spare,
            )
        except Exception:
            retire_group(self._group)  # a broadcast may still be pending: never torn down on this thread
            self._group = self._group_token = None
            raise
        self._received = dict(received.tensors)
        self._received_buffers = received.buffers
        self._receive_stages = received.stages

    async def apply_update(self, update: StagedUpdate) -> None:
        """Loads full weights atomically on the worker thread (after any running generation)."""
        if isinstance(update, AdapterUpdate):
            raise LoraDisabledError("the hf backend serves no adapters; sync full weights")
        if isinstance(update, SharedUpdate):
            raise SyncValidationError(
                "the hf engine takes no CUDA-IPC handoff (a colocated vLLM's); send safetensors buckets",
                type="handoff_unsupported",
            )
        await self._run(self._apply_full, update)

    def _staged_tensors(self, update: FullUpdate | ReceivedUpdate) -> dict[str, torch.Tensor]:
        if isinstance(update, ReceivedUpdate):
            received, self._received = self._received, {}
            if set(received) != set(update.names):
                raise SyncValidationError(
                    "the tensors received over the collective transport are not the manifest's"
                )
            return received
        staged: dict[str, torch.Tensor] = {}
        for bucket in update.buckets:
            tensors = load_file(str(bucket)) if isinstance(bucket, Path) else load_safetensors(bucket)
            staged.update(tensors)
        return staged

    def _apply_full(self, update: FullUpdate | ReceivedUpdate) -> None:
        staged = self._staged_tensors(update)
        for name, tensor in staged.items():
            spec = self._specs.get(name)
            if spec is None or (dtype_code(tensor.dtype), tuple(tensor.shape)) != spec:
                raise SyncValidationError(f"tensor {name!r} does not match the served parameter table")
        state = self._model.state_dict()
        started = time.perf_counter()
        buffers, self._received_buffers = self._received_buffers, []
        # Everything is decoded and checked before the first write: a bad bucket leaves the model untouched.
        if isinstance(update, ReceivedUpdate) and self._swap_in(staged, buffers):
            stages = {"commit_swap_s": time.perf_counter() - started}
        else:
            with torch.no_grad():
                for name, tensor in staged.items():
                    state[name].copy_(tensor, non_blocking=True)
            if any(t.is_cuda for t in state.values()):
                # The staged buffers are freed after this: the copies must be done. This thread's stream only:
                # a device-wide synchronize would also wait for a receive stuck behind a dead learner.
                torch.cuda.current_stream().synchronize()
            stages = {"commit_copy_s": time.perf_counter() - started}
        if isinstance(update, ReceivedUpdate):
            stages.update(self._receive_stages)
        self.last_update_stages = stages
        self._version = update.version
        logger.info("hf engine: weights version %d applied (%d tensors)", update.version, len(staged))

    def _swap_in(self, staged: dict[str, torch.Tensor], buffers: list[torch.Tensor]) -> bool:
        """Commits a collective sync staged on the model's device WITHOUT copying: every parameter is rebound
        to its received tensor (a view of a received bucket buffer), on the engine thread between
        generations, so no request sees a mix. The bucket buffers the parameters viewed until now become the
        spares the next sync is received into (no allocation, no copy; steady state: two model copies, as with
        a copy commit).

        Only when the update covers every parameter and buffer of the model, each received on its device (else
        False: the caller copies).
        """
        params = dict(self._model.named_parameters())
        persistent = {
            name: value
            for name, value in self._model.state_dict(keep_vars=True).items()
            if name not in params and not isinstance(value, torch.nn.Parameter)
        }
        if set(staged) != set(params) | set(persistent):
            return False
        if any(staged[name].device != p.device for name, p in params.items()):
            return False
        with torch.no_grad():
            for name, param in params.items():
                param.data = staged[name]
            for name, value in persistent.items():
                value.copy_(staged[name])
        first = not self._live_buffers
        if any(p.is_cuda for p in params.values()):
            # Generations queued on this thread's stream read the old weights; once they are done, the buffers
            # that held them may be received into (never a device-wide synchronize: see `_apply_full`).
            torch.cuda.current_stream().synchronize()
            if first:
                torch.cuda.empty_cache()  # the loaded weights' memory, in a pool the receives never draw from
        self._spare_buffers, self._live_buffers = self._live_buffers, buffers
        return True

    async def health(self) -> EngineHealth:
        """Status without touching the worker thread (answers during a generation)."""
        return EngineHealth(
            status="error" if self._closed else "ok",
            engine="hf",
            model=self._model_name,
            weight_version=self._version,
            dp=1,
            tp=1,
            lora_enabled=False,
            max_model_len=self._max_model_len,
            detail="engine closed" if self._closed else None,
        )

    async def aclose(self) -> None:
        """Waits for the running call, then stops the worker thread."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown, wait=True)


def _one_cpu_thread() -> None:
    """A GPU engine computes on the GPU; its CPU work per decode step is small tensor bookkeeping. With
    torch's default of one intra-op thread per core, several servers on one host spin their OpenMP pools
    against each other (measured: 3 HF servers on a 64-core 4 x H200 host, a decode step 25 -> 44 ms while
    all three ran). So, as vLLM does for its GPU workers, one thread unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        logger.info(
            "hf engine on GPU: torch CPU threads %d -> 1 (set OMP_NUM_THREADS to choose)",
            torch.get_num_threads(),
        )
        torch.set_num_threads(1)
