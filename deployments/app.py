"""The OpenAI-compatible ingress and `build_app(args)` for `serve run` / `serve deploy`.

    serve run deployments.app:build_app model=DIR tensor_parallel_size=N

OpenAIIngress is a shim. Its duties: authorise (optional bearer key), validate (pydantic; a bad field
is a 400 naming it), tokenize (chat template for chat), call the Coordinator deployment through a
handle, detokenize and apply stop strings (cancelling the request upstream when one hits), and
answer as JSON or SSE (one chunk per committed block, drafts as SSE comments between them when asked,
then `data: [DONE]`), count requests by status for /metrics, and serve the playground page. Every
generation endpoint funnels into `_generate`; the coordinator handle is injected, so tests and other
front ends can swap it.
"""
# No `from __future__ import annotations`: FastAPI resolves endpoint annotations at runtime.
import asyncio
import hmac
import json
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

# Counted through the module (`prom.REQUESTS`), never a name imported from it: deployments/errors.py says why.
from deployments import metrics as prom
from deployments.args import AppArgs
from deployments.drafts import draft_event, draft_payload
from deployments.errors import ERROR_STATUS, APIError, add_handlers, error_body
from deployments.output import Delta, OutputAssembler, chat_logprobs, completion_logprobs
from deployments.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                  ChatCompletionStreamResponse, ChatDelta, ChatResponseMessage, ChatStreamChoice,
                                  CompletionChoice, CompletionRequest, CompletionResponse,
                                  CompletionStreamResponse, ModelCard, ModelList, Usage)
from model.checkpoint import Checkpoint, RunnerArgs
from model.sampling.params import ParamError
from workers.serve_coordinator import CoordinatorDeployment, placement_bundles

app = FastAPI(title="dllm-serve", docs_url=None, redoc_url=None)
STATIC = Path(__file__).parent / "static"
app.mount("/static", StaticFiles(directory=STATIC), name="static")   # the playground's script and style
add_handlers(app)

