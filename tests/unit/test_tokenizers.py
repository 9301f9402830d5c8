"""Tokenizers: the field's libraries behind one interface, saved and exported with the same ids."""

import pathlib
import sysconfig

import numpy as np
import pytest

from jaxtrain.data import tokenizers as T
from jaxtrain.errors import DataError
from jaxtrain.prepare.bpe import train_bpe

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld 🙂 — naïve café",
         "  two  spaces\tand a tab\n\n", "日本語のテキスト", "x" * 300]


def _corpus() -> list[str]:
    """A few standard library modules: plain code and prose that stays put while this
    repository changes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py",
             "textwrap.py", "string.py", "csv.py", "bisect.py", "colorsys.py", "keyword.py"]
    return [(root / name).read_text() for name in names]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(_corpus(), 400)


def _same_ids_through_auto_tokenizer(tokenizer, directory):
    from transformers import AutoTokenizer

    tokenizer.save_hf(directory)
    auto = AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS + [T.PROBE_TEXT]:
        ids = tokenizer.encode(text)
        assert auto(text, add_special_tokens=False)["input_ids"] == ids, text
        assert auto.decode(ids) == tokenizer.decode(ids)
    if tokenizer.eos_id is not None:
        assert auto.eos_token_id == tokenizer.eos_id
    return auto


def _round_trip(tokenizer, directory):
    saved = tokenizer.save(directory)
    back = T.load_tokenizer(saved)
    assert back.fingerprint() == tokenizer.fingerprint()
    assert (back.vocab_size, back.eos_id, back.bos_id) == (tokenizer.vocab_size,
                                                           tokenizer.eos_id, tokenizer.bos_id)
    for text in TEXTS:
        assert back.encode(text) == tokenizer.encode(text)
    return back


def test_bytes_are_the_identity_and_export_as_such(tmp_path):
    tok = T.load_tokenizer("bytes")
    for text in TEXTS:
        assert tok.encode(text) == list(text.encode())
        assert tok.decode(tok.encode(text)) == text
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [list(t.encode()) for t in TEXTS]
    _round_trip(tok, tmp_path / "saved")
    _same_ids_through_auto_tokenizer(tok, tmp_path / "hf")


def test_trained_bpe_is_deterministic_and_round_trips(bpe, tmp_path):
    assert bpe.vocab_size == 400 and bpe.eos_id == 0
    assert train_bpe(_corpus(), 400).fingerprint() == bpe.fingerprint()
    assert train_bpe(_corpus()[1:], 400).fingerprint() != bpe.fingerprint()
    for text in TEXTS:
        assert bpe.decode(bpe.encode(text)) == text
    code = "".join(_corpus())
    assert len(bpe.encode(code)) < 0.6 * len(code.encode())  # it learned merges
    batch = bpe.encode_batch(TEXTS)
    assert [b.tolist() for b in batch] == [bpe.encode(t) for t in TEXTS]
    _round_trip(bpe, tmp_path / "saved")
    _same_ids_through_auto_tokenizer(bpe, tmp_path / "hf")


def test_bytes_per_token_are_real_byte_counts(bpe):
    for text in _corpus()[:20] + TEXTS:
        assert bpe.token_bytes()[bpe.encode(text)].sum() == len(text.encode())
    assert bpe.token_bytes()[bpe.eos_id] == 0
    assert bpe.eos_id not in bpe.encode("a <|endoftext|> in the text is text")


def test_model_directories_load_through_their_tokenizer_files(bpe, tmp_path):
    from transformers import PreTrainedTokenizerFast

    # A directory with tokenizer.json and tokenizer_config.json naming the EOS.
    hf_dir = tmp_path / "with_json"
    PreTrainedTokenizerFast(tokenizer_object=bpe.backend, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(hf_dir)
    loaded = T.load_tokenizer(hf_dir)
    assert loaded.encode(TEXTS[0]) == bpe.encode(TEXTS[0])
    assert (loaded.eos_id, loaded.bos_id) == (0, 0)
    # GPT-2's layout: vocab.json + merges.txt and no tokenizer.json (transformers builds it).
    from transformers import GPT2Tokenizer

    vocab_dir = tmp_path / "vocab_merges"
    vocab_dir.mkdir()
    bpe.backend.model.save(str(vocab_dir))
    GPT2Tokenizer(str(vocab_dir / "vocab.json"), str(vocab_dir / "merges.txt"),
                  eos_token="<|endoftext|>").save_pretrained(vocab_dir)
    (vocab_dir / "tokenizer.json").unlink(missing_ok=True)
    auto = T.load_tokenizer(vocab_dir)
    for text in TEXTS:
        assert auto.encode(text) == bpe.encode(text)
    assert auto.eos_id == 0


def test_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("\n".join(_corpus()))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"),
                                   model_prefix=str(tmp_path / "sp"), vocab_size=600,
                                   byte_fallback=True, minloglevel=2)
    tok = T.load_tokenizer(tmp_path / "sp.model")
    assert tok.kind == "sentencepiece" and tok.vocab_size == 600
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.decode(tok.encode("def f(x): return 1")) == "def f(x): return 1"
    back = _round_trip(tok, tmp_path / "saved")
    assert back.kind == "sentencepiece"
    _same_ids_through_auto_tokenizer(tok, tmp_path / "hf")


def _tiny_tiktoken():
    pytest.importorskip("tiktoken")
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {bytes([i]): i for i in range(256)}
    for merged in (b"  ", b"in", b" t", b"re", b"de", b"def", b"    "):
        ranks[merged] = len(ranks)
    return T.TiktokenTokenizer.from_parts("tiny", r50k_pat_str, ranks,
                                          {"<|endoftext|>": len(ranks)})


def test_tiktoken_saves_and_exports(tmp_path):
    tok = _tiny_tiktoken()
    assert tok.encode("def") == [261]
    assert tok.eos_id == tok.vocab_size - 1
    assert tok.token_bytes()[tok.encode("  in")].sum() == 4
    back = _round_trip(tok, tmp_path / "saved")  # offline: from the saved ranks file
    assert back.kind == "tiktoken"
    _same_ids_through_auto_tokenizer(tok, tmp_path / "hf")


def test_tiktoken_offline_is_one_clear_line(tmp_path, monkeypatch):
    tiktoken_load = pytest.importorskip("tiktoken.load")
    import requests

    def no_network(*args, **kwargs):
        raise requests.exceptions.ConnectionError("no network")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken_load, "read_file", no_network)
    with pytest.raises(DataError, match=r"tiktoken:cl100k_base: its BPE file is not in "
                                        r"tiktoken's cache and cannot be downloaded") as e:
        T.load_tokenizer("tiktoken:cl100k_base")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="tiktoken:no_such_encoding"):
        T.load_tokenizer("tiktoken:no_such_encoding")


def test_bad_specs_are_one_line(tmp_path):
    with pytest.raises(DataError, match="--tokenizer=nowhere/tok.json: no such file"):
        T.load_tokenizer("nowhere/tok.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="not a readable tokenizer.json"):
        T.load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(DataError, match="at least 257 ids"):
        train_bpe(["abc"], 100)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(DataError, match="no tokenizer found there"):
        T.load_tokenizer(empty)


def test_export_refuses_a_tokenizer_it_cannot_reproduce(bpe, tmp_path, monkeypatch):
    monkeypatch.setattr(type(bpe), "encode", lambda self, text: [1, 2, 3])
    with pytest.raises(DataError, match="encodes differently"):
        bpe.save_hf(tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    np.testing.assert_array_equal(T.ByteTokenizer().token_bytes(), np.ones(256))
