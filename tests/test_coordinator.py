"""The coordinator's step loop without Ray: its shards are one real tiny runner behind a one-thread
executor, so calls queue and run in order as they do at a Ray actor. The HTTP suites run the same loop
through Serve; here we can see what they cannot: how many commands are in flight, and a failure while
a second command waits behind the first."""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from model.checkpoint import Checkpoint, RunnerArgs
from model.sampling.params import DecodeParams
from model.tiny import write_diffusion_gemma
from workers.coordinator import Coordinator, RequestError
from workers.failures import ShardFailure
from workers.shard_group import InProcessShards

SLOTS = 2


class QueuedShards:
    """start/execute/ping/stop over an in-process runner; `fail_at`: the call number that fails."""

    def __init__(self, model_dir: str, fail_at: int | None = None, failure: Exception | None = None,
                 slots: int = SLOTS, max_steps: int = 4):
        self.model_dir, self.fail_at, self.slots, self.max_steps = model_dir, fail_at, slots, max_steps
        self.failure = failure or ShardFailure("a shard failed: injected")
        self.gate = threading.Event()   # commands run only while it is set
        self.gate.set()
        self.calls = self.in_flight = self.most_in_flight = 0
        self.pids: list[int] = []
        self.commands = []   # as sent, in order

    async def start(self) -> None:
        self.inner = InProcessShards(RunnerArgs.read(self.model_dir, num_slots=self.slots, max_model_len=512,
                                                     max_steps_per_command=self.max_steps))
        self.warm_up_report = self.inner.pool   # the KV pool the scheduler manages
        self.pool = ThreadPoolExecutor(1)

    async def execute(self, cmd):
        self.commands.append(cmd)
        self.calls += 1
        call = self.calls
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            events = await asyncio.get_running_loop().run_in_executor(self.pool, self._execute, cmd)
            if call == self.fail_at:
                raise self.failure
            return events
        finally:
            self.in_flight -= 1

    def _execute(self, cmd):
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.execute(cmd)

    async def ping(self) -> None:
        pass

    def stop(self) -> None:
        self.pool.shutdown(wait=True)


def coordinator(model_dir, shards, overlap: bool, **kw) -> Coordinator:
    return Coordinator(Checkpoint.read(model_dir), shards, num_slots=shards.slots, max_model_len=512, max_queue=8,
                       max_steps_per_command=shards.max_steps, overlap_commands=overlap, request_timeout_s=120, **kw)


async def tokens_of(c: Coordinator, prompt, params) -> list[int]:
    out = []
    async for item in c.generate(prompt, params):
        out += item.new_tokens
    return out


REQUESTS = [([1, 5, 9], 32), ([1, 7], 64), ([1, 3, 4, 8], 96), ([1, 6], 40)]   # 4 requests, 2 slots: some wait


def params(max_tokens: int, steps: int = 3) -> DecodeParams:
    """At most `steps` + 1 steps a block of 32."""
    return DecodeParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, max_denoising_steps=steps)


async def serve_all(model_dir, overlap: bool):
    shards = QueuedShards(model_dir)
    c = coordinator(model_dir, shards, overlap)
    outs = await asyncio.wait_for(asyncio.gather(*[tokens_of(c, p, params(n)) for p, n in REQUESTS]), 120)
    c._loop_task.cancel()
    return outs, shards, c


def test_overlapped_commands_give_the_same_tokens_and_keep_a_command_queued(tiny_nemotron):
    queued, shards, c = asyncio.run(serve_all(tiny_nemotron, overlap=True))
    serial, serial_shards, _ = asyncio.run(serve_all(tiny_nemotron, overlap=False))
    assert [len(t) for t in queued] == [n for _, n in REQUESTS]
    assert queued == serial
    assert shards.most_in_flight == 2 and serial_shards.most_in_flight == 1
    assert c.shard_busy_s > 0 and c.stats()["shard_busy_s"] == c.shard_busy_s


@pytest.mark.parametrize("failure", [ShardFailure("a shard failed: injected"), RuntimeError("a bug")],
                         ids=["shard", "bug"])
def test_a_failure_with_a_command_queued_behind_it_ends_the_requests_and_recovers(tiny_nemotron, failure):
    """A shard's failure, or any other error in the loop (a bug), ends the requests in flight with a
    clear error and rebuilds the shards; the loop itself goes on."""
    async def scenario():
        shards = QueuedShards(tiny_nemotron, fail_at=2, failure=failure)   # command 3 is queued then
        c = coordinator(tiny_nemotron, shards, overlap=True)
        results = await asyncio.wait_for(asyncio.gather(
            *[tokens_of(c, p, params(128)) for p, _ in REQUESTS[:2]], return_exceptions=True), 60)
        assert shards.calls == 3
        loop = c._loop_task
        await asyncio.sleep(0.2)
        assert not loop.done()    # the step loop itself survived the failure and the cancelled call
        after = await asyncio.wait_for(tokens_of(c, [1, 5, 9], params(32)), 60)
        c._loop_task.cancel()
        return results, after, c

    results, after, c = asyncio.run(scenario())
    assert all(isinstance(r, RequestError) and r.kind == "shard_failure" for r in results), results
    assert all(str(failure) in r.message and r.param is None for r in results)
    assert len(after) == 32 and c.failures == 1 and c.shard_starts == 2


