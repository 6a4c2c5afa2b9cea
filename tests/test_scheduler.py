import random

import pytest

from model.protocol import Block, Command, Events, NewSlot, StepCounters
from model.sampling.params import DecodeParams, ParamError
from workers.scheduler import TEMPERATURE_0_SEED, QueueFull, Scheduler, derived_metrics

EOS = 2
C = 32


def make(num_slots=2, max_queue=4, max_model_len=256, **kw):
    return Scheduler(num_slots, max_queue, (EOS,), max_model_len, C, **kw)


def params(**kw):
    return DecodeParams(**{"max_tokens": 64, **kw})


def canvas(slot, tokens, steps=4, scores=False):
    """A committed block; scores make token t's logprob -t and rank t so truncation can be checked."""
    block = Block(slot, list(tokens), denoising_steps=steps, canvases=1)
    if scores:
        block.logprobs, block.ranks = [-float(t) for t in tokens], list(tokens)
        block.top_ids, block.top_logprobs = [[t, t + 1] for t in tokens], [[-float(t), -float(t + 1)] for t in tokens]
    return block


def body(n, start=10):
    """n tokens that are neither EOS nor any stop id used below."""
    return list(range(start, start + n))


def run(s, *blocks, counters=None):
    command = s.schedule()
    assert command is not None
    return command, s.apply(Events(list(blocks), 1, counters or StepCounters()))


def test_fifo_admission_into_lowest_free_slots():
    s = make(num_slots=3, max_queue=8)
    for i in range(4):
        s.add(f"r{i}", [1, 5, 6], params(seed=i))
    command = s.schedule()
    assert command == Command((), tuple(NewSlot(i, (1, 5, 6), params(seed=i), i) for i in range(3)), 8)
    assert (s.num_running, s.num_waiting, s.free_slots) == (3, 1, 0)
    s.apply(Events())
    # Slot 1 finishes: the next command releases it and hands it to the oldest waiting request.
    command, _ = run(s, Block(1, [EOS] + body(31)))
    assert command == Command((), (), 8)
    command = s.schedule()
    assert command.release == (1,) and [(a.slot, a.seed) for a in command.admit] == [(1, 3)]
    assert command.max_steps == 8


def test_released_slot_reused_in_same_command_and_lowest_first():
    s = make(num_slots=4)
    for i in range(4):
        s.add(f"r{i}", [1], params())
    run(s)
    run(s, Block(3, [EOS]), Block(0, [EOS]), Block(2, body(5)))
    s.add("late0", [1], params())
    s.add("late1", [1], params())
    command = s.schedule()
    assert sorted(command.release) == [0, 3]
    assert [a.slot for a in command.admit] == [0, 3]
    assert [a.prompt for a in command.admit] == [(1,), (1,)]


def test_queue_bound_counts_only_requests_that_must_wait():
    s = make(num_slots=2, max_queue=1)
    for i in range(3):  # two take the free slots, one waits
        s.add(f"r{i}", [1], params())
    with pytest.raises(QueueFull):
        s.add("r3", [1], params())
    assert s.num_waiting == 3
    s.schedule()
    with pytest.raises(QueueFull):
        s.add("r3", [1], params())
    s.cancel("r2")
    s.add("r3", [1], params())


def test_zero_queue_accepts_only_what_free_slots_take():
    s = make(num_slots=1, max_queue=0)
    s.add("a", [1], params())
    with pytest.raises(QueueFull):
        s.add("b", [1], params())


@pytest.mark.parametrize("mode,prompt_len,max_tokens,ok", [
    ("diffusion", 224, 32, True),     # 224 + 32 = 256
    ("diffusion", 224, 17, True),     # rounds up to one canvas
    ("diffusion", 225, 17, False),    # 225 + 32 > 256
    ("diffusion", 200, 33, False),    # two canvases: 200 + 64 > 256
    ("linear_spec", 225, 1, False),
    ("ar", 225, 31, True),            # AR needs only max_tokens positions
    ("ar", 225, 32, False),
    ("ar", 256, 1, False),            # the prompt alone fills the context
])
def test_budget_must_fit_max_model_len(mode, prompt_len, max_tokens, ok):
    s = make(max_model_len=256)
    p = params(mode=mode, max_tokens=max_tokens, temperature=0 if mode == "linear_spec" else None)
    if ok:
        s.add("r", [1] * prompt_len, p)
        return
    with pytest.raises(ParamError, match=rf"max_tokens={max_tokens}.*max_model_len=256") as err:
        s.add("r", [1] * prompt_len, p)
    assert str(prompt_len) in str(err.value) and err.value.param == "max_tokens"
    assert s.num_waiting == 0


