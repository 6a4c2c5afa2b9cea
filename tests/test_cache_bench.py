"""benchmarks/cache_bench: its arguments, the conversations' text and history, the chat stream's timing
and usage (through a stand-in server in-process: no server is started), the statistics of turns and
windows, and the figures the docs' cache-bench table reads."""
import asyncio
import json

import httpx
import numpy as np
import pytest

from benchmarks import cache_bench as cb
from benchmarks.bench_prompts import load_tokenizer
from benchmarks.bench_stats import RequestResult
from benchmarks.result_tables import TABLES

pytestmark = pytest.mark.shared_serve


def test_arguments():
    args = cb.parse_args(["device=cpu", "--workload", "long-prompt", "load_format=dummy", "--running", "2"])
    assert args.server_args == ["device=cpu", "load_format=dummy"] and args.running == 2
    assert (args.conversations, args.turns, args.system_tokens, args.long_prompt_tokens) == (8, 5, 1000, 16384)
    assert cb.workloads(args) == ("long-prompt",) and cb.workloads(cb.parse_args([])) == cb.WORKLOADS
    # ours first, the user's KEY=VALUE over them, the setting measured last
    assert cb.server_args(args, "long-prompt", "prefill_chunk_tokens=32768") == [
        "max_num_seqs=3", "max_model_len=20480", "device=cpu", "load_format=dummy", "prefill_chunk_tokens=32768"]
    assert cb.server_args(args, "conversations", None) == ["device=cpu", "load_format=dummy"]
    assert [s for _, s in cb.settings("long-prompt", args)] == [None, "prefill_chunk_tokens=32768"]
    assert cb.settings("conversations", args) == cb.CACHING
    for bad in (["device"], ["--turns", "0"], ["--long-prompt-tokens", "40000"]):
        with pytest.raises(SystemExit):
            cb.parse_args(bad)


def test_history_and_text():
    users, answers = ["u0", "u1", "u2"], ["a0", "a1"]
    assert cb.turn_messages("S", users, answers, 0) == [{"role": "system", "content": "S"},
                                                          {"role": "user", "content": "u0"}]
    assert [(m["role"], m["content"]) for m in cb.turn_messages("S", users, answers, 2)] == [
        ("system", "S"), ("user", "u0"), ("assistant", "a0"), ("user", "u1"), ("assistant", "a1"), ("user", "u2")]
    body = cb.chat_body("m", cb.turn_messages("S", users, answers, 1), 32)
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_completion_tokens"] == 32

    tokenizer = load_tokenizer(str(cb.DEFAULT_MODEL))
    args = cb.parse_args(["--conversations", "3", "--turns", "2", "--system-tokens", "300", "--user-tokens", "20"])
    plan = cb.plan_conversations(tokenizer, args)
    assert 290 <= len(tokenizer.encode(plan.system, add_special_tokens=False)) <= 300
    assert [len(u) for u in plan.users] == [2, 2, 2] and len({u for us in plan.users for u in us}) == 6
    assert plan == cb.plan_conversations(tokenizer, args)   # the seed's
    # one chat alone first, its own system prompt (it must not warm the others' cache), --alone-turns turns
    assert len(plan.alone.users) == 1 and len(plan.alone.users[0]) == 5 and plan.alone.alone is None
    assert plan.alone.system[:80] != plan.system[:80]
    assert cb.plan_conversations(tokenizer, cb.parse_args(["--alone-turns", "0"])).alone is None
    with pytest.raises(SystemExit):
        cb.parse_args(["--alone-turns", "-1"])


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chat_stream(answer: str, prompt_tokens: int, cached: int) -> bytes:
    """What the server streams for one chat choice: the role chunk, two content chunks, usage, [DONE]."""
    half = len(answer) // 2
    return _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {"content": answer[:half]}}]},
                {"choices": [{"index": 0, "delta": {"content": answer[half:]}, "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 4,
                                          "total_tokens": prompt_tokens + 4,
                                          "prompt_tokens_details": {"cached_tokens": cached}}},
                "[DONE]")


