"""The OpenAI-compatible ingress: a shim whose duties are its endpoints. Before a body is read, the gate
gives the request its id, authorises it and bounds its size (deployments/gate.py); then pydantic validates
it (a 400 naming the field), the prompt is tokenized in a thread (deployments/prompts.py), what the request
leaves out is filled in (max_tokens, the checkpoint's sampling defaults), and each choice (`n`, a list of
prompts: deployments/choices.py) becomes one engine request on the Coordinator deployment, whose handle
is injected so tests and other front ends can swap it. Every generation endpoint funnels into
`_generate`; readiness and answers are deployments/readiness.py's and deployments/responses.py's.
"""
# No `from __future__ import annotations`: FastAPI resolves endpoint annotations at runtime.
import asyncio
import secrets
import time
from pathlib import Path
from typing import Annotated

from fastapi import Body, FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

# Counted through the module (`prom.REQUESTS`), never a name imported from it: deployments/errors.py says why.
from deployments import metrics as prom
from deployments.args import AppArgs
from deployments.choices import Choice, choice_params, gathered, own_call
from deployments.errors import APIError, add_handlers, validation_error_param
from deployments.gate import REQUEST_ID_PARAMETER, GateSettings, RequestGate
from deployments.output import OutputAssembler, silent_ids
from deployments.placement import PlacementWatch
from deployments.prompts import PromptTokenizer
from deployments.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                  ModelCard, ModelList, TokenizeChatRequest, TokenizeRequest, TokenizeResponse)
from deployments.readiness import STATS_S, Readiness
from deployments.responses import ENDPOINT, ChoicesStream, Responder, cancel_all
from deployments.structured import GrammarCompiler
from deployments.tools import ToolFormat
from model.checkpoint import Checkpoint
from model.sampling.params import DecodeParams, ParamError

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


# graceful_shutdown_wait_loop_s: how often a stopping replica looks for requests still running (Serve's 2 s
# is also what an idle replica sleeps before it stops)
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=0.25)
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
        self.canvas_length = config.canvas_length
        if checkpoint.renoise is not None:
            # the checkpoint's schedule where the server sets none, so that a request's t_min or t_max is
            # checked against the other end here (a 400), not in a shard (a failed step for every request)
            for end in ("t_min", "t_max"):
                if self.defaults[end] is None:
                    self.defaults[end] = getattr(checkpoint.renoise, end)
        # the coordinator replicas' placement groups, for /health's reason and the placement timeout
        placement = PlacementWatch(serve.get_replica_context().app_name, self.args)
        self._watch = asyncio.get_running_loop().create_task(placement.run())
        self.readiness = Readiness(coordinator, placement)
        self.grammars = GrammarCompiler(checkpoint)
        self.tool_format = ToolFormat(self.tokenizer)
        self.family = checkpoint.family
        self.responder = Responder(self.tokenizer, self.model_name, config.canvas_length, config.mask_token_id,
                                   self.readiness.next_output, self.tool_format)

    # ---- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        """200 when a request would be served now: the coordinator is ready and its shards answer a ping,
        with the slot counts (a leak shows as free_slots below num_slots while nothing runs); 503 with the
        reason otherwise (warming up, rebuilding, down)."""
        return await self.readiness.health()

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
        stats = await self.readiness.bounded(self.coordinator.stats.remote(), STATS_S)
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
        prompt = await self.prompts.chat(body.template_messages(), "messages", tools=body.template_tools())
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
        await self.readiness.check_serving()
        n = body.n
        planned = [(prompt, param, self._params(body, prompt, param)) for prompt, param in prompts]
        try:
            constraint = self.tool_format.grammar([t.model_dump() for t in body.tools], body.tool_mode,
                                                  body.parallel_tool_calls, "tool_choice") \
                if kind == "chat" and body.calls_tools else body.grammar_request()
        except ParamError as err:
            raise APIError(400, err.message, param=err.param) from None
        if constraint is not None:
            # a stop would end the answer with "stop" wherever it matched, short of a whole valid text
            cut = "stop" if body.stop_strings else "stop_token_ids" if body.stop_token_ids else None
            if cut is not None:
                raise APIError(400, f"{cut}: not with a constrained output ({constraint.field}): an answer ended by "
                                    "it would be cut short of a whole valid text; the grammar ends the answer itself",
                               param=cut)
            try:
                grammar = await self.grammars.compile(constraint)
                planned = [(prompt, param, p.model_copy(update={"grammar": grammar})) for prompt, param, p in planned]
                for _, _, p in planned:
                    self.family.check(p)
            except ParamError as err:
                raise APIError(400, err.message, param=err.param) from None
        # The response's id is the request's (X-Request-Id); the coordinator's adds a random suffix, so a
        # client reusing an id for requests in flight together gets them served, not refused as a clash.
        request_id = request.state.request_id
        response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id}"
        choices = [Choice(index=i * n + j, prompt=prompt, prompt_param=param, params=p,
                          assembler=OutputAssembler(self.tokenizer, body.stop_strings))
                   for i, (prompt, param, params) in enumerate(planned) for j, p in enumerate(choice_params(params, n))]
        for c in choices:
            c.stream = own_call(lambda: self.coordinator.options(stream=True).generate.remote(
                c.prompt, c.params, f"{response_id}-{secrets.token_hex(6)}"))
        prompt_tokens = sum(len(prompt) for prompt, _ in prompts)   # once per prompt, whatever n (OpenAI's)
        try:
            await gathered([self._admitted(c, length_param) for c in choices])
            if body.stream:
                return ChoicesStream(self.responder.sse_stream(kind, body, response_id, choices, prompt_tokens),
                                     choices)
            response = await self.responder.collect(kind, body, response_id, choices, prompt_tokens)
        except BaseException:   # one choice failed (or the client went away): none of them runs on
            cancel_all(choices)
            raise
        prom.REQUESTS.add(ENDPOINT[kind], 200)
        return response

    async def _admitted(self, choice: Choice, length_param: str) -> None:
        """The coordinator's first output of a choice: its request was admitted (else its error)."""
        try:
            first = await self.readiness.next_output(choice.stream)
        except APIError as err:  # the engine names a completion's fields: this request's own names
            err.param = {"max_tokens": length_param, "prompt": choice.prompt_param}.get(err.param, err.param)
            raise
        if first is None:
            raise APIError(503, "the model stopped without an answer", "service_unavailable")
