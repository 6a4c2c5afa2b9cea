"""The OpenAI-compatible ingress and `build_app(args)` for `serve run` / `serve deploy`.

    serve run deployments.app:build_app model=DIR tensor_parallel_size=N

OpenAIIngress is a shim. Its duties: before a body is read, give the request its id, authorise
(optional bearer key) and bound the body's size (deployments/gate.py); validate (pydantic; a bad field
is a 400 naming it); tokenize in a thread after a character bound (deployments/prompts.py; chat
template for chat); fill what the request leaves out (max_tokens, the checkpoint's sampling defaults);
call the Coordinator deployment through a handle, detokenize and apply stop strings (cancelling the
request upstream when one hits), and answer as JSON or SSE (one chunk per committed block, drafts as
SSE comments between them when asked, then `data: [DONE]`), count requests by status for /metrics,
and serve the playground page. Every generation endpoint funnels into `_generate`; the coordinator
handle is injected, so tests and other front ends can swap it.
"""
# No `from __future__ import annotations`: FastAPI resolves endpoint annotations at runtime.
import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

# Counted through the module (`prom.REQUESTS`), never a name imported from it: deployments/errors.py says why.
from deployments import metrics as prom
from deployments.args import BATCH_INVARIANT_NEEDS_CUDA, AppArgs
from deployments.cluster import ClusterResources, resolve_device
from deployments.drafts import draft_event, draft_payload
from deployments.errors import ERROR_STATUS, APIError, add_handlers, error_body, validation_error_param
from deployments.gate import REQUEST_ID_PARAMETER, GateSettings, RequestGate
from deployments.output import Delta, OutputAssembler, chat_logprobs, completion_logprobs
from deployments.placement import PlacementWatch, never_placed
from deployments.prompts import PromptTokenizer
from deployments.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                  ChatCompletionStreamResponse, ChatDelta, ChatResponseMessage, ChatStreamChoice,
                                  CompletionChoice, CompletionRequest, CompletionResponse,
                                  CompletionStreamResponse, ModelCard, ModelList, Usage)
from model.checkpoint import Checkpoint, RunnerArgs
from model.sampling.params import DecodeParams, ParamError
from workers.serve_coordinator import REPLICA_BUNDLE, CoordinatorDeployment, placement_bundles, shard_bundle

app = FastAPI(title="dllm-serve", docs_url=None, redoc_url=None)
STATIC = Path(__file__).parent / "static"
app.mount("/static", StaticFiles(directory=STATIC), name="static")   # the playground's script and style
add_handlers(app)


def _gate_settings() -> GateSettings:
    """This replica's ingress's settings (the gate is built with the app, before any ingress exists)."""
    return serve.get_replica_context().servable_object.gate


app.add_middleware(RequestGate, settings=_gate_settings)
# the X-Request-Id header in the served schema, for clients and for the schemathesis fuzz
WITH_REQUEST_ID = {"parameters": [REQUEST_ID_PARAMETER]}

ENDPOINT = {"completion": "completions", "chat": "chat_completions"}   # request kind -> metrics label
HEALTH_DETAIL = ("num_slots", "free_slots", "running", "waiting", "shard_failures")
# A running coordinator answers its stats at once; Serve holds a call while no replica runs (one starting
# loads weights and captures CUDA graphs for minutes), so no answer within STATS_S means none is ready.
STATS_S, SHARD_PING_S = 2.0, 15.0
WARMING_UP = "warming up: no model replica is ready yet (loading weights, capturing CUDA graphs)"
STATE_REASON = {"starting": WARMING_UP, "rebuilding": "rebuilding the model shards after a failure",
                "down": "the model shards are down and could not be rebuilt"}


