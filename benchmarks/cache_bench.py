"""Prefix caching and chunked prefill as a user sees them: through HTTP, each setting on a freshly started server.

    python -m benchmarks.cache_bench [--workload conversations|long-prompt|all] [--model DIR] [KEY=VALUE ...]

conversations: --conversations chats of --turns turns each, run concurrently over /v1/chat/completions
(streamed, greedy), every chat opening with one shared system prompt of --system-tokens tokens; each turn
resends the whole history (the system prompt, the earlier user turns and the assistant's answers as
streamed) plus a new user message. Against a server with enable_prefix_caching=true, then one with false:
the TTFT of turns 2.., the prompt tokens sent, the cached tokens reported
(usage.prompt_tokens_details.cached_tokens), their ratio (the hit rate), /metrics' prefix-cache counters
and the wall time; and the TTFT ratio on / off. Before them, one chat of --alone-turns turns runs alone,
with a system prompt of its own: its TTFT ratio is a cached prefix's with nothing running beside it.

long-prompt: --running streamed completions (--running-max-tokens each, ignore_eos; a new one starts as one
ends; the first ones shorter, so that they do not all end together) on a server of max_num_seqs =
running + 1; the gaps between their streamed chunks (ITL) that end in a window of --window-s without
interference, then those that overlap a window that starts by sending one --long-prompt-tokens prompt
(token ids, max_tokens --long-max-tokens) and lasts --window-s or until it is answered, whichever is
later (the running requests end their streams before the gaps are counted, so a stall that outlasts the
window is counted whole). Against a server with prefill_chunk_tokens at its default (chunked), then one
with it at --unchunked-tokens (the whole prompt in one command): the running requests' ITL p50 / p99 in
each window and the ratio with / without, the TTFT of the running requests (counted in a window as a gap
is), and the long prompt's TTFT.

KEY=VALUE arguments go to every server's scripts/serve_local.py (e.g. device=cpu, load_format=dummy,
max_model_len=...). Every figure of the run goes to one result file (benchmarks/results.py, tool
`cache_bench`); --save-result writes everything measured, per turn and per window, as JSON.
docs/benchmarking.md says what each figure is.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from benchmarks import results
from benchmarks.bench_prompts import FALLBACK_VOCAB, _round_trip_tokens, load_tokenizer, token_id_prompts
from benchmarks.bench_stats import RequestResult
from benchmarks.serve_bench import json_safe, merge, request_body, send
from benchmarks.server_process import REPO, ServerError, ServerProcess, scrape_metrics, tree_commit
from benchmarks.traffic import FIRST_REQUEST

DEFAULT_MODEL = REPO / "model" / "checkpoints" / "tiny-docstrings"
WORKLOADS = ("conversations", "long-prompt")
PAGE = 16   # the KV cache's page: the prefix cache serves whole pages (docs/api.md#usage)
CACHE_METRICS = ("dllm_prefix_cache_queries_total", "dllm_prefix_cache_hits_total")
# what ran outside the warm-up's set while the workload ran (CUDA): a compile stalls the whole replica
STALL_METRICS = ("dllm_kernel_compiles_total", "dllm_eager_steps_total")
# the coordinator's own time to first token (from a request's arrival there to its first block): the
# client's minus it is the path through HTTP, the ingress and the Ray call to the coordinator (and any text
# the ingress's detokenizer holds back)
TTFT_METRICS = ("dllm_time_to_first_token_seconds_sum", "dllm_time_to_first_token_seconds_count")
SCRAPED = CACHE_METRICS + STALL_METRICS + TTFT_METRICS
# each workload's two servers: (figure suffix, the serve_local argument that differs)
CACHING = (("cached", "enable_prefix_caching=true"), ("uncached", "enable_prefix_caching=false"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("server_args", nargs="*", metavar="KEY=VALUE", help="more serve_local arguments, for every server")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="the checkpoint directory served (default: the default model, tiny-docstrings); its "
                        "tokenizer builds the conversations' text")
    p.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    p.add_argument("--seed", type=int, default=0, help="the words of the conversations, the running prompts' ids")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request of both workloads, e.g. \'{"diffusion": {"mode": "ar"}}\'')
    c = p.add_argument_group("conversations")
    c.add_argument("--conversations", type=_positive, default=8, help="chats run concurrently")
    c.add_argument("--turns", type=_positive, default=5, help="turns of each chat, in order")
    c.add_argument("--alone-turns", type=_non_negative, default=5, help="turns of one chat run alone first, with a system "
                   "prompt of its own (0: none)")
    c.add_argument("--system-tokens", type=_positive, default=1000, help="the shared system prompt's tokens")
    c.add_argument("--user-tokens", type=_positive, default=24, help="each user message's tokens")
    c.add_argument("--max-completion-tokens", type=_positive, default=32, help="of every turn")
    lp = p.add_argument_group("long-prompt")
    lp.add_argument("--running", type=_positive, default=4, help="streamed completions kept running")
    lp.add_argument("--running-prompt-tokens", type=_positive, default=64)
    lp.add_argument("--running-max-tokens", type=_positive, default=256, help="of each running completion")
    lp.add_argument("--long-prompt-tokens", type=_positive, default=16384)
    lp.add_argument("--long-max-tokens", type=_positive, default=32)
    lp.add_argument("--long-max-model-len", type=_positive, default=20480,
                    help="the long-prompt servers' max_model_len (a max_model_len=... argument wins)")
    lp.add_argument("--chunked-tokens", type=_positive,
                    help="prefill_chunk_tokens of the chunked server (default: the server's default)")
    lp.add_argument("--unchunked-tokens", type=_positive, default=32768,
                    help="prefill_chunk_tokens of the unchunked server (at least the long prompt)")
    lp.add_argument("--warmup-s", type=float, default=3.0, help="running before the first window")
    lp.add_argument("--window-s", type=float, default=10.0, help="each window's least length")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds from a server's start to its first "
                                                                      "successful completion")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds an HTTP read may wait")
    p.add_argument("--workload-timeout", type=float, default=900.0, help="seconds a workload may run on one server")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "dllm-cache-bench",
                   help="the servers' logs")
    p.add_argument("--results-dir", type=results.directory, default=results.DEFAULT_DIR,
                   help="where the result file goes (benchmarks/results.py; default: $OUT where set, else "
                        "benchmarks/results); '' writes none")
    p.add_argument("--save-result", type=Path, help="write everything measured as JSON here")
    args = p.parse_intermixed_args(argv)
    bad = [a for a in args.server_args if not re.fullmatch(r"[A-Za-z_]\w*=.+", a)]
    if bad:
        p.error(f"server arguments are KEY=VALUE: {bad}")
    if args.workload in ("long-prompt", "all") and args.unchunked_tokens < args.long_prompt_tokens:
        p.error("--unchunked-tokens must be at least --long-prompt-tokens (one command prefills it whole)")
    return args


def _at_least(least: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}: {text}")
        return value
    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def workloads(args: argparse.Namespace) -> tuple[str, ...]:
    return WORKLOADS if args.workload == "all" else (args.workload,)


# ---- what is sent ------------------------------------------------------------------------------------

def word_pool(tokenizer) -> list[str]:
    """The tokenizer's whole words: single tokens that decode to a space and 3 or more letters and encode
    back to themselves, so text of n such words is about n tokens."""
    ids = [int(i) for i in _round_trip_tokens(tokenizer)]
    words = [w for w in tokenizer.batch_decode([[i] for i in ids])
             if w.startswith(" ") and len(w) > 3 and w[1:].isalpha() and w[1:].isascii()]
    assert words, f"no whole words in {tokenizer.name_or_path}'s vocabulary"
    return sorted(set(words))


def words_text(tokenizer, pool: list[str], n_tokens: int, rng: np.random.Generator) -> str:
    """Words of `pool` drawn by `rng`, as many as keep the text at `n_tokens` tokens at most (about
    `n_tokens`: one token a word), without the first word's space."""
    words = list(rng.choice(pool, n_tokens))
    while len(words) > 1 and len(tokenizer.encode("".join(words).lstrip(), add_special_tokens=False)) > n_tokens:
        words.pop()
    return "".join(words).lstrip()