def test_the_chat_stream_is_timed_at_output_chunks_and_reads_usage():
    res, text = RequestResult(), []
    assert cb.read_chat_event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                              res, 0.1, text)
    assert res.chunk_times == [] and text == []   # the role chunk is no output
    assert cb.read_chat_event(json.dumps({"choices": [{"index": 0, "delta": {"content": ""}}]}), res, 0.3, text)
    assert res.chunk_times == [0.3]   # tokens whose text is not complete yet still arrived
    assert not cb.read_chat_event("[DONE]", res, 0.4, text)
    with pytest.raises(cb.StreamError, match="boom"):
        cb.read_chat_event(json.dumps({"error": {"message": "boom"}}), res, 0.5, text)


def test_conversations_resend_their_history_against_a_stand_in():
    """run_conversations against an in-process stand-in (httpx's MockTransport): every turn carries the
    earlier turns' answers, and the statistics count what the usage reported."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body["messages"])
        turn = sum(m["role"] == "user" for m in body["messages"]) - 1
        user = body["messages"][-1]["content"]
        if user == "fail":
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, content=_chat_stream(f"answer to {user}", 100 + 10 * turn, 16 * turn))

    plan = cb.ConversationPlan("S", [["a", "b", "c"], ["x", "fail", "z"]])

    class Characters:   # a tokenizer stand-in: a token per character of the messages
        @staticmethod
        def apply_chat_template(messages, **kwargs):
            return [ord(ch) for m in messages for ch in m["content"] * 10]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await cb.run_conversations(client, "http://stand-in", "m", plan, 32, Characters())

    turns, wall = asyncio.run(go())
    assert wall > 0 and len(turns) == 5   # the second conversation ends at its failed turn
    last = next(m for m in seen if m[-1]["content"] == "c")
    assert [m["content"] for m in last] == ["S", "a", "answer to a", "b", "answer to b", "c"]
    ok = [t for t in turns if t.result.ok]
    assert [t.answer for t in ok if t.conversation == 0] == ["answer to a", "answer to b", "answer to c"]
    assert all(t.result.ttft is not None and len(t.result.chunk_times) == 2 for t in ok)

    s = cb.conversation_stats(turns, wall)
    assert (s["requests"], s["failed"]) == (5, 1) and s["errors"][0].startswith("HTTP 503")
    assert s["prompt_tokens"] == 100 + 110 + 120 + 100 and s["cached_tokens"] == 16 + 32
    assert s["hit_rate"] == pytest.approx(48 / 430) and s["hit_rate_later_turns"] == pytest.approx(48 / 230)
    later = [t.result.ttft for t in ok if t.turn > 0]
    assert s["ttft_s"]["mean"] == pytest.approx(np.mean(later))
    # our count of turn 2 of the first conversation: 10 x (S a "answer to a" b) = 140, of which turn 1's
    # 20 (S a) were sent before: 16 in whole pages; its turn 3 shares turn 2's 140: 128 in pages
    assert [len(t.prompt_ids) for t in turns if t.conversation == 0] == [20, 140, 260]
    assert cb.prefix_bound([t for t in turns if t.conversation == 0]) == [0, 16, 128]


def _turn(c, k, sent, latency, ids, cached=0, ttft=0.5) -> cb.Turn:
    usage = {"prompt_tokens": len(ids), "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": cached}}
    res = RequestResult(ok=True, input_tokens=len(ids), output_tokens=8, chunk_times=[ttft], latency=latency,
                        usage=usage)
    return cb.Turn(c, k, sent, res, "a", ids)


def test_turn_statistics_and_the_prefix_bound():
    system = list(range(40))
    t0 = _turn(0, 0, 0.0, 1.0, system + [100, 101])
    t1 = _turn(1, 0, 0.1, 1.0, system + [200])                      # beside t0: nothing finished before it
    t2 = _turn(0, 1, 1.0, 1.0, system + [100, 101, 7, 8, 9], 32, ttft=0.2)   # after t0: its 42 tokens, 32 in pages
    t3 = _turn(1, 1, 1.1, 1.0, list(range(33)), 16, ttft=0.4)        # 33 shared, the last never: 32
    assert cb.prefix_bound([t0, t1, t2, t3]) == [0, 0, 32, 32]
    s = cb.conversation_stats([t0, t1, t2, t3], 2.5)
    assert s["ttft_s"]["mean"] == pytest.approx(0.3) and s["ttft_s"]["p50"] == pytest.approx(0.3)
    assert s["ttft_first_turn_s"]["mean"] == 0.5 and s["prompt_tokens"] == 42 + 41 + 45 + 33
    assert s["hit_rate"] == pytest.approx(48 / 161) and s["prefix_bound_rate"] == pytest.approx(64 / 161)
    assert s["client_prompt_tokens"] == 161 and s["wall_s"] == 2.5


def test_window_gaps_count_gaps_by_the_chunk_that_ends_them():
    a = cb.Running(10.0, RequestResult(ok=True, chunk_times=[0.5, 1.0, 3.0, 3.5]))   # 10.5, 11, 13, 13.5
    b = cb.Running(12.0, RequestResult(ok=True, chunk_times=[0.2, 0.4]))             # 12.2, 12.4
    assert a.chunk_times == [10.5, 11.0, 13.0, 13.5]
    assert sorted(cb.window_gaps([a, b], 11.0, 13.0)) == pytest.approx([0.2, 0.5])
    assert sorted(cb.window_gaps([a, b], 12.5, 20.0)) == pytest.approx([0.5, 2.0])
    # overlapping: the stall from 11 to 13 counts in a window that ends before it does
    assert sorted(cb.window_gaps([a, b], 11.5, 12.3, overlap=True)) == pytest.approx([0.2, 2.0])
    assert cb.window_gaps([a, b], 11.0, 11.0, overlap=True) == []
    # a TTFT is counted as a gap from its sending: b's (12 to 12.2) ends in [12.1, 13) and overlaps [11, 12.1)
    assert cb.window_ttfts([a, b], 12.1, 13.0) == pytest.approx([0.2]) and cb.window_ttfts([a, b], 11, 12.1) == []
    assert cb.window_ttfts([a, b], 11, 12.1, overlap=True) == pytest.approx([0.2])


def test_the_first_running_requests_are_staggered():
    assert [cb.stagger(i, 4, 256) for i in range(4)] == [64, 128, 192, 256]
    assert cb.stagger(0, 8, 4) == 1 and cb.stagger(0, 1, 256) == 256


def _run(ttft: float, itl: float, long_ttft: float) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p99": ttft, "max": ttft}
    window = {"gaps": 10, "itl_s": {"mean": itl, "p50": itl, "p99": 2 * itl, "max": 3 * itl}, "ttft_s": stats}
    loud = {"gaps": 10, "itl_s": {"mean": 3 * itl, "p50": 3 * itl, "p99": 6 * itl, "max": 9 * itl}, "ttft_s": stats}
    return {"without_long": window, "with_long": loud, "running_failed": 0,
            "long_prompt": {"ok": True, "ttft_s": long_ttft, "latency_s": long_ttft + 1}}


def _stats(ttft: float, cached: int) -> dict:
    return {"ttft_s": {"mean": ttft, "p50": ttft, "p99": 2 * ttft}, "ttft_every_turn_s": {"mean": 2 * ttft},
            "prompt_tokens": 1000,
            "cached_tokens": cached, "hit_rate": cached / 1000, "hit_rate_later_turns": cached / 800,
            "prefix_bound_rate": 0.5, "wall_s": 9.0 * ttft, "failed": 0, "completion_tokens": 320}


def _conversation(ttft: float, cached: int, alone: float | None = None) -> dict:
    return {"stats": _stats(ttft, cached),
            "metrics": {"dllm_prefix_cache_queries_total": 1000.0, "dllm_prefix_cache_hits_total": float(cached)},
            **({"alone": {"stats": _stats(alone, cached),   # the server's TTFT: 5 turns of 1.5 x alone each
                          "metrics": {"dllm_time_to_first_token_seconds_sum": 7.5 * alone,
                                      "dllm_time_to_first_token_seconds_count": 5.0}}}
               if alone is not None else {})}


def sample_result() -> dict:
    """A result of both workloads, each setting measured, with made-up values (the names are what count)."""
    return {"workloads": {"conversations": {"cached": _conversation(0.5, 600, alone=0.1),
                                            "uncached": _conversation(1.0, 0, alone=0.4)},
                          "long-prompt": {"chunked": _run(0, 0.1, 2.0), "unchunked": _run(0, 0.2, 3.0)}}}


def test_figures_name_every_figure_of_the_docs_table():
    got = cb.figures(sample_result())
    assert got["conversations_ttft_mean_s_cached"] == 0.5 and got["conversations_hit_rate_cached"] == 0.6
    assert got["conversations_ttft_mean_cached_over_uncached"] == 0.5 and got["conversations_metrics_hit_rate_cached"] == 0.6
    assert got["long_prompt_itl_p99_s_chunked_with_long"] == pytest.approx(0.6)
    assert got["long_prompt_itl_p99_ratio_unchunked"] == pytest.approx(3.0) and got["long_prompt_ttft_s_unchunked"] == 3.0
    assert got["conversations_committed_tok_s_cached_over_uncached"] == pytest.approx(2.0)
    assert got["conversations_alone_ttft_mean_s_cached"] == 0.1
    assert got["conversations_alone_ttft_p50_cached_over_uncached"] == pytest.approx(0.25)
    # the client's mean TTFT of every turn alone minus the coordinator's (its histogram's sum / count)
    assert got["conversations_alone_server_ttft_mean_s_cached"] == pytest.approx(0.15)
    assert got["conversations_alone_path_s_cached"] == pytest.approx(0.2 - 0.15)
    named = {k for table in ("cache-bench", "cache-bench-gpu") for row in TABLES[table].rows for k in row.keys}
    assert named <= set(got)
    # a server that did not start: no figures of it, and no ratio
    failed = cb.figures({"workloads": {"conversations": {"cached": {"error": "x"}, "uncached": _conversation(1, 0)}}})
    assert "conversations_ttft_mean_s_cached" not in failed and failed["conversations_ttft_mean_cached_over_uncached"] is None


def test_a_stopped_run_keeps_what_its_servers_measured(tmp_path, monkeypatch):
    """Stopped (SIGTERM, a bounded GPU call's end) after one server ended: that server's run is saved, with
    its figures in a result file, and the exit status says it was stopped."""
    def one_server_then_stopped(args, result):
        result["workloads"]["conversations"] = {"cached": _conversation(0.5, 600)}
        raise KeyboardInterrupt

    monkeypatch.setattr(cb, "measure", one_server_then_stopped)
    saved = tmp_path / "run.json"
    status = cb.main(["--workload", "conversations", "--save-result", str(saved), "--results-dir", str(tmp_path)])
    assert status == 130
    assert json.loads(saved.read_text())["workloads"]["conversations"]["cached"]["stats"]["cached_tokens"] == 600
    [result_file] = tmp_path.glob("*-cache_bench.json")
    written = json.loads(result_file.read_text())
    figures = written["figures"]
    assert "stopped midway" in written["note"]
    assert figures["conversations_ttft_mean_s_cached"] == 0.5 and "conversations_ttft_mean_s_uncached" not in figures
