"""deployments/responses.py's ChoicesStream: a streamed response ends its choices' engine requests however it
ends. Its callers' streams are tested over HTTP (tests/test_http.py, tests/test_http_faults.py); here the
one case HTTP cannot time: the client gone before the stream's generator first runs."""
import asyncio

from deployments.choices import Choice
from deployments.responses import ChoicesStream
from model.sampling.params import DecodeParams


class EngineRequest:
    """A choice's engine request, as far as ending it goes (a Serve response generator's cancel)."""

    def __init__(self):
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def choices(n: int) -> list[Choice]:
    out = [Choice(index=i, prompt=[1, 2], prompt_param="prompt", params=DecodeParams(), assembler=None)
           for i in range(n)]
    for c in out:
        c.stream = EngineRequest()
    return out


def respond(response: ChoicesStream, send) -> None:
    async def receive():
        await asyncio.sleep(3600)   # the client says nothing more (disconnects show in `send`)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/"}
    asyncio.run(response(scope, receive, send))


def test_a_client_gone_before_the_stream_began_ends_every_choice():
    started = []

    async def body():
        started.append(True)   # never reached: the first send fails
        yield "data: x\n\n"

    async def send(message):
        raise OSError("the client went away")

    cs = choices(3)
    try:
        respond(ChoicesStream(body(), cs), send)
    except Exception:   # noqa: BLE001 - starlette's ClientDisconnect: what the server sees
        pass
    assert not started and all(c.stream.cancelled for c in cs)


def test_a_stream_that_ended_ends_its_choices_once_more_harmlessly():
    """After a complete stream the choices' requests have finished; ending them again is a no-op."""
    sent = []

    async def body():
        yield "data: x\n\n"

    async def send(message):
        sent.append(message["type"])

    cs = choices(2)
    respond(ChoicesStream(body(), cs), send)
    assert sent[0] == "http.response.start" and sent[-1] == "http.response.body"
    assert all(c.stream.cancelled for c in cs)
