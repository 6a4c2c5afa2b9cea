"""Generate from the command line with the in-process engine (no Ray) and print the diffusion metrics.

    python -m workers.generate MODEL_DIR "prompt" [--tp N] [--max-tokens 64] [--mode diffusion]
        [--policy threshold] [--temperature 0] [--max-denoising-steps N] [--logprobs K] [--chat]
"""
from __future__ import annotations

import argparse
import time
from typing import get_args

from model.sampling.params import DecodeParams, Mode, RevealPolicy
from workers.engine import Engine
from workers.scheduler import derived_metrics


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workers.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("prompt")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="diffusion", choices=get_args(Mode))
    p.add_argument("--policy", default="threshold", choices=get_args(RevealPolicy))
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--max-denoising-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(args.prompt).input_ids
    try:
        params = DecodeParams(mode=args.mode, policy=args.policy, temperature=args.temperature,
                              threshold=args.threshold, max_denoising_steps=args.max_denoising_steps,
                              max_tokens=args.max_tokens, seed=args.seed, logprobs=args.logprobs,
                              ignore_eos=args.ignore_eos)
    except ValueError as err:  # pydantic names the parameter
        p.error(str(err))
    max_model_len = len(ids) + args.max_tokens + 64
    with Engine(args.model_dir, tp=args.tp, num_slots=1, max_model_len=max_model_len, device=args.device,
                dtype=args.dtype) as engine:
        t = time.perf_counter()
        request, logprobs = engine.add(ids, params), []
        while not request.finished:   # the step loop of Engine.run, keeping the scores each output carries
            for out in engine.step():
                logprobs += out.new_logprobs or []
        wall = time.perf_counter() - t
        counters = engine.scheduler.counters
    print(tokenizer.decode(request.output, skip_special_tokens=True))
    print(f"\n[{len(request.output)} tokens, finish_reason={request.finish_reason}, {wall:.2f} s]")
    print(f"committed_tokens={counters.committed_tokens} denoising_steps={counters.denoising_steps} "
          f"canvas_positions={counters.canvas_positions} canvases={counters.canvases} forwards={counters.forwards} "
          f"passes={counters.passes}")
    for name, value in derived_metrics(counters, wall).items():
        print(f"{name}={'n/a' if value is None else f'{value:.3f}'}")
    if logprobs:
        print("logprobs:", [round(x, 3) for x in logprobs])


if __name__ == "__main__":
    main()
