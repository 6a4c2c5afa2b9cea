"""The OpenAI-compatible ingress and `build_app(args)` for `serve run` / `serve deploy`.

    serve run deployments.app:build_app model=DIR tensor_parallel_size=N

OpenAIIngress is a shim. Its duties: before a body is read, give the request its id, authorise
(optional bearer key) and bound the body's size (deployments/gate.py); validate (pydantic; a bad field
is a 400 naming it); tokenize in a thread after a character bound (deployments/prompts.py; chat
template for chat); fill what the request leaves out (max_tokens, the checkpoint's sampling defaults);
call the Coordinator deployment through a handle, detokenize and apply stop strings (cancelling the
request upstream when one hits), and answer as JSON or SSE (one chunk per committed block, drafts as
SSE comments between them when asked, then `data: [DONE]`), count requests by status for /metrics,
and serve the playground page; run a request's choices (`n`, a list of prompts) as one engine request
each and answer them together (deployments/choices.py); tokenize and detokenize for vLLM's /tokenize and
/detokenize. Every generation endpoint funnels into `_generate`; the coordinator handle is injected, so
tests and other front ends can swap it.
"""
# No `from __future__ import annotations`: FastAPI resolves endpoint annotations at runtime.
import asyncio
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Annotated, AsyncIterator

import ray
from fastapi import Body, FastAPI, Request
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
from deployments.choices import Choice, choice_params, gathered, merged
from deployments.cluster import ClusterResources, resolve_device
from deployments.drafts import draft_event, draft_payload
from deployments.errors import ERROR_STATUS, APIError, add_handlers, error_body, validation_error_param
from deployments.gate import REQUEST_ID_PARAMETER, GateSettings, RequestGate
from deployments.output import Delta, OutputAssembler, chat_logprobs, completion_logprobs, silent_ids
from deployments.placement import PlacementWatch, never_placed
from deployments.prompts import PromptTokenizer
from deployments.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                  ChatCompletionStreamResponse, ChatDelta, ChatResponseMessage, ChatStreamChoice,
                                  CompletionChoice, CompletionRequest, CompletionResponse,
                                  CompletionStreamResponse, DetokenizeRequest, DetokenizeResponse, ModelCard,
                                  ModelList, TokenizeChatRequest, TokenizeRequest, TokenizeResponse, Usage)
from model.checkpoint import Checkpoint, RunnerArgs
from model.sampling.params import DecodeParams, ParamError
from workers.serve_coordinator import REPLICA_BUNDLE, CoordinatorDeployment, placement_bundles, shard_bundle

log = logging.getLogger("dllm.ingress")
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
HELD_PROBE_S = 0.25   # a stats call's bound while an earlier one is still held (_ready_stats)
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


# Defined before the ingress class: the copy of the class that Serve ships to the replica did not find
# a module function defined after it (a NameError there).
def _cancel_all(choices: list[Choice]) -> None:
    """Each choice's engine request ends (a no-op for one that finished); its slot is freed."""
    for c in choices:
        if c.stream is not None:
            c.stream.cancel()