def test_bad_requests_and_bad_construction():
    s = make()
    with pytest.raises(ParamError, match="empty") as err:
        s.add("r", [], params())
    assert err.value.param == "prompt"
    s.add("r", [1], params())
    with pytest.raises(ParamError, match="'r'") as err:
        s.add("r", [1], params())
    assert err.value.param == "request_id"
    with pytest.raises(ValueError, match="num_slots=0"):
        make(num_slots=0)
    with pytest.raises(ValueError, match="max_steps_per_command=0"):
        make(max_steps_per_command=0)
    with pytest.raises(ValueError, match="admission_steps=0"):
        make(admission_steps=0)


def test_eos_kept_rest_and_their_scores_dropped():
    s = make()
    req = s.add("r", [1], params(logprobs=2))
    run(s)
    tokens = body(5) + [EOS] + body(3, start=40) + [EOS] + body(22, start=50)
    _, outs = run(s, canvas(0, tokens, steps=7, scores=True))
    (out,) = outs
    kept = body(5) + [EOS]
    assert out.new_tokens == kept and out.finished and out.finish_reason == "stop"
    assert out.new_logprobs == [-float(t) for t in kept] and out.new_ranks == kept
    assert out.new_top_ids == [[t, t + 1] for t in kept]
    assert out.new_top_logprobs == [[-float(t), -float(t + 1)] for t in kept]
    assert req.output == kept
    assert req.finish_reason == "stop" and req.slot is None
    assert (req.denoising_steps, req.canvases) == (7, 1)
    assert req.arrival_time <= req.first_token_time <= req.finish_time


def test_ignore_eos_continues_past_eos():
    s = make()
    req = s.add("r", [1], params(ignore_eos=True, max_tokens=40))
    run(s)
    first = [EOS] * 3 + body(29)
    _, (out,) = run(s, canvas(0, first))
    assert out.new_tokens == first and not out.finished and out.new_logprobs is None
    _, (out,) = run(s, canvas(0, [EOS] * 32))
    assert out.new_tokens == [EOS] * 8 and out.finish_reason == "length"
    assert req.output == first + [EOS] * 8


def test_stop_token_ids_stop_like_eos_even_with_ignore_eos():
    s = make()
    s.add("r", [1], params(stop_token_ids=(7, 8), ignore_eos=True))
    run(s)
    _, (out,) = run(s, canvas(0, body(3) + [EOS, 8, 7] + body(26)))
    assert out.new_tokens == body(3) + [EOS, 8] and out.finish_reason == "stop"


def test_max_tokens_17_across_two_canvases():
    s = make()
    req = s.add("r", [1], params(max_tokens=17, logprobs=0))
    run(s)
    _, (out,) = run(s, Block(0, body(10), denoising_steps=3, canvases=1, logprobs=[-1.0] * 10, ranks=[1] * 10))
    assert out.new_tokens == body(10) and not out.finished and out.new_ranks == [1] * 10
    assert out.new_top_ids == [[]] * 10  # logprobs=0: no alternatives
    _, (out,) = run(s, Block(0, body(32, start=100), denoising_steps=5, canvases=1, logprobs=[-2.0] * 32, ranks=[2] * 32))
    assert out.new_tokens == body(7, start=100) and out.finish_reason == "length"
    assert out.new_logprobs == [-2.0] * 7 and out.new_ranks == [2] * 7
    assert req.output == body(10) + body(7, start=100)
    assert (req.denoising_steps, req.canvases) == (8, 2)


def test_eos_exactly_at_the_budget_is_a_stop():
    s = make()
    s.add("r", [1], params(max_tokens=4))
    run(s)
    _, (out,) = run(s, canvas(0, body(3) + [EOS] + body(28)))
    assert out.new_tokens == body(3) + [EOS] and out.finish_reason == "stop"


def test_eos_past_the_budget_is_a_length():
    s = make()
    s.add("r", [1], params(max_tokens=3))
    run(s)
    _, (out,) = run(s, canvas(0, body(3) + [EOS]))
    assert out.new_tokens == body(3) and out.finish_reason == "length"