def sampling_defaults(checkpoint: Checkpoint) -> dict:
    """The sampling fields of the checkpoint's generation_config.json that apply to its family, used when
    a request is silent (vLLM's `--generation-config auto`): temperature, top_k and top_p; a
    uniform-noise family (DiffusionGemma) takes its temperature from its renoise schedule instead."""
    gen = checkpoint.generation
    fields = ("top_k", "top_p") if checkpoint.family.uniform_noise else ("temperature", "top_k", "top_p")
    values = {f: getattr(gen, f) for f in fields if getattr(gen, f) is not None}
    try:   # what the engine cannot take fails the deploy, not every request
        DecodeParams(**values)
    except ValidationError as err:
        raise ValueError(f"{checkpoint.path}/generation_config.json: {validation_error_param(err)[0]}") from None
    return values


def _last_line(err: Exception) -> str:
    """A remote exception's own message (Ray prefixes the whole remote traceback)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, coordinator: DeploymentHandle, args: dict, checkpoint: Checkpoint):
        from transformers import AutoTokenizer

        self.args = AppArgs(**args)
        self.gate = GateSettings(self.args.api_key, self.args.max_body_bytes, self.args.request_timeout_s)
        self.model_dir = checkpoint.path
        self.model_name = prom.REQUESTS.model = self.args.model_name()
        self.created = int(time.time())
        self.coordinator = coordinator
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompts = PromptTokenizer(self.tokenizer, self.args.max_model_len)
        config = checkpoint.config
        self.model_vocab_size = config.vocab_size
        self.defaults = self.args.decode_defaults() | sampling_defaults(checkpoint)
        self.max_new_tokens = checkpoint.generation.max_new_tokens   # caps a request's default length
        self.canvas_length = config.canvas_length  # for usage.diffusion.canvas_positions and drafts
        self.mask_id = config.mask_token_id        # a draft's masked positions (None: uniform-noise canvases)
        if checkpoint.renoise is not None:
            # the checkpoint's schedule where the server sets none, so that a request's t_min or t_max is
            # checked against the other end here (a 400), not in a shard (a failed step for every request)
            for end in ("t_min", "t_max"):
                if self.defaults[end] is None:
                    self.defaults[end] = getattr(checkpoint.renoise, end)
        self.model_ready = False   # once the coordinator said so: requests then go straight to it
        # the coordinator replicas' placement groups, for /health's reason and the placement timeout
        self.placement = PlacementWatch(serve.get_replica_context().app_name, self.args)
        self._watch = asyncio.get_running_loop().create_task(self.placement.run())

    # ---- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        """200 when a request would be served now: the coordinator is ready and its shards answer a ping,
        with the slot counts (a leak shows as free_slots below num_slots while nothing runs); 503 with the
        reason otherwise (warming up, rebuilding, down)."""
        stats = await self._ready_stats()
        await self._bounded(self.coordinator.check_health.remote(), SHARD_PING_S, "the model shards did not answer")
        return {"status": "ok", **{k: stats[k] for k in HEALTH_DETAIL}}

    @app.get("/v1/models", openapi_extra=WITH_REQUEST_ID)
    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    @app.get("/v1/models/{model_id:path}", openapi_extra=WITH_REQUEST_ID)
    async def model(self, model_id: str) -> ModelCard:
        """`client.models.retrieve`; the id may hold slashes (`org/name`)."""
        self._check_model(model_id)
        return self._card()

    @app.get("/playground")
    async def playground(self) -> FileResponse:
        return FileResponse(STATIC / "playground.html")

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        stats = await self._bounded(self.coordinator.stats.remote(), STATS_S)
        return PlainTextResponse(prom.prometheus_text(stats, self.model_name, prom.REQUESTS),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", openapi_extra=WITH_REQUEST_ID)
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = await self.prompts.text(body.prompt, "prompt")
        else:
            prompt = self.prompts.ids(body.prompt, "prompt")
        return await self._generate("completion", body, request, prompt, "prompt", "max_tokens")

    @app.post("/v1/chat/completions", openapi_extra=WITH_REQUEST_ID)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        prompt = await self.prompts.chat(body.template_messages(), "messages")
        length = "max_tokens" if body.max_completion_tokens is None and body.max_tokens is not None else \
            "max_completion_tokens"
        return await self._generate("chat", body, request, prompt, "messages", length)

    # ---- readiness --------------------------------------------------------------------------------
    async def _bounded(self, response, timeout_s: float, reason: str | None = None):
        """A coordinator call's result; 503 with `reason` if no replica answers within timeout_s (while a
        replica warms up or waits for its placement group, Serve holds calls until one runs; reason None:
        say which of the two), or with Ray's reason if it failed."""
        async def result():
            return await response
        try:
            return await asyncio.wait_for(result(), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            reason = reason or self.placement.reason() or WARMING_UP
            raise APIError(503, reason, "service_unavailable", headers={"Retry-After": "5"}) from None
        except DeploymentUnavailableError as err:   # it failed to deploy: say why, if placement is why
            raise self._failed_to_deploy(err) from None
        except RayError as err:
            raise APIError(503, f"unhealthy: {_last_line(err)}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None

    def _failed_to_deploy(self, err: DeploymentUnavailableError) -> APIError:
        reason = self.placement.reason()
        return APIError(503, err.message + (f" {reason}" if reason else ""), "service_unavailable")

    async def _ready_stats(self) -> dict:
        """The coordinator's stats if it is ready; 503 with what it is doing otherwise."""
        stats = await self._bounded(self.coordinator.stats.remote(), STATS_S)
        if stats["state"] != "ready":
            raise APIError(503, STATE_REASON.get(stats["state"], stats["state"]), "service_unavailable",
                           headers={"Retry-After": "5"})
        return stats

    # ---- the one request path -------------------------------------------------------------------
    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.args.max_model_len,
                         canvas_length=self.canvas_length)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", param="model", code="model_not_found")

    def _default_max_tokens(self, prompt_len: int, prompt_param: str):
        """mode -> the output tokens a request that names no length gets: what the prompt leaves of
        max_model_len (in whole canvases, which canvas modes write; the scheduler's own check), capped
        by generation_config.json's max_new_tokens; a 400 naming the prompt if that is nothing."""
        def default(mode: str) -> int:
            left = self.args.max_model_len - prompt_len
            room = left if mode == "ar" else left // self.canvas_length * self.canvas_length
            if room < 1:
                unit = "token" if mode == "ar" else f"canvas of {self.canvas_length} tokens"
                raise ParamError(f"the prompt has {prompt_len} tokens, which leaves no room for a {unit} within "
                                 f"max_model_len={self.args.max_model_len} ({mode} mode)", prompt_param)
            return min(room, self.max_new_tokens or room)
        return default

    async def _generate(self, kind: str, body, request: Request, prompt: list[int], prompt_param: str,
                        length_param: str):
        if not self.model_ready:   # a 503 now rather than a request held until a replica warms up
            await self._ready_stats()
            self.model_ready = True
        if len(prompt) >= self.args.max_model_len:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model allows at most "
                                f"{self.args.max_model_len - 1} before output", param=prompt_param)
        try:
            params = body.decode_params(self.defaults, self._default_max_tokens(len(prompt), prompt_param))
        except ParamError as err:
            raise APIError(400, err.message, param=err.param) from None
        limit = self.args.denoising_steps_limit   # the server's own default is within it (AppArgs)
        if params.max_denoising_steps is not None and params.max_denoising_steps > limit:
            raise APIError(400, f"max_denoising_steps={params.max_denoising_steps} is above this server's "
                                f"denoising_steps_limit={limit}", param="diffusion.max_denoising_steps")
        if params.top_k >= self.model_vocab_size:  # keeps every token: no filter, and no [.., top_k] buffers
            params = params.model_copy(update={"top_k": 0})
        # The response's id is the request's (X-Request-Id); the coordinator's adds a random suffix, so a
        # client reusing an id for requests in flight together gets them served, not refused as a clash.
        request_id = request.state.request_id
        response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id}"
        stream = self.coordinator.options(stream=True).generate.remote(
            prompt, params, f"{response_id}-{secrets.token_hex(6)}")
        try:
            first = await self._next(stream)
        except APIError as err:  # the engine names a completion's fields: this request's own names
            err.param = {"max_tokens": length_param, "prompt": prompt_param}.get(err.param, err.param)
            raise
        if first is None:
            raise APIError(503, "the model stopped without an answer", "service_unavailable")
        assembler = OutputAssembler(self.tokenizer, body.stop_strings)
        if body.stream:
            return StreamingResponse(self._sse_stream(kind, body, response_id, prompt, stream, assembler),
                                     media_type="text/event-stream")
        response = await self._collect(kind, body, response_id, prompt, stream, assembler)
        prom.REQUESTS.add(ENDPOINT[kind], 200)
        return response

    async def _next(self, stream):
        """The next output of the coordinator's stream, None at its end; errors become APIError."""
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return None
        except DeploymentUnavailableError as err:
            raise self._failed_to_deploy(err) from None
        except (RayError, RuntimeError) as err:  # the coordinator replica itself died or was replaced
            raise APIError(503, f"the model replica failed: {type(err).__name__}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None
        if "error" in item:
            status, type_ = ERROR_STATUS.get(item["error"], (500, "internal_error"))
            headers = {"Retry-After": "1"} if status in (429, 503) else None
            raise APIError(status, item["message"], type_, item["param"], headers)
        return item["output"]

    async def _outputs(self, stream, assembler: OutputAssembler) -> AsyncIterator[tuple[Delta, object]]:
        """Deltas of text until the request finishes or a stop string ends it (then upstream is cancelled)."""
        try:
            while True:
                out = await self._next(stream)
                if out is None:
                    yield assembler.finish(), None
                    return
                delta = assembler.add(out)
                yield delta, out
                if delta.finish_reason is not None:
                    return
        finally:
            stream.cancel()  # no-op once finished; frees the slot when we stop early

    async def _collect(self, kind: str, body, response_id: str, prompt: list[int], stream,
                       assembler: OutputAssembler):
        text, ids, lps, tops, offsets, reason, last = "", [], [], [], [], None, None
        async for delta, out in self._outputs(stream, assembler):
            text += delta.text
            ids += delta.token_ids
            offsets += delta.text_offsets
            if delta.logprobs is not None:
                lps += delta.logprobs
                tops += delta.top
            reason = delta.finish_reason or reason
            last = out or last
        usage = self._usage(prompt, len(ids), last)
        scored = last is not None and last.new_logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, ids, lps, tops, offsets) if scored else None
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=reason)
            return CompletionResponse(id=response_id, model=self.model_name, choices=[choice], usage=usage)
        logprobs = chat_logprobs(self.tokenizer, ids, lps, tops) if scored and body.logprobs else None
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=text), logprobs=logprobs,
                            finish_reason=reason)
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=[choice], usage=usage)

    async def _sse_stream(self, kind: str, body, chunk_id: str, prompt: list[int], stream,
                          assembler: OutputAssembler):
        n_tokens, last, status = 0, None, 499   # until the stream ends: the client went away
        try:
            if kind == "chat":
                yield _sse(ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[
                    ChatStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))]))
            try:
                async for delta, out in self._outputs(stream, assembler):
                    last = out or last
                    n_tokens += len(delta.token_ids)
                    drafts = out.new_drafts if out is not None else []
                    # drafts of the canvases this output committed go before its text, the next canvas's after
                    early = sum(d.offset < len(assembler.token_ids) for d in drafts)
                    for d in drafts[:early]:
                        yield self._draft(chunk_id, d)
                    if delta.text or delta.token_ids or delta.finish_reason:
                        yield _sse(self._chunk(kind, body, chunk_id, delta))
                    for d in drafts[early:] if delta.finish_reason is None else ():
                        yield self._draft(chunk_id, d)
            except APIError as err:  # after the stream began: report in band, then end it
                status = err.status
                yield _sse(json.dumps(error_body(err.message, err.type, err.param, err.code)))
                yield _sse("[DONE]")
                return
            if body.include_usage:
                usage = self._usage(prompt, n_tokens, last)
                cls = CompletionStreamResponse if kind == "completion" else ChatCompletionStreamResponse
                yield _sse(cls(id=chunk_id, model=self.model_name, choices=[], usage=usage))
            yield _sse("[DONE]")
            status = 200
        finally:
            prom.REQUESTS.add(ENDPOINT[kind], status)

    def _draft(self, chunk_id: str, draft) -> str:
        return draft_event(draft_payload(self.tokenizer, draft, chunk_id, self.mask_id, self.canvas_length))

    def _chunk(self, kind: str, body, chunk_id: str, delta: Delta):
        scored = delta.logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top,
                                           delta.text_offsets) if scored else None
            return CompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[CompletionChoice(
                text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)])
        logprobs = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top) \
            if scored and body.logprobs else None
        return ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[ChatStreamChoice(
            index=0, delta=ChatDelta(content=delta.text), logprobs=logprobs, finish_reason=delta.finish_reason)])

    def _usage(self, prompt: list[int], completion_tokens: int, last) -> Usage:
        if last is None or last.denoising_steps == 0 and last.canvases == 0:
            return Usage.of(len(prompt), completion_tokens)
        return Usage.of(len(prompt), completion_tokens, last.denoising_steps, last.canvases, self.canvas_length)


