"""A small instruction set made from the built-in corpus, no download (docs/finetune.md):
docstring -> function chats for SFT, and preference pairs (the real function against a
corrupted one) for DPO.

    python scripts/make_instructions.py --out data/instructions [--max-chars 240]

Writes OUT/sft.jsonl ({"messages": [user, assistant]}), OUT/preference.jsonl ({"prompt",
"chosen", "rejected"}) and OUT/chat_template.jinja, a chat template in comment lines
(`# user`, `# assistant`, `# end`) that the stdlib BPE spells in 3-6 tokens each, where
ChatML's markers take 8-19 (a pair's row has room for little else at seq_len 128); the
records are in a fixed order shuffled by --seed, so that the prepared dataset's
held-out tail (data.val_fraction) is a random sample of functions. A function qualifies when
it is a module-level `def` with a docstring, its source without the docstring is at most
--max-chars characters and the docstring's first paragraph half that (a chat must fit the
model's row); a preference pair, whose row holds the prompt twice and both replies, when
its prompt and longer reply are at most 3/4 of --max-chars together. The user turn asks for the
function by its signature and the docstring's first paragraph; the reply is its source
without the docstring. The corrupted reply keeps the signature and reverses the order of the
body's statements (or, for a one-statement body, returns None instead): code that reads like
the real thing and is wrong.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import random
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxtrain.data.stdlib import stdlib_files  # noqa: E402 - after the path fix above


def _functions(path: pathlib.Path):
    """(name, signature line, first docstring paragraph, source without the docstring, body
    statements' sources) of the module-level functions with a docstring."""
    try:
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old stdlib files
            tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2:
            continue
        header = "\n".join(lines[node.lineno - 1:node.body[0].lineno - 1]).rstrip()
        statements = ["\n".join(lines[s.lineno - 1:s.end_lineno]) for s in node.body[1:]]
        yield node.name, header, " ".join(doc.split("\n\n")[0].split()), statements


def _corrupted(header: str, statements: list[str]) -> str:
    if len(statements) > 1:
        return "\n".join([header, *reversed(statements)])
    body = statements[0]
    indent = body[:len(body) - len(body.lstrip())]
    return "\n".join([header, f"{indent}return None"])


def make(max_chars: int, seed: int) -> tuple[list[dict], list[dict]]:
    chats, pairs = [], []
    for path in stdlib_files():
        if "test" in path.parts or path.name.startswith("test_"):
            continue
        for name, header, doc, statements in _functions(path):
            reply = "\n".join([header, *statements])
            if len(reply) > max_chars or len(doc) > max_chars // 2 or "\t" in reply:
                continue
            prompt = f"Write the Python function `{name}`: {doc}"
            chats.append({"messages": [{"role": "user", "content": prompt},
                                       {"role": "assistant", "content": reply}]})
            rejected = _corrupted(header, statements)
            # A pair's row holds the prompt twice and both replies: the short ones.
            if len(prompt) + max(len(reply), len(rejected)) <= max_chars * 3 // 4:
                pairs.append({"prompt": prompt, "chosen": reply, "rejected": rejected})
    random.Random(seed).shuffle(chats)
    random.Random(seed).shuffle(pairs)
    return chats, pairs


# Each turn: "# ROLE", its content, "# end" (the end-of-turn marker the loss mask keeps).
TEMPLATE = """{%- for message in messages %}
{{- '# ' + message['role'] + '\\n' + message['content'] + '\\n# end\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '# assistant\\n' }}
{%- endif %}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--max-chars", type=int, default=240,
                        help="longest function source (without its docstring) to take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats, pairs = make(args.max_chars, args.seed)
    for name, rows in (("sft.jsonl", chats), ("preference.jsonl", pairs)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    print(f"{len(chats)} chats -> {out / 'sft.jsonl'}, {len(pairs)} preference pairs -> "
          f"{out / 'preference.jsonl'}")


if __name__ == "__main__":
    main()