def test_cancel_waiting_and_running():
    s = make(num_slots=1)
    a = s.add("a", [1], params(logprobs=1))
    s.add("b", [1], params())
    s.add("c", [1], params())
    out = s.cancel("b")
    assert out.finished and out.finish_reason == "abort" and out.new_tokens == [] and out.new_logprobs is None
    command = s.schedule()
    assert [n.slot for n in command.admit] == [0] and s.num_waiting == 1
    s.apply(Events())
    out = s.cancel("a")
    assert out.finish_reason == "abort" and out.new_logprobs == [] and a.finish_reason == "abort"
    assert s.cancel("a") is None and s.cancel("nobody") is None
    command = s.schedule()
    assert command.release == (0,) and [n.slot for n in command.admit] == [0]
    # The cancelled id is free again once it is finished.
    s.add("a", [1], params())


def test_blocks_for_released_or_empty_slots_ignored():
    s = make(num_slots=2)
    a = s.add("a", [1], params())
    run(s)
    s.cancel("a")
    _, outs = run(s, Block(0, body(32)), Block(1, body(32)))
    assert outs == [] and a.output == []


def test_blocks_of_a_slots_previous_occupant_ignored_when_scheduling_ahead():
    s = make(num_slots=1)
    s.add("a", [1], params())
    s.schedule()                      # command 0 admits a
    s.apply(Events())
    s.schedule()                      # command 1 runs a
    s.cancel("a")
    b = s.add("b", [1], params())
    command = s.schedule()            # command 2 reuses slot 0 before command 1's events come back
    assert command.release == (0,) and command.admit[0].slot == 0
    assert s.apply(Events([Block(0, body(32))])) == []        # command 1: a's block
    (out,) = s.apply(Events([Block(0, body(32, start=200))]))  # command 2: b's
    assert out.request_id == "b" and b.output == body(32, start=200)


def test_counters_accumulate():
    s = make()
    s.add("r", [1], params())
    run(s, counters=StepCounters(0, 3, 96, 0, 4, 2))
    run(s, canvas(0, body(32)), counters=StepCounters(32, 2, 64, 1, 3, 3))
    assert s.counters == StepCounters(32, 5, 160, 1, 7, 5)
    m = derived_metrics(s.counters, 2.0)
    assert m == {"committed_throughput": 16.0, "steps_per_canvas": 5.0,
                 "committed_per_denoising_step": 6.4, "tokens_per_forward": 32 / 7, "rows_per_pass": 7 / 5}
    assert set(derived_metrics(StepCounters(), 0.0).values()) == {None}


def test_seeds_explicit_kept_else_drawn_from_scheduler_seed():
    s = make(seed=123, max_queue=8)
    explicit = s.add("x", [1], params(seed=5))
    drawn = [s.add(f"r{i}", [1], params()).seed for i in range(3)]
    assert explicit.seed == 5
    rng = random.Random(123)
    assert drawn == [rng.randrange(2**63) for _ in range(3)]
    assert len(set(drawn)) == 3
    again = make(seed=123, max_queue=8)
    assert [again.add(f"r{i}", [1], params()).seed for i in range(3)] == drawn
    assert make(seed=124).add("r", [1], params()).seed != drawn[0]
    command = s.schedule()
    assert [n.seed for n in command.admit] == [5, drawn[0]]


def test_temperature_0_without_a_seed_gets_the_fixed_seed():
    """Whatever was drawn before it: a request at temperature 0 is reproducible (DiffusionGemma's canvases
    start as noise at any temperature); one that gives a seed keeps it."""
    s = make(seed=123, max_queue=8)
    first = s.add("a", [1], params(temperature=0)).seed
    drawn = s.add("b", [1], params()).seed
    assert first == s.add("c", [1], params(temperature=0)).seed == TEMPERATURE_0_SEED
    assert drawn == random.Random(123).randrange(2**63)   # the draws are as before, unaffected
    assert s.add("d", [1], params(temperature=0, seed=9)).seed == 9
    assert s.add("e", [1], params(mode="linear_spec")).seed == TEMPERATURE_0_SEED   # greedy by definition


def test_schedule_none_when_idle_and_release_only_command():
    s = make()
    assert s.schedule() is None and not s.has_work()
    s.add("r", [1], params())
    assert s.has_work()
    run(s)
    run(s, canvas(0, [EOS] + body(31)))
    assert s.has_work() and s.free_slots == 2
    command = s.schedule()
    assert command == Command(release=(0,), admit=(), max_steps=0)
    s.apply(Events())
    assert s.schedule() is None and not s.has_work()


