"""Structured output's cost in steps, on the engine (docs/spec.md 12).

    python -m benchmarks.grammar_steps [--model DIR] [--requests 8] [--max-tokens 64] [--save-result]

For the default model (which writes words) and each way it decodes (diffusion under each reveal policy, AR,
linear speculation),
`--requests` requests at once with a JSON schema and the same requests without (greedy where the schema lets
the model choose; 8 denoising steps a canvas, where the policy follows N): tokens a denoising step (AR: a
token a step by definition, so only its time; linear speculation: tokens a verify), and milliseconds a
committed token. Then the batch-isolation
cost: unconstrained requests' committed tok/s beside constrained neighbours over beside the same neighbours
unconstrained (the target on a GPU: >= 0.95). On a CPU the step's compute dominates the host's checks; the
GPU rows come from the served seed workload with a schema (`make bench`).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import results
from model.checkpoint import Checkpoint
from model.grammar.compile import GrammarRequest, check_grammar
from model.grammar.tokenizer import grammar_tokenizer
from model.sampling.params import DecodeParams, Grammar
from workers.engine import Engine

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "model" / "checkpoints" / "tiny-docstrings"
SCHEMA = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 200},
                                           "args": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "maxItems": 4},
                                           "returns": {"type": "string", "maxLength": 60}},
          "required": ["summary", "args", "returns"], "additionalProperties": False}
PROMPTS = ("Return the number of items in the", "Explain os.path.join.", "What does json.dumps do?",
           "Open the file and", "Tell me about collections.OrderedDict, please.", "Split the string at",
           "Raise an error if the", "How do I use itertools.chain?")
WAYS = (("diffusion", "threshold"), ("diffusion", "low_confidence"), ("diffusion", "leftmost"),
        ("diffusion", "entropy_bound"), ("ar", "threshold"), ("linear_spec", "threshold"))


def run(engine: Engine, prompts: list[list[int]], params: list[DecodeParams]) -> tuple[list, float]:
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    return done, time.perf_counter() - start


def measure(model_dir: Path, requests: int, max_tokens: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    cfg = Checkpoint.read(str(model_dir)).config
    grammar = Grammar(text=check_grammar(GrammarRequest("json_schema", SCHEMA, "response_format"),
                                         grammar_tokenizer(model_dir, cfg.vocab_size, cfg.eos_token_ids)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(requests)]
    figures: dict[str, float] = {}
    with Engine(str(model_dir), num_slots=2 * requests, max_model_len=1024) as engine:
        for mode, policy in WAYS:
            name = policy if mode == "diffusion" else mode
            for label, g in (("free", None), ("json", grammar)):
                params = [DecodeParams(mode=mode, policy=policy, temperature=0, max_tokens=max_tokens, ignore_eos=g is None,
                                       max_denoising_steps=8, grammar=g) for _ in prompts]
                done, seconds = run(engine, prompts, params)
                tokens = sum(len(r.output) for r in done)
                steps = sum(r.denoising_steps for r in done)
                if mode != "ar":   # linear speculation: a draft counts as a denoising step, so tokens a verify
                    figures[f"grammar.{name}.tokens_per_step.{label}"] = tokens / steps
                figures[f"grammar.{name}.ms_per_token.{label}"] = 1e3 * seconds / tokens
        # batch isolation: the same unconstrained requests beside neighbours constrained or not
        free = [DecodeParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
        rates = {}
        for label, g in (("free", None), ("json", grammar)):
            neighbours = [DecodeParams(temperature=0, max_tokens=max_tokens, ignore_eos=g is None, grammar=g)
                          for _ in prompts]
            done, seconds = run(engine, prompts + prompts, free + neighbours)
            rates[label] = sum(len(r.output) for r in done[:requests]) / seconds
        figures["grammar.neighbours_tok_s_ratio"] = rates["json"] / rates["free"]
    return figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--save-result", action="store_true", help="write a result file (benchmarks/results.py)")
    p.add_argument("--results-dir", type=Path, default=results.DEFAULT_DIR)
    args = p.parse_args(argv)
    figures = measure(args.model, args.requests, args.max_tokens)
    for name, value in figures.items():
        print(f"{name:48s} {value:10.3f}")
    if args.save_result:
        results.write(figures, "grammar_steps", results_dir=args.results_dir)
    return figures


if __name__ == "__main__":
    main()