@dataclass(frozen=True)
class ConversationPlan:
    system: str                  # the shared system prompt
    users: list[list[str]]       # each conversation's user messages, one a turn
    # one chat alone, run before the others with a system prompt of its own: the TTFT of a cached prefix
    # with nothing else running (None: not run)
    alone: "ConversationPlan | None" = None


def plan_conversations(tokenizer, args: argparse.Namespace) -> ConversationPlan:
    pool = word_pool(tokenizer)

    def chats(rng: np.random.Generator, n: int, turns: int) -> tuple[str, list[list[str]]]:
        system = words_text(tokenizer, pool, args.system_tokens, rng)
        return system, [[words_text(tokenizer, pool, args.user_tokens, rng) for _ in range(turns)] for _ in range(n)]

    alone = ConversationPlan(*chats(np.random.default_rng([args.seed, 1]), 1, args.alone_turns)) \
        if args.alone_turns else None
    return ConversationPlan(*chats(np.random.default_rng(args.seed), args.conversations, args.turns), alone)


def turn_messages(system: str, users: list[str], answers: list[str], turn: int) -> list[dict]:
    """The messages of turn `turn` (0-based): the system prompt, every earlier user message with the
    assistant's answer to it, then this turn's user message."""
    assert len(answers) >= turn, "the answers of every earlier turn"
    messages = [{"role": "system", "content": system}]
    for user, answer in zip(users[:turn], answers[:turn]):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": users[turn]}]