ENDPOINT = {"completion": "completions", "chat": "chat_completions"}   # request kind -> metrics label
HEALTH_DETAIL = ("num_slots", "free_slots", "running", "waiting", "shard_failures")
# A running coordinator answers its stats at once; Serve holds a call while no replica runs (one starting
# loads weights and captures CUDA graphs for minutes), so no answer within STATS_S means none is ready.
STATS_S, SHARD_PING_S = 2.0, 15.0
WARMING_UP = "warming up: no model replica is ready yet (loading weights, capturing CUDA graphs)"
STATE_REASON = {"starting": WARMING_UP, "rebuilding": "rebuilding the model shards after a failure",
                "down": "the model shards are down and could not be rebuilt"}
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
    def __init__(self, coordinator: DeploymentHandle, args: dict, checkpoint: Checkpoint):
        from transformers import AutoTokenizer

        self.args = AppArgs(**args)
        self.model_dir = checkpoint.path
        self.model_name = self.args.model_name()
        self.coordinator = coordinator
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.vocab_size = len(self.tokenizer)
        config = checkpoint.config
        self.model_vocab_size = config.vocab_size
        self.defaults = self.args.decode_defaults()
        self.canvas_length = config.canvas_length  # for usage.diffusion.canvas_positions and drafts
        self.mask_id = config.mask_token_id        # a draft's masked positions (None: uniform-noise canvases)
        if checkpoint.renoise is not None:
            # the checkpoint's schedule where the server sets none, so that a request's t_min or t_max is
            # checked against the other end here (a 400), not in a shard (a failed step for every request)
            for end in ("t_min", "t_max"):
                if self.defaults[end] is None:
                    self.defaults[end] = getattr(checkpoint.renoise, end)
        self.model_ready = False   # once the coordinator said so: requests then go straight to it

    # ---- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        """200 when a request would be served now: the coordinator is ready and its shards answer a ping,
        with the slot counts (a leak shows as free_slots below num_slots while nothing runs); 503 with the
        reason otherwise (warming up, rebuilding, down)."""
        stats = await self._ready_stats()
        await self._bounded(self.coordinator.check_health.remote(), SHARD_PING_S, "the model shards did not answer")
        return {"status": "ok", **{k: stats[k] for k in HEALTH_DETAIL}}

    @app.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._authorize(request)
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.args.max_model_len,
                                         canvas_length=self.canvas_length)])

    @app.get("/playground")
    async def playground(self) -> FileResponse:
        return FileResponse(STATIC / "playground.html")

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        stats = await self._bounded(self.coordinator.stats.remote(), STATS_S, WARMING_UP)
        return PlainTextResponse(prom.prometheus_text(stats, self.model_name, prom.REQUESTS),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body, request)
        if isinstance(body.prompt, str):
            prompt = self.tokenizer(body.prompt).input_ids
        else:
            prompt = list(body.prompt)
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} are outside [0, {self.vocab_size})", param="prompt")
        return await self._generate("completion", body, prompt, "prompt", "max_tokens")

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check(body, request)
        try:
            prompt = self.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
        except Exception as err:  # a template's own raise_exception: the messages do not fit it
            raise APIError(400, f"messages do not fit the model's chat template: {err}", param="messages") from None
        length = "max_tokens" if body.max_completion_tokens is None and body.max_tokens is not None else \
            "max_completion_tokens"
        return await self._generate("chat", body, list(prompt), "messages", length)

    # ---- readiness --------------------------------------------------------------------------------
    async def _bounded(self, response, timeout_s: float, reason: str):
        """A coordinator call's result; 503 with `reason` if no replica answers within timeout_s (while a
        replica warms up, Serve holds calls until it is running), or with Ray's reason if it failed."""
        async def result():
            return await response
        try:
            return await asyncio.wait_for(result(), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise APIError(503, reason, "service_unavailable", headers={"Retry-After": "5"}) from None
        except RayError as err:
            raise APIError(503, f"unhealthy: {_last_line(err)}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None

    async def _ready_stats(self) -> dict:
        """The coordinator's stats if it is ready; 503 with what it is doing otherwise."""
        stats = await self._bounded(self.coordinator.stats.remote(), STATS_S, WARMING_UP)
        if stats["state"] != "ready":
            raise APIError(503, STATE_REASON.get(stats["state"], stats["state"]), "service_unavailable",
                           headers={"Retry-After": "5"})
        return stats

    # ---- the one request path -------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.args.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error")

    def _check(self, body, request: Request) -> None:
        self._authorize(request)
        if body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", param="model", code="model_not_found")

    async def _generate(self, kind: str, body, prompt: list[int], prompt_param: str, length_param: str):
        if not self.model_ready:   # a 503 now rather than a request held until a replica warms up
            await self._ready_stats()
            self.model_ready = True
        try:
            params = body.decode_params(self.defaults)
        except ParamError as err:
            raise APIError(400, err.message, param=err.param) from None
        limit = self.args.denoising_steps_limit   # the server's own default is within it (AppArgs)
        if params.max_denoising_steps is not None and params.max_denoising_steps > limit:
            raise APIError(400, f"max_denoising_steps={params.max_denoising_steps} is above this server's "
                                f"denoising_steps_limit={limit}", param="diffusion.max_denoising_steps")
        if params.top_k >= self.model_vocab_size:  # keeps every token: no filter, and no [.., top_k] buffers
            params = params.model_copy(update={"top_k": 0})
        if len(prompt) >= self.args.max_model_len:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model allows at most "
                                f"{self.args.max_model_len - 1} before output", param=prompt_param)
        stream = self.coordinator.options(stream=True).generate.remote(prompt, params)
        try:
            first = await self._next(stream)
        except APIError as err:  # the engine names a completion's fields: this request's own names
            err.param = {"max_tokens": length_param, "prompt": prompt_param}.get(err.param, err.param)
            raise
        if first is None:
            raise APIError(503, "the model stopped without an answer", "service_unavailable")
        assembler = OutputAssembler(self.tokenizer, body.stop_strings)
        if body.stream:
            return StreamingResponse(self._sse_stream(kind, body, prompt, stream, assembler),
                                     media_type="text/event-stream")
        response = await self._collect(kind, body, prompt, stream, assembler)
        prom.REQUESTS.add(ENDPOINT[kind], 200)
        return response

    async def _next(self, stream):
        """The next output of the coordinator's stream, None at its end; errors become APIError."""
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return None
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

    async def _collect(self, kind: str, body, prompt: list[int], stream, assembler: OutputAssembler):
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
            return CompletionResponse(model=self.model_name, choices=[choice], usage=usage)
        logprobs = chat_logprobs(self.tokenizer, ids, lps, tops) if scored and body.logprobs else None
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=text), logprobs=logprobs,
                            finish_reason=reason)
        return ChatCompletionResponse(model=self.model_name, choices=[choice], usage=usage)

    async def _sse_stream(self, kind: str, body, prompt: list[int], stream, assembler: OutputAssembler):
        chunk_id = (CompletionResponse if kind == "completion" else ChatCompletionResponse)(
            model=self.model_name, choices=[]).id
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
    here, and handed to the ingress and, with the runner's arguments, to every replica and shard."""
    a = AppArgs(**args)
    model_dir = a.model_dir()
    use_gpu = a.use_gpu()
    checkpoint = Checkpoint.read(model_dir)
    checkpoint.config.check_tensor_parallel(a.tensor_parallel_size)  # fail at deploy, not at request
    runner_args = RunnerArgs(checkpoint=checkpoint, num_slots=a.max_num_seqs, max_model_len=a.max_model_len,
                             dtype=a.torch_dtype(), device="cuda" if use_gpu else "cpu", load_format=a.load_format,
                             max_steps_per_command=a.max_steps_per_command, batch_invariant=a.batch_invariant)
    engine_args = dict(num_slots=a.max_num_seqs, max_model_len=a.max_model_len, max_queue=a.max_queue,
                       max_steps_per_command=a.max_steps_per_command, request_timeout_s=a.request_timeout_s,
                       overlap_commands=a.overlap_commands)
    coordinator = CoordinatorDeployment.options(
        num_replicas=a.num_replicas, placement_group_bundles=placement_bundles(a.tensor_parallel_size, use_gpu),
        placement_group_strategy=a.placement_strategy, ray_actor_options={"num_cpus": 1},
    ).bind(runner_args, a.tensor_parallel_size, use_gpu, engine_args, a.command_timeout_s)
    return OpenAIIngress.bind(coordinator, {**a.model_dump(), "model": model_dir}, checkpoint)