def test_events_without_a_command_are_a_bug():
    with pytest.raises(AssertionError):
        make().apply(Events())


def test_ar_blocks_of_any_length_count_no_canvases():
    s = make()
    req = s.add("r", [1], params(mode="ar", max_tokens=5))
    run(s)
    run(s, Block(0, [11]))
    run(s, Block(0, [12, 13]))
    _, (out,) = run(s, Block(0, [14, 15, 16]))
    assert out.new_tokens == [14, 15] and out.finish_reason == "length"
    assert req.output == [11, 12, 13, 14, 15] and (req.denoising_steps, req.canvases) == (0, 0)


def test_empty_block_without_scores_is_accepted():
    s = make()
    req = s.add("r", [1], params(mode="ar", logprobs=3))
    run(s)
    _, (out,) = run(s, Block(0, []))
    assert out.new_tokens == [] and out.new_logprobs == [] and not out.finished and req.first_token_time is None


def test_request_latencies_follow_its_blocks():
    """docs/spec.md 8 per-request metrics: TTFT, one inter-block latency per block after the first, e2e."""
    import time as _time

    from model.protocol import Block, Events
    from model.sampling.params import DecodeParams
    from workers.scheduler import Scheduler

    s = Scheduler(num_slots=1, max_queue=1, eos_token_ids=(2,), max_model_len=512, canvas_length=4)
    request = s.add("r", [1, 5], DecodeParams(max_tokens=12, ignore_eos=True))
    assert request.latencies == {"ttft_s": None, "inter_block_s": [], "e2e_s": None}
    for _ in range(3):
        s.schedule()
        _time.sleep(0.01)
        s.apply(Events(blocks=[Block(slot=0, tokens=[7, 7, 7, 7], denoising_steps=2)]))
    lat = request.latencies
    assert request.finished and len(lat["inter_block_s"]) == 2 and all(x >= 0.009 for x in lat["inter_block_s"])
    assert 0.009 <= lat["ttft_s"] <= lat["e2e_s"]


def test_commands_sized_by_the_slots_step_bounds():
    """With a budget: a command runs until the slot that needs the most is surely done, capped at
    max_steps_per_command; while requests wait, until the first slot could free; the runner's bounds
    (events.steps_left) replace the scheduler's own countdown, less the steps handed out since."""
    from model.phases import StepBudget

    s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=40, budget=StepBudget(C))
    # (a request's last canvas is emitted as it converges, without a commit step)
    s.add("short", [1], params(max_tokens=32, max_denoising_steps=4))    # 1 canvas: 4 steps
    s.add("long", [1], params(max_tokens=64, max_denoising_steps=8))     # 2 canvases: (8 + 1) + 8
    assert s.schedule().max_steps == 17
    s.apply(Events([Block(0, body(32), 4, 1)], 17, StepCounters(), steps_left={0: 0, 1: 0}))
    s.add("ar", [1], params(max_tokens=3, mode="ar"))
    s.add("third", [1], params(max_tokens=200))                           # waits: both slots taken
    command = s.schedule()
    # the command that ends an AR request's prompt is its prefill alone: the first token streams at once
    assert [a.params.mode for a in command.admit] == ["ar"] and command.max_steps == 0
    s.apply(Events([Block(0, body(1))], 0, StepCounters(), steps_left={0: 2, 1: 0}))
    # "long" has bound 0 (it cannot run another step), so the AR request's bound of 2 sizes the command
    assert s.schedule().max_steps == 2
    s.apply(Events([Block(0, body(1))], 1, StepCounters(), steps_left={0: 1, 1: 3}))
    assert s.schedule().max_steps == 1                 # the AR request may free its slot after 1 step
    s.apply(Events([Block(0, body(1))], 1, StepCounters(), steps_left={0: 0, 1: 2}))
    command = s.schedule()                             # "third" admitted (7 canvases x 33), nothing waits
    # short: "long" frees its slot within 2 steps, and the next request may come (bursts, below)
    assert len(command.admit) == 1 and command.max_steps == 2
    s.apply(Events([Block(1, body(64), 18, 2)], 2, StepCounters(), steps_left={0: 229, 1: 0}))   # "long" ends
    assert s.schedule().max_steps == 40
    # a command handed out before the last one's events: their bounds predate its steps
    ahead = s.schedule()
    s.apply(Events([], 40, StepCounters(), steps_left={0: 100, 1: 1}))
    assert s._slots[0].steps_left == 100 - ahead.max_steps