class ChoicesStream(StreamingResponse):
    """A stream of choices that ends their engine requests however the response ends (the one place a
    stream ends them): also when the client leaves before the stream's generator first runs, whose own
    `finally` then never runs (the choices would hold their slots until request_timeout_s)."""

    def __init__(self, content, choices: list[Choice]):
        super().__init__(content, media_type="text/event-stream")
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _cancel_all(self.choices)


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
        silent_ids(self.tokenizer)   # cached now, not on the first request (~1 s for a 262k-token vocabulary)
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
        self._held_stats: asyncio.Future | None = None   # the stats call Serve holds while no replica runs
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
        texts_or_ids = body.prompts
        self._check_choices(len(texts_or_ids), body.n)
        prompts = []
        for i, p in enumerate(texts_or_ids):
            param = "prompt" if len(texts_or_ids) == 1 else f"prompt[{i}]"
            prompts.append((await self.prompts.text(p, param) if isinstance(p, str) else self.prompts.ids(p, param),
                            param))
        return await self._generate("completion", body, request, prompts, "max_tokens")

    @app.post("/v1/chat/completions", openapi_extra=WITH_REQUEST_ID)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_choices(1, body.n)
        prompt = await self.prompts.chat(body.template_messages(), "messages")
        length = "max_tokens" if body.max_completion_tokens is None and body.max_tokens is not None else \
            "max_completion_tokens"
        return await self._generate("chat", body, request, [(prompt, "messages")], length)

    @app.post("/tokenize", openapi_extra=WITH_REQUEST_ID)
    async def tokenize(self, body: Annotated[TokenizeRequest, Body()]) -> TokenizeResponse:
        """vLLM's: a prompt's token ids as /v1/completions tokenizes it, or messages' as the chat template
        makes them for /v1/chat/completions (add_generation_prompt as given)."""
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = await self.prompts.chat(body.template_messages(), "messages", body.add_generation_prompt,
                                             body.continue_final_message, body.add_special_tokens)
        else:
            tokens = await self.prompts.text(body.prompt, "prompt", body.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.args.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize", openapi_extra=WITH_REQUEST_ID)
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: the text of token ids (special tokens included); an id outside the vocabulary is a 400
        naming `tokens`."""
        self._check_model(body.model)
        return DetokenizeResponse(prompt=await self.prompts.detokenize(body.tokens, "tokens"))

    # ---- readiness --------------------------------------------------------------------------------
    async def _bounded(self, response, timeout_s: float, reason: str | None = None):
        """A coordinator call's result; 503 with `reason` if no replica answers within timeout_s (while a
        replica warms up or waits for its placement group, Serve holds calls until one runs; reason None:
        say which of the two), or with Ray's reason if it failed."""
        try:
            return await asyncio.wait_for(self._answer(response), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise self._not_running(reason) from None

    async def _answer(self, response):
        """A coordinator call's result, its failure as a 503 saying why."""
        try:
            return await response
        except DeploymentUnavailableError as err:   # it failed to deploy: say why, if placement is why
            raise self._failed_to_deploy(err) from None
        except RayError as err:
            raise APIError(503, f"unhealthy: {_last_line(err)}", "service_unavailable",
                           headers={"Retry-After": "1"}) from None

    def _not_running(self, reason: str | None = None) -> APIError:
        """No replica runs: `reason`, else whether it waits for its placement group or warms up."""
        return APIError(503, reason or self.placement.reason() or WARMING_UP, "service_unavailable",
                        headers={"Retry-After": "5"})

    def _failed_to_deploy(self, err: DeploymentUnavailableError) -> APIError:
        reason = self.placement.reason()
        return APIError(503, err.message + (f" {reason}" if reason else ""), "service_unavailable")

    async def _ready_stats(self) -> dict:
        """The coordinator's stats if it is ready; 503 with what it is doing otherwise. While no replica
        runs, Serve holds the stats call until one does: the first caller waits STATS_S for it and leaves
        it held, and every caller while it is still held waits HELD_PROBE_S at most (a load balancer
        polling /health during a warm-up of minutes sees answers in a fraction of a second, not every
        STATS_S)."""
        held = self._held_stats
        if held is not None and not held.done():
            # a fresh call still answers at once where a replica runs by now, or where the deployment
            # failed meanwhile (Serve's reason, which the held call does not get)
            stats = await self._bounded(self.coordinator.stats.remote(), HELD_PROBE_S)
        else:
            if held is not None and not held.cancelled():
                held.exception()   # an answer that came after its caller left: retrieved, then dropped
            self._held_stats = held = asyncio.ensure_future(self._answer(self.coordinator.stats.remote()))
            done, _ = await asyncio.wait({held}, timeout=STATS_S)
            if not done:
                raise self._not_running()
            self._held_stats = None
            stats = held.result()
        if stats["state"] != "ready":
            raise APIError(503, STATE_REASON.get(stats["state"], stats["state"]), "service_unavailable",
                           headers={"Retry-After": "5"})
        return stats

    # ---- the one request path -------------------------------------------------------------------
    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.args.max_model_len,
                         canvas_length=self.canvas_length)

    def _check_model(self, model: str | None) -> None:
        """`model` must be the served one (None: the served one, as /tokenize's optional field)."""
        if model is not None and model != self.model_name:
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

    def _check_choices(self, prompts: int, n: int) -> None:
        """n within max_n, and prompts x n within max_choices: a 400 naming the field, before any work."""
        if n > self.args.max_n:
            raise APIError(400, f"n={n} is above this server's max_n={self.args.max_n}", param="n")
        if prompts * n > self.args.max_choices:
            raise APIError(400, f"{prompts} prompts x n={n} is {prompts * n} choices, above this server's "
                                f"max_choices={self.args.max_choices}", param="n" if n > 1 else "prompt")

    def _params(self, body, prompt: list[int], prompt_param: str) -> DecodeParams:
        """The engine's parameters for one prompt of the request (a 400 naming the field at fault)."""
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
        return params

    async def _generate(self, kind: str, body, request: Request, prompts: list[tuple[list[int], str]],
                        length_param: str):
        """`prompts`: (token ids, the request's name for that prompt); each gets body.n choices, each its
        own engine request (deployments/choices.py), answered together."""
        if not self.model_ready:   # a 503 now rather than a request held until a replica warms up
            await self._ready_stats()
            self.model_ready = True
        n = body.n
        planned = [(prompt, param, self._params(body, prompt, param)) for prompt, param in prompts]
        # The response's id is the request's (X-Request-Id); the coordinator's adds a random suffix, so a
        # client reusing an id for requests in flight together gets them served, not refused as a clash.
        request_id = request.state.request_id
        response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id}"
        choices = [Choice(index=i * n + j, prompt=prompt, prompt_param=param, params=p,
                          assembler=OutputAssembler(self.tokenizer, body.stop_strings))
                   for i, (prompt, param, params) in enumerate(planned) for j, p in enumerate(choice_params(params, n))]
        for c in choices:
            c.stream = self.coordinator.options(stream=True).generate.remote(
                c.prompt, c.params, f"{response_id}-{secrets.token_hex(6)}")
        prompt_tokens = sum(len(prompt) for prompt, _ in prompts)   # once per prompt, whatever n (OpenAI's)
        try:
            await gathered([self._admitted(c, length_param) for c in choices])
            if body.stream:
                return ChoicesStream(self._sse_stream(kind, body, response_id, choices, prompt_tokens), choices)
            response = await self._collect(kind, body, response_id, choices, prompt_tokens)
        except BaseException:   # one choice failed (or the client went away): none of them runs on
            _cancel_all(choices)
            raise
        prom.REQUESTS.add(ENDPOINT[kind], 200)
        return response

    async def _admitted(self, choice: Choice, length_param: str) -> None:
        """The coordinator's first output of a choice: its request was admitted (else its error)."""
        try:
            first = await self._next(choice.stream)
        except APIError as err:  # the engine names a completion's fields: this request's own names
            err.param = {"max_tokens": length_param, "prompt": choice.prompt_param}.get(err.param, err.param)
            raise
        if first is None:
            raise APIError(503, "the model stopped without an answer", "service_unavailable")

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

    async def _outputs(self, choice: Choice) -> AsyncIterator[tuple[Delta, object]]:
        """Deltas of a choice's text until its request finishes or a stop string ends it (then upstream is
        cancelled); the choice keeps its token count and its last output (usage)."""
        try:
            while True:
                out = await self._next(choice.stream)
                if out is None:
                    yield choice.assembler.finish(), None
                    return
                delta = choice.assembler.add(out)
                choice.tokens += len(delta.token_ids)
                choice.last = out
                yield delta, out
                if delta.finish_reason is not None:
                    return
        finally:
            choice.stream.cancel()  # no-op once finished; frees the slot when we stop early

    async def _collect(self, kind: str, body, response_id: str, choices: list[Choice], prompt_tokens: int):
        answers = await gathered([self._collect_choice(kind, body, c) for c in choices])
        usage = self._usage(prompt_tokens, choices)
        if kind == "completion":
            return CompletionResponse(id=response_id, model=self.model_name, choices=answers, usage=usage)
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=answers, usage=usage)

    async def _collect_choice(self, kind: str, body, choice: Choice):
        text, ids, lps, tops, offsets, reason = "", [], [], [], [], None
        async for delta, _ in self._outputs(choice):
            text += delta.text
            ids += delta.token_ids
            offsets += delta.text_offsets
            if delta.logprobs is not None:
                lps += delta.logprobs
                tops += delta.top
            reason = delta.finish_reason or reason
        scored = choice.last is not None and choice.last.new_logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, ids, lps, tops, offsets) if scored else None
            return CompletionChoice(index=choice.index, text=text, logprobs=logprobs, finish_reason=reason)
        logprobs = chat_logprobs(self.tokenizer, ids, lps, tops) if scored and body.logprobs else None
        return ChatChoice(index=choice.index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                          finish_reason=reason)

    async def _sse_stream(self, kind: str, body, chunk_id: str, choices: list[Choice], prompt_tokens: int):
        """Every choice's chunks as they come (each carries its choice's index; each choice ends with its own
        finish chunk), then the usage of them all; a failing choice ends the stream (and every choice's
        request) with an error event."""
        status = 499   # until the stream ends: the client went away
        try:
            if kind == "chat":
                for c in choices:
                    yield _sse(ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[
                        ChatStreamChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]))
            try:
                async for event in merged([self._choice_events(kind, body, chunk_id, c) for c in choices]):
                    yield event
            except Exception as err:  # after the stream began: report in band, then end it
                if not isinstance(err, APIError):
                    log.exception("a stream failed")
                    err = APIError(500, f"internal error: {type(err).__name__}", "internal_error")
                status = err.status
                yield _sse(json.dumps(error_body(err.message, err.type, err.param, err.code)))
                yield _sse("[DONE]")
                return
            if body.include_usage:
                cls = CompletionStreamResponse if kind == "completion" else ChatCompletionStreamResponse
                yield _sse(cls(id=chunk_id, model=self.model_name, choices=[],
                               usage=self._usage(prompt_tokens, choices)))
            yield _sse("[DONE]")
            status = 200
        finally:   # the choices' requests end in ChoicesStream, however the response ends
            prom.REQUESTS.add(ENDPOINT[kind], status)

    async def _choice_events(self, kind: str, body, chunk_id: str, choice: Choice) -> AsyncIterator[str]:
        """One choice's SSE events: its chunks, and its drafts when asked."""
        assembler = choice.assembler
        async for delta, out in self._outputs(choice):
            drafts = out.new_drafts if out is not None else []
            # drafts of the canvases this output committed go before its text, the next canvas's after
            early = sum(d.offset < len(assembler.token_ids) for d in drafts)
            for d in drafts[:early]:
                yield self._draft(chunk_id, d, choice.index)
            if delta.text or delta.token_ids or delta.finish_reason:
                yield _sse(self._chunk(kind, body, chunk_id, delta, choice.index))
            for d in drafts[early:] if delta.finish_reason is None else ():
                yield self._draft(chunk_id, d, choice.index)

    def _draft(self, chunk_id: str, draft, index: int) -> str:
        return draft_event(draft_payload(self.tokenizer, draft, chunk_id, self.mask_id, self.canvas_length, index))

    def _chunk(self, kind: str, body, chunk_id: str, delta: Delta, index: int):
        scored = delta.logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top,
                                           delta.text_offsets) if scored else None
            return CompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[CompletionChoice(
                index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)])
        logprobs = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top) \
            if scored and body.logprobs else None
        return ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[ChatStreamChoice(
            index=index, delta=ChatDelta(content=delta.text), logprobs=logprobs, finish_reason=delta.finish_reason)])

    def _usage(self, prompt_tokens: int, choices: list[Choice]) -> Usage:
        """Summed over the choices (the prompts' tokens once each)."""
        completion_tokens = sum(c.tokens for c in choices)
        steps = sum(c.last.denoising_steps for c in choices if c.last is not None)
        canvases = sum(c.last.canvases for c in choices if c.last is not None)
        if steps == 0 and canvases == 0:
            return Usage.of(prompt_tokens, completion_tokens)
        return Usage.of(prompt_tokens, completion_tokens, steps, canvases, self.canvas_length)


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
    engine_args = a.engine_args()
    scaling = {"num_replicas": a.num_replicas or 1} if a.autoscaling_config is None else \
        {"autoscaling_config": a.autoscaling_config}
    coordinator = CoordinatorDeployment.options(
        **scaling, placement_group_bundles=bundles, placement_group_strategy=a.placement_strategy,
        ray_actor_options={"num_cpus": REPLICA_BUNDLE["CPU"]},
        graceful_shutdown_timeout_s=a.drain_timeout_s,
    ).bind(runner_args, a.tensor_parallel_size, shard_bundle(use_gpu, a.shard_cpus), engine_args, a.command_timeout_s,
           a.placement_timeout_s, a.model_name())
    return OpenAIIngress.bind(coordinator, {**a.model_dump(), "model": model_dir, "device": device}, checkpoint)
