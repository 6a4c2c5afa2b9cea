"""`serve run deployments.app:build_app model=DIR tensor_parallel_size=N ...`: the application's
arguments, validated (strings from the command line are coerced; an unknown name is an error)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, create_model, model_validator

from model.protocol import PREFILL_CHUNK
from model.sampling.params import DecodeParams, settable_fields
from workers.scheduler import ADMISSION_STEPS

BATCH_INVARIANT_NEEDS_CUDA = "batch_invariant=true needs device=cuda (its fixed-order kernels are triton's)"


# The server-wide decoding defaults, overridable per request (`diffusion` object): DecodeParams' fields
# marked SERVER_DEFAULT, with its defaults, bounds and descriptions.
ServerDecodeDefaults = create_model("ServerDecodeDefaults", __config__=ConfigDict(extra="forbid", frozen=True),
                                    **settable_fields(server=True))


class AppArgs(ServerDecodeDefaults):
    model: str | None = Field(None, description="checkpoint directory; default: the tiny model shipped with the package")
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["compressed-tensors"] | None = Field(
        None, description="vLLM's --quantization: the method the checkpoint must be quantized with (a deploy "
        "error otherwise); None: its config.json decides")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    max_num_seqs: int = Field(8, ge=1, description="slots per replica")
    max_model_len: int = Field(2048, ge=1)
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot before 429")
    kv_cache_tokens: int | None = Field(None, ge=1, description="the KV cache's positions (pages of 16) per layer "
                                        "group; default: on CUDA what gpu_memory_utilization leaves, elsewhere "
                                        "max_num_seqs x (max_model_len + a canvas)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="the share of each GPU's memory this "
                                          "server's weights, steps and KV cache may take (KV cache sizing)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV of prompt prefixes and committed blocks "
                                        "that earlier requests wrote (content-addressed pages)")
    prefill_chunk_tokens: int = Field(PREFILL_CHUNK, ge=1, description="the most prompt positions a command "
                                      "prefills: a longer prompt is prefilled a chunk at a time between the running "
                                      "requests' steps")
    prefix_routing: bool = Field(True, description="with several replicas, send a request to the one that caches "
                                 "the most of its prompt (workers/prefix_router.py; with prefix caching only)")
    # A command runs at most this many steps on the shards without a host read (fewer when every
    # running request surely finishes sooner: model/phases.py); a request that finishes mid-command
    # waits for its end (latency), a shorter command costs more round trips (throughput).
    max_steps_per_command: int = Field(8, ge=1, le=256)
    overlap_commands: bool = Field(True, description="keep the next command queued at the shards while one runs "
                                   "(no idle round trip between commands; a request arriving then starts one "
                                   "command later)")
    admission_steps: int = Field(ADMISSION_STEPS, ge=1, le=256, description="the most steps of a command while a burst "
                                 "of requests may be arriving (workers/scheduler.py); max_steps_per_command "
                                 "or more: no short commands")
    batch_invariant: bool = Field(False, description="a request's tokens and logprobs the same bits alone or in any "
                                  "batch (CUDA; fixed-order kernels, slower: docs/performance.md)")
    num_replicas: int | None = Field(None, ge=1, description="model instances (default 1); not with "
                                     "autoscaling_config")
    # Serve's autoscaling of the coordinator deployment (ray.serve.config.AutoscalingConfig's fields:
    # min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...)
    autoscaling_config: dict | None = None
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # A replica's placement group still pending after this fails the replica (Serve then retries it); the
    # wait includes an autoscaler adding nodes for it, so a cluster that starts GPU nodes on demand needs
    # minutes. A group the cluster can never hold fails at once.
    placement_timeout_s: float = Field(300.0, gt=0)
    # CPUs each shard's bundle asks for on device=cpu: below 1, TP > 1 fits a machine with fewer cores
    # than tensor_parallel_size + 1 (the shards then share cores; each runs DLLM_SHARD_THREADS threads).
    shard_cpus: float = Field(1.0, gt=0)
    # Each choice of a request (n per prompt, a list of prompts in /v1/completions) is its own engine
    # request, holding its own slot: these bound what one request asks of the replica.
    max_n: int = Field(8, ge=1, description="the largest n a request may ask (a 400 naming n beyond)")
    max_choices: int = Field(64, ge=1, description="the most choices (prompts x n) one request may ask (a 400 "
                             "beyond)")
    api_key: str | None = None
    # A body is held whole in memory to be parsed; a 128K-token prompt is ~1 MB of JSON.
    max_body_bytes: int = Field(8 * 2**20, ge=1, description="the largest request body taken (a 413 beyond), "
                                "checked before the body is read whole")
    request_timeout_s: float = Field(600.0, gt=0)
    # A replica being stopped (a downscale, a redeploy, a shutdown) takes no new requests and finishes
    # those it has for up to this long (Serve's graceful_shutdown_timeout_s), then is killed. Stopping a
    # replica that is still pending or warming up waits this long too.
    drain_timeout_s: float = Field(20.0, ge=0)
    command_timeout_s: float = Field(120.0, gt=0)
    # A request's work is bounded by max_model_len (its canvases) times its steps per canvas, which
    # masked diffusion caps at the canvas length and DiffusionGemma does not: without this bound one
    # request could hold a slot until request_timeout_s and end in a 503 instead of a 400.
    denoising_steps_limit: int = Field(1024, ge=1, description="the most denoising steps per canvas a request "
                                       "may set (diffusion.max_denoising_steps; a 400 beyond)")

    @model_validator(mode="after")
    def _invariance_needs_cuda(self) -> "AppArgs":
        # device=auto is resolved from the cluster when the app is built (deployments/app.py build_app)
        if self.batch_invariant and self.device == "cpu":
            raise ValueError(BATCH_INVARIANT_NEEDS_CUDA)
        return self

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> "AppArgs":
        if self.autoscaling_config is None:
            return self
        if self.num_replicas is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both (Serve scales a deployment "
                             "either way, not both)")
        from ray.serve.config import AutoscalingConfig

        try:
            config = AutoscalingConfig(**self.autoscaling_config)
        except ValidationError as err:
            raise ValueError(f"autoscaling_config: {err}") from None
        if config.min_replicas < 1:
            raise ValueError("autoscaling_config.min_replicas must be at least 1: while no replica is ready "
                             "the ingress answers 503 at once, so no request would wake one")
        return self

    @model_validator(mode="after")
    def _defaults_the_engine_takes(self) -> "AppArgs":
        # DecodeParams' cross-field checks (t_max > t_min in fp32, ...) at deploy, not in every request's 400
        DecodeParams(**{k: v for k, v in self.decode_defaults().items() if v is not None})
        return self

    @model_validator(mode="after")
    def _default_steps_within_the_limit(self) -> "AppArgs":
        if self.max_denoising_steps is not None and self.max_denoising_steps > self.denoising_steps_limit:
            raise ValueError(f"max_denoising_steps={self.max_denoising_steps} is above denoising_steps_limit="
                             f"{self.denoising_steps_limit}")
        return self

    def model_dir(self) -> str:
        return self.model or str(default_model_dir())

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir()).name

    def initial_replicas(self) -> int:
        """The replicas Serve starts with."""
        if self.autoscaling_config is None:
            return self.num_replicas or 1
        return self.autoscaling_config.get("initial_replicas") or self.autoscaling_config.get("min_replicas", 1)

    def torch_dtype(self, device: str) -> str | None:
        """The shards' dtype on `device` (resolved from the cluster, not the build node)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device == "cuda" else None  # None: the checkpoint's own

    def engine_args(self) -> dict:
        """The coordinator's keyword arguments (workers/coordinator.py: Coordinator) from these."""
        return dict(num_slots=self.max_num_seqs, max_model_len=self.max_model_len, max_queue=self.max_queue,
                    max_steps_per_command=self.max_steps_per_command, request_timeout_s=self.request_timeout_s,
                    overlap_commands=self.overlap_commands, admission_steps=self.admission_steps,
                    enable_prefix_caching=self.enable_prefix_caching, prefill_chunk=self.prefill_chunk_tokens)

    def decode_defaults(self) -> dict:
        return {name: getattr(self, name) for name in ServerDecodeDefaults.model_fields}


def default_model_dir() -> Path:
    """The default model, shipped with the package: a tiny Nemotron-Labs-Diffusion checkpoint trained on
    the standard library's docstrings by model/train_tiny.py (served as `tiny-docstrings`)."""
    import model

    return Path(model.__file__).resolve().parent / "checkpoints" / "tiny-docstrings"