def build_app(args: dict):
    """The application for `serve run deployments.app:build_app key=value ...`: the checkpoint read once
    here, and handed to the ingress and, with the runner's arguments, to every replica and shard.

    The device and the placement come from the cluster this process is connected to (`serve deploy` and
    `serve run serve_config.yaml` build on the cluster, scripts/serve_local.py after `ray.init`); not
    connected (`serve run module:build_app ...` builds first), `device: auto` reads this machine's GPUs
    and the placement is checked by the ingress once deployed (deployments/placement.py)."""
    a = AppArgs(**args)
    model_dir = a.model_dir()
    cluster = ClusterResources.read() if ray.is_initialized() else ClusterResources.this_machine()
    device = resolve_device(a.device, cluster)
    if a.batch_invariant and device != "cuda":
        raise ValueError(f"{BATCH_INVARIANT_NEEDS_CUDA}; {cluster.describe()}")
    use_gpu = device == "cuda"
    bundles = placement_bundles(a.tensor_parallel_size, use_gpu, a.shard_cpus)
    if ray.is_initialized():   # the cluster can ever hold the replicas Serve starts with, or the deploy fails now
        problem = never_placed(a, device, bundles, cluster)
        if problem is not None:
            raise ValueError(problem)
    checkpoint = Checkpoint.read(model_dir)
    checkpoint.config.check_tensor_parallel(a.tensor_parallel_size)  # fail at deploy, not at request
    checkpoint.check_quantization(a.quantization)
    runner_args = RunnerArgs(checkpoint=checkpoint, num_slots=a.max_num_seqs, max_model_len=a.max_model_len,
                             dtype=a.torch_dtype(device), device=device, load_format=a.load_format,
                             max_steps_per_command=a.max_steps_per_command, batch_invariant=a.batch_invariant)
    engine_args = dict(num_slots=a.max_num_seqs, max_model_len=a.max_model_len, max_queue=a.max_queue,
                       max_steps_per_command=a.max_steps_per_command, request_timeout_s=a.request_timeout_s,
                       overlap_commands=a.overlap_commands)
    scaling = {"num_replicas": a.num_replicas or 1} if a.autoscaling_config is None else \
        {"autoscaling_config": a.autoscaling_config}
    coordinator = CoordinatorDeployment.options(
        **scaling, placement_group_bundles=bundles, placement_group_strategy=a.placement_strategy,
        ray_actor_options={"num_cpus": REPLICA_BUNDLE["CPU"]},
        graceful_shutdown_timeout_s=a.drain_timeout_s,
    ).bind(runner_args, a.tensor_parallel_size, shard_bundle(use_gpu, a.shard_cpus), engine_args, a.command_timeout_s,
           a.placement_timeout_s, a.model_name())
    return OpenAIIngress.bind(coordinator, {**a.model_dump(), "model": model_dir, "device": device}, checkpoint)
