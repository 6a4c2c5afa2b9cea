"""Per-request options drawn from a distribution: traffic as users send it, not one option set for all.

A mix is a JSON-lines file, one kind of request per line: its `weight`, `prompt_len` and `max_tokens`
(required) and any request field (dotted for a nested one: `diffusion.mode`), each a constant, a
{"choice": [...]} or a {"uniform": [lo, hi]} (docs/benchmarking.md has the grammar). Draws depend only
on the seed. The built-in mixes, NAMES, carry every option a user may send to each family:
`python -m benchmarks.request_mix nemotron-ld` prints one as JSON lines, to copy and edit.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The options the observation varied: prompts of 16-300 tokens, 32-128 new tokens, temperature
# 0/0.7/1, top_k 0/1/5/17/40/100/random below 500, top_p 1/0.9/0.5, logprobs none/0/1/2/5/20.
_COMMON = {
    "prompt_len": {"uniform": [16, 300]},
    "max_tokens": {"uniform": [32, 128]},
    "temperature": {"choice": [0, 0.7, 1]},
    "top_k": {"choice": [0, 1, 5, 17, 40, 100, {"uniform": [1, 499]}]},
    "top_p": {"choice": [1, 0.9, 0.5]},
    "logprobs": {"choice": [None, 0, 1, 2, 5, 20]},
}
BUILTIN = {
    # Nemotron-LD also draws the reveal policy and the mode (linear_spec, greedy only, is left out)
    "nemotron-ld": [_COMMON | {"diffusion.policy": {"choice": ["threshold", "low_confidence", "leftmost",
                                                                "entropy_bound"]},
                               "diffusion.mode": {"choice": ["diffusion", "ar"]}}],
    # DiffusionGemma has one mode (diffusion) and its own acceptance rule: the sampling options only
    "diffusion-gemma": [_COMMON],
}
NAMES = tuple(BUILTIN)
# set by the client for every request, never by a mix
RESERVED = {"model", "prompt", "messages", "stream", "stream_options"}
DISTRIBUTIONS = ("choice", "uniform")


class MixError(ValueError):
    """A mix file (or line) that cannot be drawn from; the message names the line."""


@dataclass(frozen=True)
class Draw:
    """One request's share of the mix: its prompt length, max_tokens and other body fields."""

    prompt_len: int
    max_tokens: int
    options: dict      # nested like the request body: {"temperature": 0.7, "diffusion": {"mode": "ar"}}


@dataclass(frozen=True)
class Mix:
    source: str        # a built-in name or the file's path
    lines: list[dict]  # as written (checked)

    def draw(self, n: int, rng: np.random.Generator) -> list[Draw]:
        weights = np.array([line.get("weight", 1) for line in self.lines], dtype=float)
        picks = rng.choice(len(self.lines), size=n, p=weights / weights.sum())
        return [_draw_line(self.lines[i], rng) for i in picks]

    def describe(self) -> str:
        return f"mix {self.source} ({len(self.lines)} line{'s' * (len(self.lines) != 1)})"


def load_mix(spec: str) -> Mix:
    """A built-in mix by name, else the JSON-lines file at that path."""
    if spec in BUILTIN:
        return Mix(spec, [check_line(line, f"built-in mix {spec!r} line {i}")
                          for i, line in enumerate(BUILTIN[spec], 1)])
    path = Path(spec)
    if not path.is_file():
        raise MixError(f"no mix named {spec!r}: neither a built-in ({', '.join(NAMES)}) nor a file")
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path} line {number}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise MixError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
        lines.append(check_line(line, where))
    if not lines:
        raise MixError(f"{path}: no lines (one JSON object per line)")
    return Mix(str(path), lines)


def check_line(line, where: str) -> dict:
    if not isinstance(line, dict):
        raise MixError(f"{where}: a line must be a JSON object, got {type(line).__name__}")
    weight = line.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise MixError(f"{where}: weight must be a number > 0, got {weight!r}")
    for key in ("prompt_len", "max_tokens"):
        if key not in line:
            raise MixError(f"{where}: {key} is required")
        _check_value(line[key], f"{where}: {key}", count=True)
    for key, value in line.items():
        if key in ("weight", "prompt_len", "max_tokens"):
            continue
        if key.split(".")[0] in RESERVED or not all(key.split(".")):
            raise MixError(f"{where}: field {key!r} cannot be drawn (the client sets {sorted(RESERVED)}; "
                           "nested fields are dotted: diffusion.mode)")
        _check_value(value, f"{where}: {key}", count=False)
    fields = [k for k in line if k not in ("weight", "prompt_len")]
    for key in fields:   # "diffusion" and "diffusion.mode" would both set the same object
        if any(other.startswith(key + ".") for other in fields):
            raise MixError(f"{where}: {key!r} and a field inside it are both given")
    return line


def _check_value(value, where: str, count: bool) -> None:
    """A constant or a distribution; `count`: every outcome a whole number >= 1."""
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in DISTRIBUTIONS:
            raise MixError(f"{where}: an object must be one of {{\"choice\": [...]}} or {{\"uniform\": [lo, hi]}}"
                           f", got {json.dumps(value)}")
        kind, arg = next(iter(value.items()))
        if kind == "choice":
            if not isinstance(arg, list) or not arg:
                raise MixError(f"{where}: choice needs a non-empty list, got {json.dumps(arg)}")
            for option in arg:
                _check_value(option, where, count)
            return
        numbers = isinstance(arg, list) and len(arg) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in arg)
        if not numbers or arg[0] > arg[1]:
            raise MixError(f"{where}: uniform needs [lo, hi] with lo <= hi, got {json.dumps(arg)}")
        if count and not (all(isinstance(x, int) for x in arg) and arg[0] >= 1):
            raise MixError(f"{where}: uniform must give whole numbers >= 1 here, got {json.dumps(arg)}")
        return
    if count and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise MixError(f"{where}: must be a whole number >= 1, got {json.dumps(value)}")


def _sample(value, rng: np.random.Generator):
    if not isinstance(value, dict):
        return value
    kind, arg = next(iter(value.items()))
    if kind == "choice":
        return _sample(arg[rng.integers(len(arg))], rng)
    lo, hi = arg
    if isinstance(lo, int) and isinstance(hi, int):
        return int(rng.integers(lo, hi + 1))
    return float(rng.uniform(lo, hi))


def _draw_line(line: dict, rng: np.random.Generator) -> Draw:
    options: dict = {}
    for key, value in line.items():
        if key in ("weight", "prompt_len", "max_tokens"):
            continue
        drawn = _sample(value, rng)
        if drawn is None:
            continue
        *parents, leaf = key.split(".")
        target = options
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = drawn
    return Draw(_sample(line["prompt_len"], rng), _sample(line["max_tokens"], rng), options)


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in BUILTIN:
        sys.exit(f"usage: python -m benchmarks.request_mix {{{','.join(NAMES)}}}  (prints it as JSON lines)")
    for line in BUILTIN[argv[0]]:
        print(json.dumps(line))


if __name__ == "__main__":
    main(sys.argv[1:])
