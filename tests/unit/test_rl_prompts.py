"""prepare --prompts (jaxtrain/prepare/prompts.py): prompt records from JSON Lines and
Parquet rendered with the chat template's generation prompt, extra columns kept for the
reward functions, bad records counted, the one-line refusals; the set feeds the rewards."""

import json

import pytest

from jaxtrain.commands import prepare as prepare_cmd
from jaxtrain.errors import DataError
from jaxtrain.prepare.chat_template import TEMPLATE_FILE
from jaxtrain.prepare.prompts import load_prompts
from jaxtrain.rl.rewards import build_rewards, score

CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def _prepare(*args):
    return prepare_cmd.main([*map(str, args), "--tokenizer", "bytes", "--chat-template",
                             "chatml", "--max-bad-fraction", "1"])


def test_prompts_are_rendered_with_the_generation_prompt_and_columns_kept(tmp_path, capsys):
    system = {"role": "system", "content": "Be brief."}
    records = [
        {"prompt": "2+2?", "answer": "4", "level": 1},
        {"messages": [system, {"role": "user", "content": "3+3?"}], "answer": "#### 6"},
        {"prompt": [{"role": "user", "content": "5+5?"}], "answer": "10"},  # TRL's form
        "not json",  # 4
        {"answer": "1"},  # 5: no prompt
        {"messages": [{"role": "robot", "content": "x"}]},  # 6
        {"prompt": "long " * 40},  # 7: over --max-length
    ]
    data = _jsonl(tmp_path / "p.jsonl", records)
    assert _prepare(data, "--prompts", "--out", tmp_path / "set", "--max-length", "100") == 0
    err = capsys.readouterr().err
    for kind, line in (("malformed json", 4), ("no messages", 5), ("unknown role", 6),
                       ("too long", 7)):
        assert f"skipped 1 {kind} (first: {data}:{line})" in err, err
    lines, manifest = load_prompts(tmp_path / "set")
    texts = [bytes(line["prompt_ids"]).decode() for line in lines]
    assert texts[0] == CHATML.format("2+2?") and texts[2] == CHATML.format("5+5?")
    assert texts[1] == "<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML.format("3+3?")
    assert [line["prompt"] for line in lines] == [
        "2+2?", records[1]["messages"], records[2]["prompt"]]
    assert lines[0]["level"] == 1 and [line["answer"] for line in lines] == ["4", "#### 6",
                                                                             "10"]
    assert manifest["kind"] == "prompts" and manifest["prompts"] == 3
    assert manifest["columns"] == ["answer", "level"]
    assert (tmp_path / "set" / "tokenizer" / TEMPLATE_FILE).read_text().startswith("{%")
    # the set feeds the reward functions: prompts and columns, one per completion
    rewards = build_rewards([{"name": "answer"}])
    values, _ = score(rewards, [line["prompt"] for line in lines],
                      [r"\boxed{4}", "#### 6", "11"], [[1]] * 3,
                      {"answer": [line["answer"] for line in lines]})
    assert values[:, 0].tolist() == [1.0, 1.0, 0.0]


def test_parquet_prompts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["hi", "yo"], "tests": [["a"], ["b", "c"]]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert _prepare(tmp_path / "p.parquet", "--prompts", "--out", tmp_path / "set") == 0
    lines, manifest = load_prompts(tmp_path / "set")
    assert [line["tests"] for line in lines] == [["a"], ["b", "c"]]
    assert bytes(lines[1]["prompt_ids"]).decode() == CHATML.format("yo")


def test_refusals_are_one_line(tmp_path, capsys):
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert _prepare(data, "--prompts", "--chat", "--out", tmp_path / "a") == 2
    assert _prepare(data, "--prompts", "--out", tmp_path / "a") == 0
    assert _prepare(data, "--prompts", "--out", tmp_path / "a") == 2  # exists
    text = tmp_path / "p.txt"
    text.write_text("x")
    assert _prepare(text, "--prompts", "--out", tmp_path / "b") == 2
    bad = _jsonl(tmp_path / "bad.jsonl", [{"x": 1}])
    assert prepare_cmd.main([str(bad), "--prompts", "--tokenizer", "bytes", "--chat-template",
                             "chatml", "--out", str(tmp_path / "c")]) == 2
    assert prepare_cmd.main([str(data), "--prompts", "--out", str(tmp_path / "d")]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(said) == 5, said
    for line, says in zip(said, ["does not go with --chat", "exists: give --overwrite",
                                 "reads JSON Lines", "records are unusable",
                                 "needs --tokenizer"]):
        assert says in line, (line, says)
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()
    with pytest.raises(DataError, match="no prompt set here"):
        load_prompts(tmp_path)