def test_commands_scheduled_ahead_run_only_what_outlasts_the_commands_in_flight():
    """schedule(ahead=True) (a command queued behind those in flight): None when no request can run
    after them, and none while a slot frees with them and requests wait (the waiting request is
    admitted right after instead); a free slot takes a waiting request at once."""
    from model.phases import StepBudget

    s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("a", [1], params(max_tokens=32, max_denoising_steps=4))     # 1 canvas: 4 steps
    s.add("b", [1], params(max_tokens=64, max_denoising_steps=9))     # 2 canvases: (9 + 1) + 9
    assert s.schedule().max_steps == 8                     # a: bound 0 after it, b: 12
    s.add("c", [1], params(max_tokens=32))                 # waits for a slot: a's frees in flight
    assert s.schedule(ahead=True) is None
    s.apply(Events([Block(0, body(32), 4, 1)], 8, StepCounters(), steps_left={0: 0, 1: 12}))
    command = s.schedule()                                 # a finished: c takes its slot at once
    assert command.release == (0,) and [n.slot for n in command.admit] == [0]

    # (no short commands for bursts here, test_commands_stay_short_while_a_burst_may_be_arriving: the
    # first command leaves a slot free)
    s = make(num_slots=3, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C),
             admission_steps=8)
    s.add("a", [1], params(max_tokens=32, max_denoising_steps=4))
    s.add("b", [1], params(max_tokens=64, max_denoising_steps=9))
    s.schedule()                                           # a: bound 0 after it, b: 12
    s.add("x", [1], params(max_tokens=32))
    s.add("y", [1], params(max_tokens=32))                 # x takes the free slot ahead, y waits
    command = s.schedule(ahead=True)
    assert [n.slot for n in command.admit] == [2] and command.max_steps == 8   # a's 0 does not cut it to 1

    s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("b", [1], params(max_tokens=64, max_denoising_steps=9))
    s.add("c", [1], params(max_tokens=64, max_denoising_steps=9))
    assert s.schedule().max_steps == 8                     # both slots taken: no burst can join
    assert s.schedule(ahead=True).max_steps == 8
    s.apply(Events())
    assert s.schedule(ahead=True).max_steps == 3
    assert s.schedule(ahead=True) is None                  # their 19 steps are all in flight


