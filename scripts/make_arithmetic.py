"""The worked example of docs/finetune.md (GRPO): sums of small numbers in a fixed format.

    python scripts/make_arithmetic.py --out arith            # writes the data below
    python scripts/make_arithmetic.py --score OUT.jsonl --answers arith/heldout.jsonl

writes OUT/sft.txt (lines "a+b=c": what a tiny model learns the format, and some of the
sums, from), OUT/rl.jsonl (prompts "a+b=" with an `answer` column: the GRPO prompt set's
records), OUT/heldout.jsonl (other sums, never trained on) and OUT/raw.jinja (a chat
template that renders a prompt as its bare text, for prepare --prompts). --score reads
`jaxtrain generate --prompts` output and prints the exact-match accuracy of the held-out
answers (a completion's first number).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re

RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _split(largest: int, heldout: int, seed: int):
    sums = [(a, b) for a in range(largest + 1) for b in range(largest + 1)]
    random.Random(seed).shuffle(sums)
    return sums[heldout:], sums[:heldout]


def write(out: pathlib.Path, largest: int, heldout: int, sft_lines: int, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, held = _split(largest, heldout, seed)
    rng = random.Random(seed + 1)
    (out / "sft.txt").write_text("".join(
        f"{a}+{b}={a + b}\n" for a, b in (rng.choice(train) for _ in range(sft_lines))))
    for name, pairs in (("rl.jsonl", train), ("heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)})
                                        + "\n" for a, b in pairs))
    (out / "raw.jinja").write_text(RAW_TEMPLATE)
    print(f"{len(train)} training sums, {len(held)} held out -> {out}")


def score(generated: pathlib.Path, answers: pathlib.Path) -> float:
    """Exact-match accuracy: each prompt's first sample, its first number."""
    truth = [json.loads(line)["answer"] for line in answers.read_text().splitlines()]
    first = {}
    for line in generated.read_text().splitlines():
        row = json.loads(line)
        first.setdefault(row["prompt_index"], row.get("text") or "")
    right = 0
    for index, answer in enumerate(truth):
        found = re.match(r"\s*(\d+)", first.get(index, ""))
        right += bool(found) and found.group(1) == answer
    return right / len(truth)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--largest", type=int, default=49, help="summands in [0, largest]")
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--sft-lines", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score", type=pathlib.Path, help="generate --prompts output to score")
    p.add_argument("--answers", type=pathlib.Path, help="the held-out records")
    args = p.parse_args()
    if args.score:
        print(f"exact match {score(args.score, args.answers):.3f}")
    else:
        write(args.out, args.largest, args.heldout, args.sft_lines, args.seed)


if __name__ == "__main__":
    main()
