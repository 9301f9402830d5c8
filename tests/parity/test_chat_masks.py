"""Which tokens a chat or preference record trains, against transformers and TRL: a template
with {% generation %} blocks masks exactly what transformers' return_assistant_tokens_mask
marks (a ChatML-style training template written here, and TRL's own qwen2_5_training.jinja
when trl is installed); Llama 3 without blocks equals TRL's llama3_training.jinja; DPO
completions are TRL's DPOTrainer's (to the end of the rendering, the newline after
<|im_end|> included); chosen == rejected is a counted bad record."""

import importlib.resources
import json
import types

import numpy as np
import pytest

from jaxtrain.commands import prepare as prepare_cmd
from jaxtrain.prepare import bpe, chat, chat_template, preference
from jaxtrain.prepare import pipeline as P

transformers = pytest.importorskip("transformers")

CHATML = chat_template.SHIPPED / "chatml.jinja"
# ChatML with the assistant's turn in a generation block, as TRL's Qwen training template
# writes it: the newline after the role, the reply, <|im_end|> and the newline after it.
CHATML_TRAINING = """{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- generation %}{{- '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
# Llama 3's turns (TRL's llama3.jinja, without its bos_token)
LLAMA3 = """{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4, of course.\n"}],
    [{"role": "user", "content": "Name a colour. ünï 🙂"},
     {"role": "assistant", "content": "Blue 🙂."}],
]


def _trl_template(name):
    trl = pytest.importorskip("trl")
    return (importlib.resources.files(trl) / "chat_templates" / name).read_text()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(ours, transformers') of one byte-level BPE trained here, ChatML's and Llama 3's
    markers special tokens (rendering must read them as such)."""
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + [
        "user assistant system You are Qwen, created by Alibaba Cloud."]
    tokenizer = bpe.train_bpe(texts, 300)
    tokenizer.backend.add_special_tokens(SPECIAL)
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    return (P.tokenizers_lib.load_tokenizer(str(directory)),
            transformers.PreTrainedTokenizerFast.from_pretrained(str(directory)))


def _theirs(tokenizer, messages, source):
    out = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("which", ["chatml_training", "trl_qwen2_5_training"])
def test_generation_blocks_mask_what_transformers_marks(tokenizers, which):
    ours, theirs = tokenizers
    source = (CHATML_TRAINING if which == "chatml_training"
              else _trl_template("qwen2_5_training.jinja"))
    spec = chat.ChatSpec(chat_template.ChatTemplate(source, eos_token="<|im_end|>"))
    assert spec.template.has_generation
    for messages in CONVERSATIONS:
        ids, mask, _ = chat.encode({"messages": messages}, spec, ours)
        want_ids, want_mask = _theirs(theirs, messages, source)
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask
        # two tokens a turn more than the shipped ChatML: the newline after the role, and
        # the one after <|im_end|>
        plain, plain_mask, _ = chat.encode(
            {"messages": messages}, chat.ChatSpec(chat_template.ChatTemplate(
                CHATML.read_text())), ours)
        turns = sum(m["role"] == "assistant" for m in messages)
        assert int(mask.sum()) == int(plain_mask.sum()) + 2 * turns
        if which == "chatml_training":  # the same text as the shipped template
            assert ids.tolist() == plain.tolist()


def test_llama3_without_blocks_masks_as_trls_training_template(tokenizers):
    ours, theirs = tokenizers
    training = _trl_template("llama3_training.jinja").replace("{{- bos_token }}", "")
    spec = chat.ChatSpec(chat_template.ChatTemplate(LLAMA3))
    assert not spec.template.has_generation
    for messages in CONVERSATIONS:
        ids, mask, _ = chat.encode({"messages": messages}, spec, ours)
        want_ids, want_mask = _theirs(theirs, messages, training)
        assert ids.tolist() == want_ids and mask.tolist() == want_mask


def test_dpo_completions_are_trls(tokenizers):
    """TRL's DPOTrainer tokenizes the prompt with its generation prompt and the prompt with
    each reply; the completion is every token after their common prefix."""
    datasets = pytest.importorskip("datasets")
    DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer
    ours, theirs = tokenizers
    theirs.chat_template = CHATML.read_text()
    prompts = [[{"role": "user", "content": "Say yes."}], CONVERSATIONS[0][:4]]
    rows = [{"prompt": p, "chosen": [{"role": "assistant", "content": "Yes. ünï 🙂"}],
             "rejected": [{"role": "assistant", "content": "No."}]} for p in prompts]
    stub = types.SimpleNamespace(_tokenizer=theirs)  # all _prepare_dataset reads of self
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None,
                                 truncation_mode="keep_start")
    want = DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list(rows), theirs, args,
                                       "train")
    spec = chat.ChatSpec(chat_template.ChatTemplate(CHATML.read_text()), preference=True)
    for row, trl_row in zip(rows, want):
        documents, _ = preference.encode_pair(
            {"messages": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]},
            spec, ours)
        for (ids, mask), key in zip(documents, ("chosen_ids", "rejected_ids")):
            prompt, completion = trl_row["prompt_ids"], trl_row[key]
            assert ids.tolist() == prompt + completion
            assert mask.tolist() == [0] * len(prompt) + [1] * len(completion)
            assert theirs.decode(completion).endswith("<|im_end|>\n")


def test_a_pair_whose_replies_are_equal_is_a_bad_record(tmp_path, capsys):
    records = [{"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."},
               {"prompt": "Say yes.", "chosen": "Yes.", "rejected": "Yes."},
               {"prompt": "Hi", "chosen": "Hello.",
                "rejected": [{"role": "assistant", "content": "Hello."}]}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prepare_cmd.main([str(data), "--preference", "--chat-template", "chatml",
                             "--tokenizer", "bytes", "--no-progress", "--processes", "1",
                             "--max-bad-fraction", "1", "--out", str(tmp_path / "d")]) == 0
    assert f"skipped 2 same replies (first: {data}:2" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["num_documents"] == 2


def test_a_generation_template_marking_nothing_is_a_bad_record(tokenizers):
    ours, _ = tokenizers
    source = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% generation %}{% endgeneration %}"
    spec = chat.ChatSpec(chat_template.ChatTemplate(source))
    with pytest.raises(chat.BadRecord, match="no_assistant"):
        chat.encode({"messages": CONVERSATIONS[1]}, spec, ours)
    assert np.all(chat.encode({"messages": CONVERSATIONS[1]},
                              chat.ChatSpec(spec.template, train_on="all"), ours)[1] == 1)