def test_a_request_arriving_while_one_command_runs_is_queued_behind_it(tiny_nemotron):
    """With one command in flight (nothing else worth queueing), a new request is sent to the shards at
    once, admitted in a command queued behind the running one, not after its events come back."""
    async def scenario():
        shards = QueuedShards(tiny_nemotron)
        c = coordinator(tiny_nemotron, shards, overlap=True)
        shards.gate.clear()                                   # the first command cannot finish yet
        # 2 steps: one command (a short one: it leaves a slot free, workers/scheduler.py's bursts)
        first = asyncio.ensure_future(tokens_of(c, [1, 5, 9], params(32, steps=1)))
        while shards.calls < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert shards.calls == 1                              # nothing outlasts it: nothing queued
        second = asyncio.ensure_future(tokens_of(c, [1, 7], params(32)))
        for _ in range(500):   # 5 s at most
            if shards.calls == 2:
                break
            await asyncio.sleep(0.01)
        queued_while_running = shards.calls == 2 and shards.in_flight == 2
        shards.gate.set()
        outs = await asyncio.wait_for(asyncio.gather(first, second), 60)
        c._loop_task.cancel()
        return queued_while_running, outs

    queued_while_running, outs = asyncio.run(scenario())
    assert queued_while_running
    assert [len(t) for t in outs] == [32, 32]


@pytest.mark.parametrize("admission_steps", [2, 8], ids=["short", "as-long-as-any"])
def test_a_burst_arriving_while_commands_run_starts_soon_after_its_first_request(tiny_nemotron, admission_steps):
    """Requests that come together but one after another (a burst): the first one's command and the one
    queued behind it are short, so the rest, arriving while both are in flight, start 2 x
    admission_steps steps after it and share the steps after that; with admission commands as long as
    any (8 steps, as before the scheduler knew of bursts), 16 steps after it."""
    async def scenario():
        shards = QueuedShards(tiny_nemotron, slots=4, max_steps=8)
        c = coordinator(tiny_nemotron, shards, overlap=True, admission_steps=admission_steps)
        shards.gate.clear()
        first = asyncio.ensure_future(tokens_of(c, [1, 5, 9], params(256)))   # 8 blocks of 4 steps
        for _ in range(500):
            if shards.calls == 2:
                break
            await asyncio.sleep(0.01)
        assert shards.calls == 2 and shards.in_flight == 2   # its command, and one queued behind
        rest = [asyncio.ensure_future(tokens_of(c, p, params(256))) for p in ([1, 7], [1, 3, 4, 8])]
        await asyncio.sleep(0.1)
        shards.gate.set()
        outs = await asyncio.wait_for(asyncio.gather(first, *rest), 60)
        c._loop_task.cancel()
        return shards.commands, outs

    commands, outs = asyncio.run(scenario())
    assert [len(t) for t in outs] == [256] * 3
    start, done = {}, 0   # the step each slot's request starts at
    for command in commands:
        start.update({admitted.slot: done for admitted in command.admit})
        done += command.max_steps
    assert sorted(start.values()) == [0, 2 * admission_steps, 2 * admission_steps]


def test_a_rejected_request_ends_with_the_field_at_fault(tiny_nemotron, tmp_path):
    """The engine's ParamError reaches the caller as a RequestError naming the field (the ingress's 400
    `param`), not left to be parsed out of its message."""
    class UnstartedShards(QueuedShards):
        async def start(self) -> None:   # a rejected request runs nothing
            pass

    async def error_of(model_dir, prompt, p: DecodeParams) -> RequestError:
        c = coordinator(model_dir, UnstartedShards(model_dir), overlap=False)
        try:
            with pytest.raises(RequestError) as err:
                async for _ in c.generate(prompt, p):
                    pass
        finally:
            c._loop_task.cancel()
        return err.value

    empty = asyncio.run(error_of(tiny_nemotron, [], params(32)))
    too_long = asyncio.run(error_of(tiny_nemotron, [1] * 500, params(32)))
    gemma = write_diffusion_gemma(tmp_path / "gemma", seed=0)
    mode = asyncio.run(error_of(gemma, [1, 2], DecodeParams(mode="ar", max_tokens=4)))
    assert (empty.kind, empty.param) == ("invalid", "prompt") and "empty" in empty.message
    assert (too_long.kind, too_long.param) == ("invalid", "max_tokens") and "max_model_len=512" in too_long.message
    assert (mode.kind, mode.param) == ("invalid", "diffusion.mode") and "DiffusionGemma" in mode.message
