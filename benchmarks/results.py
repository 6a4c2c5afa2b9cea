"""Measured figures as files, and the docs' tables rendered from them.

A benchmark run writes one JSON file to benchmarks/results/ (`--results-dir`), named
`<date>-<commit>-<card>-<tool>.json`: the card and the commit it measured, the date, the command, and its
figures keyed by stable names (the unit in the name). The docs never state a figure in prose:
`python -m benchmarks.results render` rewrites every table between `<!-- results:NAME -->` and
`<!-- /results:NAME -->` in README.md and docs/*.md (benchmarks/result_tables.py says what each holds),
each row from the newest file that holds its figures; `check` lists the docs that differ from that.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
# where a benchmark writes by default: $OUT where set (what the GPU host hands back), else RESULTS
DEFAULT_DIR = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
FIGURE = re.compile(r"^[A-Za-z0-9_.+-]+$")
FILE = re.compile(r"^(?P<date>\d{4}-\d\d-\d\d)-(?P<commit>[0-9a-f]{7,40}(?:-dirty)?|unknown)-(?P<card>[a-z0-9]+)"
                  r"-(?P<tool>[a-z0-9_]+)(?:-(?P<n>\d+))?\.json$")
# a marked table: its markers each on a line of their own
MARKED = re.compile(r"^(?P<open><!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"^(?P<close><!-- /results:(?P=name) -->)$", re.DOTALL | re.MULTILINE)


class Result(BaseModel):
    """One benchmark run's figures."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    card: str = Field(min_length=1, description="the device measured, as the driver names it; a CPU run: "
                                                "'CPU (N cores)'")
    commit: str = Field(pattern=r"^([0-9a-f]{7,40}(\+dirty)?|unknown)$", description="the code measured")
    date: datetime.date
    command: str = Field(min_length=1, description="what produced the figures")
    note: str = ""
    figures: dict[str, float] = Field(min_length=1, description="stable name -> value, the unit in the name")

    @field_validator("figures")
    @classmethod
    def _named_and_finite(cls, figures: dict[str, float]) -> dict[str, float]:
        for name, value in figures.items():
            if not FIGURE.match(name) or not math.isfinite(value):
                raise ValueError(f"figure {name!r} = {value!r}: names are [A-Za-z0-9_.+-], values finite")
        return figures


def card_slug(card: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; without a model number its first word: 'CPU (2 cores)' -> 'cpu'."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", card)
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]", "", card.split()[0].lower()) or "card"


def file_name(result: Result, tool: str) -> str:
    return f"{result.date}-{result.commit.replace('+', '-')}-{card_slug(result.card)}-{tool}.json"


def this_card() -> str:
    """This machine's first GPU as nvidia-smi names it (no torch import), else its CPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"CPU ({os.cpu_count()} cores)"


def directory(text: str) -> Path | None:
    """A --results-dir argument: '' writes no result file."""
    return Path(text) if text else None


def write(figures: dict[str, float | None], tool: str, *, card: str | None = None, commit: str | None = None,
          command: str | None = None, results_dir: Path = RESULTS, note: str = "") -> Path:
    """Writes a result file (never over another: a second run of the day gets -2, -3, ...); figures that
    are None or not finite are left out. The commit defaults to this checkout's."""
    if commit is None:
        from benchmarks.server_process import tree_commit

        commit = tree_commit(REPO)
    result = Result(card=card or this_card(), commit=commit or "unknown", date=datetime.date.today(),
                    command=command or " ".join(["python3", "-m", f"benchmarks.{tool}", *sys.argv[1:]]), note=note,
                    figures={k: float(v) for k, v in figures.items()
                             if isinstance(v, (int, float)) and math.isfinite(v)})
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = file_name(result, tool)[:-len(".json")]
    path, n = results_dir / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = results_dir / f"{stem}-{n}.json"
    path.write_text(result.model_dump_json(indent=1) + "\n")
    print(f"Result file: {path}")
    return path


def load(results_dir: Path = RESULTS) -> dict[str, Result]:
    """file name -> its result, every file of the directory (a file that does not parse raises)."""
    return {p.name: Result.model_validate_json(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


# ---- tables --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """A table row: `keys`' figures, all from one file (the newest holding them, on `card` if given,
    a case-insensitive part of the card's name), each formatted by `fmt`, joined by ' / '."""
    label: str
    keys: tuple[str, ...]
    fmt: str = ".4g"
    target: str = ""
    card: str | None = None


@dataclass(frozen=True)
class Table:
    """`head` heads the label column; with `columns`, each of a row's figures has its own column."""
    head: str
    rows: tuple[Row, ...]
    columns: tuple[str, ...] = ()


def newest(results: dict[str, Result], keys: tuple[str, ...], card: str | None) -> Result | None:
    held = [(r.date, name, r) for name, r in results.items()
            if all(k in r.figures for k in keys) and (card is None or card.lower() in r.card.lower())]
    return max(held, key=lambda t: t[:2])[2] if held else None


def short_card(card: str) -> str:
    return card.removeprefix("NVIDIA ").strip()


def render_table(table: Table, results: dict[str, Result]) -> str:
    targets = any(row.target for row in table.rows)
    head = [table.head, *(table.columns or ["measured"]), *(["target"] if targets else []), "card", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table.rows:
        assert not table.columns or len(row.keys) == len(table.columns), (table.head, row.label)
        r = newest(results, row.keys, row.card)
        values = ["-"] * len(row.keys) if r is None else [format(r.figures[k], row.fmt) for k in row.keys]
        if not table.columns:
            values = ["not measured" if r is None else " / ".join(values)]
        cells = [row.label, *values, *([row.target] if targets else []),
                 "" if r is None else short_card(r.card), "" if r is None else r.commit]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_text(text: str, tables: dict[str, Table], results: dict[str, Result]) -> str:
    def one(m: re.Match) -> str:
        if m["name"] not in tables:
            raise KeyError(f"<!-- results:{m['name']} --> names no table of benchmarks/result_tables.py")
        return m["open"] + render_table(tables[m["name"]], results) + m["close"]
    return MARKED.sub(one, text)


def docs(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def stale(repo: Path = REPO, results_dir: Path = RESULTS) -> list[Path]:
    """The docs whose tables differ from what `render` would write now."""
    from benchmarks.result_tables import TABLES

    results = load(results_dir)
    return [p for p in docs(repo) if render_text(p.read_text(), TABLES, results) != p.read_text()]


def render(repo: Path = REPO, results_dir: Path = RESULTS) -> list[Path]:
    """Rewrites the docs whose tables are stale; returns them."""
    from benchmarks.result_tables import TABLES

    results = load(results_dir)
    changed = []
    for path in docs(repo):
        text = path.read_text()
        new = render_text(text, TABLES, results)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["render", "check"])
    args = p.parse_args(argv)
    if args.action == "render":
        for path in render():
            print(f"rendered {path.relative_to(REPO)}")
        return 0
    bad = stale()
    for path in bad:
        print(f"{path.relative_to(REPO)}: its tables differ from the result files; run "
              "`python -m benchmarks.results render`")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