def test_commands_stay_short_while_a_burst_may_be_arriving():
    """A command that admits requests and leaves a slot free, and a command queued behind it, run
    admission_steps: the rest of a burst starts that soon after its first request. Once the admission's
    command is back, or when the admission fills every slot, commands are long again; a command in which
    a request finishes, and one queued behind it, are short too (its successor may come), unless a
    request already waits for the slot."""
    from model.phases import StepBudget

    long = params(max_tokens=256, max_denoising_steps=9)     # 8 canvases of 10 steps (the last 9): outlasts everything
    s = make(num_slots=3, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("a", [1], long)
    command = s.schedule()
    assert len(command.admit) == 1 and command.max_steps == 2        # two slots left free
    assert s.schedule(ahead=True).max_steps == 2                     # queued behind the admission
    s.apply(Events())
    assert s.schedule(ahead=True).max_steps == 8                     # the admission is back: no burst came
    s.add("b", [1], long)
    s.add("c", [1], long)
    command = s.schedule(ahead=True)
    assert len(command.admit) == 2 and command.max_steps == 8        # every slot taken: nothing can join

    for successor_waits in (False, True):
        s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
        s.add("a", [1], params(max_tokens=32, max_denoising_steps=9))    # 1 canvas: 9 + 1 steps
        s.add("b", [1], long)
        assert s.schedule().max_steps == 8                               # both slots taken: long
        s.apply(Events([], 8, StepCounters(), steps_left={0: 2, 1: 72}))
        assert s.schedule().max_steps == 2                               # a finishes in it: its successor may come
        if successor_waits:   # already here: admitted right after a's events, as before
            s.add("d", [1], long)
            assert s.schedule(ahead=True) is None
        else:
            assert s.schedule(ahead=True).max_steps == 2                 # queued behind it
            s.add("d", [1], long)                                        # it comes, while both run
            assert s.schedule(ahead=True) is None                        # a's slot is not free yet
        s.apply(Events([Block(0, body(32), 10, 1)], 2, StepCounters(), steps_left={0: 0, 1: 70}))
        command = s.schedule(ahead=not successor_waits)                  # behind the short one, if any
        assert [n.slot for n in command.admit] == [0] and command.max_steps == 8   # all slots taken again


def test_where_commands_stay_long_though_a_burst_may_be_arriving():
    """Short commands only while no request waits and the rows that go on running fill at most half the
    slots; a request whose bound ends in a long command shortens only the command behind it; an
    admission is short when the rows beside it all end with the commands in flight."""
    from model.phases import StepBudget

    long = params(max_tokens=256, max_denoising_steps=9)     # 8 canvases x 10 steps
    s = make(num_slots=8, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    for i in range(4):
        s.add(f"r{i}", [1], long)
    assert s.schedule().max_steps == 2                       # 4 of 8 slots: a late row would miss passes
    s.apply(Events())
    s.add("r4", [1], long)
    assert s.schedule().max_steps == 8                       # 5 of 8 run on: its steps share their passes

    s = make(num_slots=4, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    for name in ("a", "b"):
        s.add(name, [1], params(max_tokens=32, max_denoising_steps=9))
    s.add("c", [1], long)
    assert s.schedule().max_steps == 8                       # 3 of 4 slots run on
    s.apply(Events([], 8, StepCounters(), steps_left={0: 2, 1: 2, 2: 72}))
    assert s.schedule().max_steps == 2                       # a and b end in it: only c runs on
    s.add("w1", [1], long)                                   # takes the free slot
    s.add("w2", [1], long)                                   # waits for a's
    command = s.schedule(ahead=True)
    assert len(command.admit) == 1 and command.max_steps == 8   # a request waits: the slots are spoken for

    s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("a", [1], params(max_tokens=32, max_denoising_steps=9))   # 1 canvas: 9 + 1 steps
    s.add("b", [1], long)
    assert s.schedule().max_steps == 8
    s.apply(Events([], 8, StepCounters(), steps_left={0: 5, 1: 72}))
    assert s.schedule().max_steps == 8                       # a's bound ends inside it, past a short command
    assert s.schedule(ahead=True).max_steps == 2             # the one behind it is where a's successor goes

    s = make(num_slots=2, max_queue=4, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("a", [1], params(max_tokens=32, max_denoising_steps=9))
    s.add("b", [1], params(max_tokens=64, max_denoising_steps=7))    # 2 canvases: 2 x (7 + 1) steps
    s.schedule()
    s.apply(Events([], 8, StepCounters(), steps_left={0: 2, 1: 9}))
    assert s.schedule().max_steps == 2                       # a ends in it
    s.apply(Events([Block(0, body(32), 10, 1)], 2, StepCounters(), steps_left={0: 0, 1: 7}))
    assert s.schedule().max_steps == 7                       # b alone, to its end
    s.add("c", [1], long)                                    # a's successor, while b's last command runs
    command = s.schedule(ahead=True)
    assert len(command.admit) == 1 and command.max_steps == 2   # b's slot frees before it: room for b's successor


def test_ar_arrivals_never_hold_back_decoding_rows_two_commands_in_a_row():
    """A command that ends an AR request's prompt is its prefill alone (its first token, the prefill's
    prediction, streams at the prefill's end); rows already decoding lose that command's boundary, never
    two in a row: while one-token AR requests keep coming (each done at its prefill), a long request runs
    its steps at least every other command."""
    from model.phases import StepBudget

    s = make(num_slots=4, max_queue=64, max_model_len=512, max_steps_per_command=8, budget=StepBudget(C))
    s.add("long", [1], params(max_tokens=200, mode="ar"))
    assert s.schedule().max_steps == 0          # alone, nothing else decodes
    s.apply(Events([Block(0, body(1))], 0, StepCounters(), steps_left={0: 199}))
    for i in range(30):
        s.add(f"one-{i}", [1, 7], params(max_tokens=1, mode="ar"))
    sizes, emitted = [], 1
    for _ in range(12):
        command = s.schedule()
        sizes.append(command.max_steps)
        emitted += command.max_steps
        blocks = [Block(0, body(command.max_steps))] if command.max_steps else []
        blocks += [Block(a.slot, body(1)) for a in command.admit]
        s.apply(Events(blocks, command.max_steps, StepCounters(),
                       steps_left={0: 200 - emitted} | {a.slot: 0 for a in command.admit}))
    assert 0 in sizes and all(a or b for a, b in zip(sizes, sizes[1:])), sizes
    assert sum(sizes) >= 6, sizes