def chat_body(model: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    return merge({"model": model, "messages": messages, "max_completion_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}, extra or {})


# ---- the client --------------------------------------------------------------------------------------

@dataclass
class Turn:
    """One chat request as the client saw it."""
    conversation: int
    turn: int
    sent_s: float                        # since the workload's start
    result: RequestResult
    answer: str = ""
    prompt_ids: list[int] = field(default_factory=list, repr=False)   # the chat template's tokens, ours
    messages: list[dict] = field(default_factory=list, repr=False)

    @property
    def cached_tokens(self) -> int:
        usage = self.result.usage or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def read_chat_event(data: str, res: RequestResult, now: float, text: list[str]) -> bool:
    """One `data:` payload of a streamed chat completion into `res`; False at [DONE]. The role chunk the
    stream opens with carries no output: it is not a chunk with choices for TTFT and ITL."""
    if data == "[DONE]":
        return False
    msg = json.loads(data)
    if "error" in msg:
        raise StreamError(f"in stream: {msg['error'].get('message', msg['error'])}")
    choices = msg.get("choices") or []
    outputs = [c for c in choices if "role" not in (c.get("delta") or {})]
    if outputs:
        res.chunk_times.append(now)
        text += [(c.get("delta") or {}).get("content") or "" for c in outputs]
    if msg.get("usage"):
        res.usage = msg["usage"]
    return True


class StreamError(RuntimeError):
    pass


async def send_chat(client: httpx.AsyncClient, url: str, body: dict) -> tuple[RequestResult, str]:
    """One streamed chat completion, timed at every chunk with output; its result and its answer's text."""
    res, text = RequestResult(), []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res, ""
            async for line in r.aiter_lines():
                if line.startswith("data:") and not read_chat_event(line[5:].strip(), res,
                                                                     time.perf_counter() - start, text):
                    break
        res.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, StreamError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res, ""
    res.ok = res.usage is not None
    if not res.ok:
        res.error = "the stream ended without usage"
    else:
        res.input_tokens, res.output_tokens = res.usage["prompt_tokens"], res.usage["completion_tokens"]
    return res, "".join(text)


async def run_conversations(client: httpx.AsyncClient, base: str, model: str, plan: ConversationPlan,
                            max_tokens: int, tokenizer=None, extra: dict | None = None) -> tuple[list[Turn], float]:
    """Every conversation at once, each one's turns in order (a failed turn ends its conversation); the
    turns and the wall time."""
    url = base + "/v1/chat/completions"
    t0 = time.perf_counter()

    async def one(c: int, users: list[str]) -> list[Turn]:
        answers, turns = [], []
        for k in range(len(users)):
            messages = turn_messages(plan.system, users, answers, k)
            sent = time.perf_counter() - t0
            res, answer = await send_chat(client, url, chat_body(model, messages, max_tokens, extra))
            turns.append(Turn(c, k, sent, res, answer, messages=messages))
            if not res.ok:
                break
            answers.append(answer)
        return turns

    done = await asyncio.gather(*(one(c, users) for c, users in enumerate(plan.users)))
    wall = time.perf_counter() - t0
    turns = [t for turns in done for t in turns]
    if tokenizer is not None:   # after the clock: no tokenizing between a conversation's turns
        for t in turns:
            t.prompt_ids = list(tokenizer.apply_chat_template(t.messages, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))
    return turns, wall


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_bound(turns: list[Turn]) -> list[int]:
    """Per turn, the tokens of its prompt (ours, by the chat template) in whole pages that the prompt of a
    request finished before it was sent already held, its last token never: what a prefix cache that
    evicted nothing serves at least (answers' committed blocks can add to it)."""
    bounds = []
    for t in turns:
        done = [o.prompt_ids for o in turns if o.result.ok and o.sent_s + o.result.latency <= t.sent_s]
        shared = max((common_prefix(t.prompt_ids, ids) for ids in done), default=0)
        bounds.append(min(shared, max(len(t.prompt_ids) - 1, 0)) // PAGE * PAGE)
    return bounds


def conversation_stats(turns: list[Turn], wall_s: float) -> dict:
    """TTFT of turns 2.. (seconds), tokens sent and cached, hit rates, the wall time."""
    ok = [t for t in turns if t.result.ok]
    later = [t for t in ok if t.turn > 0]
    prompt = sum(t.result.input_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    later_prompt = sum(t.result.input_tokens for t in later)
    bound = sum(prefix_bound(ok)) if all(t.prompt_ids for t in ok) and ok else None
    return {"requests": len(turns), "failed": len(turns) - len(ok),
            "errors": sorted({t.result.error for t in turns if not t.result.ok}),
            "ttft_s": _quantiles([t.result.ttft for t in later if t.result.ttft is not None]),
            "ttft_first_turn_s": _quantiles([t.result.ttft for t in ok if t.turn == 0 and t.result.ttft is not None]),
            "ttft_every_turn_s": _quantiles([t.result.ttft for t in ok if t.result.ttft is not None]),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "hit_rate_later_turns": sum(t.cached_tokens for t in later) / later_prompt if later_prompt else None,
            "prefix_bound_tokens": bound, "prefix_bound_rate": bound / prompt if prompt and bound is not None else None,
            "client_prompt_tokens": sum(len(t.prompt_ids) for t in ok) if ok and all(t.prompt_ids for t in ok) else None,
            "completion_tokens": sum(t.result.output_tokens or 0 for t in ok), "wall_s": wall_s}


@dataclass
class Running:
    """A streamed completion of the running set; chunk times on the workload's clock."""
    sent_s: float
    result: RequestResult

    @property
    def chunk_times(self) -> list[float]:
        return [self.sent_s + t for t in self.result.chunk_times]


def _in_window(a: float, b: float, start: float, end: float, overlap: bool) -> bool:
    return a < end and b > start if overlap else start <= b < end


def window_gaps(requests: list[Running], start: float, end: float, overlap: bool = False) -> list[float]:
    """Gaps between consecutive chunks of each request that end in [start, end); with `overlap`, every gap
    that overlaps it (a stall that began before the window's end is counted, however late it ends)."""
    gaps = []
    for r in requests:
        gaps += [b - a for a, b in itertools.pairwise(r.chunk_times) if _in_window(a, b, start, end, overlap)]
    return gaps


def window_ttfts(requests: list[Running], start: float, end: float, overlap: bool = False) -> list[float]:
    """The TTFT of each request, from its sending to its first chunk, counted as `window_gaps` counts a gap."""
    return [r.result.ttft for r in requests if r.result.ttft is not None
            and _in_window(r.sent_s, r.sent_s + r.result.ttft, start, end, overlap)]


async def run_long_prompt(client: httpx.AsyncClient, base: str, model: str, args: argparse.Namespace) -> dict:
    """The running set, a window without interference, then one that starts with the long prompt; the
    gaps' statistics in each and the long prompt's own times."""
    url = base + "/v1/completions"
    rng = np.random.default_rng([args.seed, 2])
    running_opts = argparse.Namespace(random_output_len=args.running_max_tokens, temperature=0.0, ignore_eos=True,
                                      extra_body=args.extra_body)
    long_opts = argparse.Namespace(random_output_len=args.long_max_tokens, temperature=0.0, ignore_eos=True,
                                   extra_body=args.extra_body)
    t0 = time.perf_counter()
    stop = asyncio.Event()
    done: list[Running] = []

    async def keep_running(i: int) -> None:
        max_tokens = stagger(i, args.running, args.running_max_tokens)
        while not stop.is_set():
            prompt = token_id_prompts(1, args.running_prompt_tokens, FALLBACK_VOCAB, rng).prompts[0]
            sent = time.perf_counter() - t0
            body = request_body(running_opts, model, prompt) | {"max_tokens": max_tokens}
            res = await send(client, url, body, len(prompt), None)
            done.append(Running(sent, res))
            max_tokens = args.running_max_tokens
            if not res.ok:
                await asyncio.sleep(0.5)   # a failing server: no busy loop

    tasks = [asyncio.create_task(keep_running(i)) for i in range(args.running)]
    try:
        await asyncio.sleep(args.warmup_s + args.window_s)
        long_prompt = token_id_prompts(1, args.long_prompt_tokens, FALLBACK_VOCAB, rng).prompts[0]
        long_sent = time.perf_counter() - t0
        quiet = (args.warmup_s, long_sent)
        long_task = asyncio.create_task(send(client, url, request_body(long_opts, model, long_prompt),
                                             len(long_prompt), None))
        await asyncio.sleep(args.window_s)
        long_res = await long_task
        loud = (long_sent, max(long_sent + args.window_s, time.perf_counter() - t0))
    finally:
        stop.set()   # each running request ends by itself (max_tokens), within a read timeout
        _, stuck = await asyncio.wait(tasks, timeout=args.request_timeout)
        for task in stuck:
            task.cancel()
    errors = sorted({r.result.error for r in done if not r.result.ok} |
                    ({f"{len(stuck)} running requests did not end"} if stuck else set()))
    out = {"running_requests": len(done), "running_failed": sum(not r.result.ok for r in done), "errors": errors,
           "long_prompt": {"ok": long_res.ok, "error": long_res.error, "ttft_s": long_res.ttft,
                           "latency_s": long_res.latency if long_res.ok else None,
                           "prompt_tokens": long_res.input_tokens, "sent_s": long_sent,
                           "chunk_times_s": [long_sent + t for t in long_res.chunk_times]},
           "running": [{"sent_s": r.sent_s, "ok": r.result.ok, "chunk_times_s": r.chunk_times} for r in done]}
    for name, (start, end) in (("without_long", quiet), ("with_long", loud)):
        gaps = window_gaps(done, start, end, overlap=name == "with_long")
        ttfts = window_ttfts(done, start, end, overlap=name == "with_long")
        out[name] = {"window_s": [start, end], "gaps": len(gaps), "itl_s": _quantiles(gaps),
                     "started": len(ttfts), "ttft_s": _quantiles(ttfts)}
    return out


def stagger(i: int, running: int, max_tokens: int) -> int:
    """max_tokens of running request i's first completion: (i + 1) / running of the rest's, so the running
    requests end at different times (started together, they would all end together, leaving the window
    without a stream to interrupt)."""
    return max(1, round(max_tokens * (i + 1) / running))


# ---- the servers -------------------------------------------------------------------------------------

def server_args(args: argparse.Namespace, workload: str, setting: str | None) -> list[str]:
    """Ours first (the user's KEY=VALUE win), the setting measured (None: the server's default) last."""
    ours = [f"max_num_seqs={args.running + 1}", f"max_model_len={args.long_max_model_len}"] \
        if workload == "long-prompt" else []
    return [*ours, *args.server_args, *([setting] if setting else [])]


def settings(workload: str, args: argparse.Namespace) -> tuple[tuple[str, str | None], ...]:
    if workload == "conversations":
        return CACHING
    chunked = None if args.chunked_tokens is None else f"prefill_chunk_tokens={args.chunked_tokens}"
    return (("chunked", chunked), ("unchunked", f"prefill_chunk_tokens={args.unchunked_tokens}"))


async def _on_server(server: ServerProcess, args: argparse.Namespace, workload: str, tokenizer, plan) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as http:
        cold = await server.wait_ready(http, args.start_timeout, FIRST_REQUEST)
        print(f"  /health 200 at {cold['health_200_s']:.1f} s, first completion at {cold['first_completion_s']:.1f} s",
              flush=True)
        before = await scrape_metrics(http, server.base, SCRAPED)
        if workload == "conversations":
            async def chats(p: ConversationPlan) -> dict:
                turns, wall = await asyncio.wait_for(
                    run_conversations(http, server.base, cold["model"], p, args.max_completion_tokens, tokenizer,
                                      args.extra_body),
                    args.workload_timeout)
                return {"stats": conversation_stats(turns, wall), "turns": [turn_record(t) for t in turns]}

            alone = None
            if plan.alone is not None:   # its own /metrics deltas: the concurrent chats' are theirs alone
                alone = await chats(plan.alone)
                mid = await scrape_metrics(http, server.base, SCRAPED)
                alone["metrics"], before = _deltas(before, mid), mid
            out = await chats(plan) | ({"alone": alone} if alone is not None else {})
        else:
            out = await asyncio.wait_for(run_long_prompt(http, server.base, cold["model"], args),
                                         args.workload_timeout)
        after = await scrape_metrics(http, server.base, SCRAPED)
    out["metrics"] = _deltas(before, after)
    out["cold_start"] = cold
    return out


def _deltas(before: dict, after: dict) -> dict:
    return {k: None if after[k] is None or before[k] is None else after[k] - before[k] for k in SCRAPED}


def turn_record(t: Turn) -> dict:
    return {"conversation": t.conversation, "turn": t.turn, "sent_s": t.sent_s, "ok": t.result.ok,
            "error": t.result.error, "ttft_s": t.result.ttft, "latency_s": t.result.latency,
            "prompt_tokens": t.result.input_tokens, "client_prompt_tokens": len(t.prompt_ids),
            "cached_tokens": t.cached_tokens, "completion_tokens": t.result.output_tokens, "answer": t.answer}


def new_result(args: argparse.Namespace) -> dict:
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "model": str(args.model),
            "commit": tree_commit(REPO), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workloads": {}}


def measure(args: argparse.Namespace, result: dict) -> dict:
    """Every workload against its two servers, each started cold and always stopped; each server's run goes
    into `result` as it ends (and is printed), so that a run stopped midway keeps what it measured."""
    tokenizer = load_tokenizer(str(args.model))
    for workload in workloads(args):
        plan = None
        if workload == "conversations":
            if tokenizer is None:
                raise SystemExit(f"the conversations need {args.model}'s tokenizer (its words, its chat template)")
            plan = plan_conversations(tokenizer, args)
        runs = result["workloads"][workload] = {}
        for name, setting in settings(workload, args):
            argv = server_args(args, workload, setting)
            log = args.log_dir / f"{workload}-{name}.log"
            print(f"{workload}, {name}: starting {' '.join(argv) or 'the defaults'} (log: {log})", flush=True)
            server = ServerProcess(REPO, str(args.model), argv, log)
            t = time.monotonic()
            try:
                server.start()
                runs[name] = asyncio.run(_on_server(server, args, workload, tokenizer, plan))
            except Exception as err:  # noqa: BLE001 - the server's failure, or ours: the next server runs all the same
                runs[name] = {"error": f"{type(err).__name__}: {err}"}
                if not isinstance(err, (ServerError, TimeoutError)):
                    traceback.print_exc()
                print(f"  failed: {runs[name]['error']}", file=sys.stderr, flush=True)
            finally:   # stopped midway (KeyboardInterrupt): the run says so, the server stops all the same
                run = runs.setdefault(name, {"error": "stopped before it ended"})
                run |= {"server_exit_status": server.stop(), "server_args": argv, "server_log": str(log),
                        "wall_with_start_s": time.monotonic() - t}
            print(format_workload(workload, {name: runs[name]}), flush=True)
    return result


# ---- what is reported --------------------------------------------------------------------------------

def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def figures(result: dict) -> dict[str, float | None]:
    """The result file's figures: `conversations_<figure>_<unit>_<cached|uncached>` and
    `long_prompt_<figure>_<unit>_<chunked|unchunked>_<with|without>_long`, and the ratios."""
    out: dict[str, float | None] = {}
    conv = result["workloads"].get("conversations", {})
    for name in ("cached", "uncached"):
        s = conv.get(name, {}).get("stats")
        if s is None:
            continue
        for stat in ("mean", "p50", "p99"):
            out[f"conversations_ttft_{stat}_s_{name}"] = s["ttft_s"][stat]
        out |= {f"conversations_prompt_tokens_{name}": s["prompt_tokens"],
                f"conversations_cached_tokens_{name}": s["cached_tokens"],
                f"conversations_hit_rate_{name}": s["hit_rate"],
                f"conversations_hit_rate_later_turns_{name}": s["hit_rate_later_turns"],
                f"conversations_prefix_bound_rate_{name}": s["prefix_bound_rate"],
                f"conversations_wall_s_{name}": s["wall_s"],
                f"conversations_committed_tok_s_{name}": _ratio(s.get("completion_tokens"), s["wall_s"]),
                f"conversations_failed_requests_{name}": s["failed"]}
        m = conv[name]["metrics"]
        q, h = m["dllm_prefix_cache_queries_total"], m["dllm_prefix_cache_hits_total"]
        out[f"conversations_metrics_hit_rate_{name}"] = _ratio(h, q)
        out[f"conversations_kernel_compiles_{name}"] = m.get("dllm_kernel_compiles_total")
        alone = conv[name].get("alone")
        if alone is not None:
            for stat in ("mean", "p50", "p99"):
                out[f"conversations_alone_ttft_{stat}_s_{name}"] = alone["stats"]["ttft_s"][stat]
            out[f"conversations_alone_hit_rate_later_turns_{name}"] = alone["stats"]["hit_rate_later_turns"]
            # every turn of the chat alone, the cold first one too (the server's histogram counts them all)
            a = alone.get("metrics", {})
            server = _ratio(a.get(TTFT_METRICS[0]), a.get(TTFT_METRICS[1]))
            client = alone["stats"].get("ttft_every_turn_s", {}).get("mean")
            out[f"conversations_alone_server_ttft_mean_s_{name}"] = server
            out[f"conversations_alone_path_s_{name}"] = None if server is None or client is None else client - server
    for stat in ("mean", "p50", "p99"):
        out[f"conversations_ttft_{stat}_cached_over_uncached"] = _ratio(
            out.get(f"conversations_ttft_{stat}_s_cached"), out.get(f"conversations_ttft_{stat}_s_uncached"))
    for stat in ("mean", "p50"):
        out[f"conversations_alone_ttft_{stat}_cached_over_uncached"] = _ratio(
            out.get(f"conversations_alone_ttft_{stat}_s_cached"), out.get(f"conversations_alone_ttft_{stat}_s_uncached"))
    out["conversations_committed_tok_s_cached_over_uncached"] = _ratio(
        out.get("conversations_committed_tok_s_cached"), out.get("conversations_committed_tok_s_uncached"))
    lp = result["workloads"].get("long-prompt", {})
    for name in ("chunked", "unchunked"):
        run = lp.get(name, {})
        if "with_long" not in run:
            continue
        for window in ("without_long", "with_long"):
            for stat in ("p50", "p99", "max"):
                out[f"long_prompt_itl_{stat}_s_{name}_{window}"] = run[window]["itl_s"][stat]
            out[f"long_prompt_gaps_{name}_{window}"] = run[window]["gaps"]
            out[f"long_prompt_running_ttft_p99_s_{name}_{window}"] = run[window]["ttft_s"]["p99"]
            out[f"long_prompt_running_ttft_max_s_{name}_{window}"] = run[window]["ttft_s"]["max"]
        out[f"long_prompt_itl_p99_ratio_{name}"] = _ratio(out[f"long_prompt_itl_p99_s_{name}_with_long"],
                                                          out[f"long_prompt_itl_p99_s_{name}_without_long"])
        out[f"long_prompt_ttft_s_{name}"] = run["long_prompt"]["ttft_s"] if run["long_prompt"]["ok"] else None
        out[f"long_prompt_latency_s_{name}"] = run["long_prompt"]["latency_s"]
        out[f"long_prompt_running_failed_{name}"] = run["running_failed"]
        out[f"long_prompt_kernel_compiles_{name}"] = run.get("metrics", {}).get("dllm_kernel_compiles_total")
    return out


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_workload(workload: str, runs: dict) -> str:
    lines = [f"== {workload} =="]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"{name:>10}: {run['error'].splitlines()[0]}")
        elif workload == "conversations":
            if "alone" in run:
                a = run["alone"]["stats"]
                lines.append(f"{name:>10}: one chat alone, TTFT turns 2.. mean {_fmt(a['ttft_s']['mean'])} p50 "
                             f"{_fmt(a['ttft_s']['p50'])} s; later turns' hit rate {_fmt(a['hit_rate_later_turns'])}")
            s = run["stats"]
            lines.append(f"{name:>10}: TTFT turns 2.. mean {_fmt(s['ttft_s']['mean'])} p50 {_fmt(s['ttft_s']['p50'])} "
                         f"p99 {_fmt(s['ttft_s']['p99'])} s; prompt {s['prompt_tokens']} cached {s['cached_tokens']} "
                         f"hit rate {_fmt(s['hit_rate'])} (later turns {_fmt(s['hit_rate_later_turns'])}, prompts' "
                         f"page bound {_fmt(s['prefix_bound_rate'])}); wall {s['wall_s']:.1f} s; failed {s['failed']}")
        else:
            w, lo = run["with_long"], run["without_long"]
            lines.append(f"{name:>10}: ITL p50/p99 without {_fmt(lo['itl_s']['p50'])}/{_fmt(lo['itl_s']['p99'])} s "
                         f"({lo['gaps']} gaps), with {_fmt(w['itl_s']['p50'])}/{_fmt(w['itl_s']['p99'])} s "
                         f"(max {_fmt(w['itl_s']['max'])}, {w['gaps']} gaps); running requests' TTFT max without "
                         f"{_fmt(lo['ttft_s']['max'])} s ({lo['started']}), with {_fmt(w['ttft_s']['max'])} s "
                         f"({w['started']}); long prompt TTFT "
                         f"{_fmt(run['long_prompt']['ttft_s'])} s; running failed {run['running_failed']}")
    return "\n".join(lines)


def _terminate(signum, frame):
    raise KeyboardInterrupt   # the servers are stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    start = time.monotonic()
    result, interrupted = new_result(args), False
    try:
        measure(args, result)
    except KeyboardInterrupt:   # what the servers that ended measured is still saved
        print("interrupted: the servers are stopped", file=sys.stderr)
        interrupted = True
    result["wall_s"] = time.monotonic() - start
    got = figures(result)
    for key in ("conversations_alone_ttft_mean_cached_over_uncached", "conversations_ttft_mean_cached_over_uncached",
                "long_prompt_itl_p99_ratio_chunked",
                "long_prompt_itl_p99_ratio_unchunked"):
        if key in got:
            print(f"{key}: {_fmt(got[key])}")
    print(f"took {result['wall_s']:.0f} s")
    if args.save_result is not None:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(json_safe(result), indent=1, allow_nan=False, default=str))
        print(f"Results: {args.save_result}")
    if args.results_dir is not None and any(v is not None for v in got.values()):
        sizes = []
        if "conversations" in workloads(args):
            sizes.append(f"one chat alone x {args.alone_turns} turns, then "
                         f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} "
                         f"tokens, user turns {args.user_tokens}, answers {args.max_completion_tokens}")
        if "long-prompt" in workloads(args):
            sizes.append(f"{args.running} running x {args.running_max_tokens} tokens, long prompt "
                         f"{args.long_prompt_tokens} tokens, windows of {args.window_s:g} s")
        results.write(got, "cache_bench", results_dir=args.results_dir,
                      note=f"model {Path(args.model).name}; " + "; ".join(sizes)
                      + ("; stopped midway: the servers that ended" if interrupted else ""))
    if interrupted:
        return 130
    failed = any("error" in run for runs in result["workloads"].values() for run in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
