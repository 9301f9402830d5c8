"""Tokenizers: one small interface over the field's libraries, saved with datasets and runs.

Read at train, eval, generate and export time as well as by `jaxtrain prepare`, so it lives
here rather than in the offline package. One module per kind, each with its registry entry
(base.TokenizerKind) in loading.KINDS:
- `bytes` (utf8.py): a token is a UTF-8 byte (the built-in stdlib corpus; 256 ids, no EOS).
- `huggingface` (huggingface.py): a `tokenizer.json`, or a model directory holding one (the
  `tokenizers` library); a directory with other tokenizer files goes through transformers'
  AutoTokenizer with local files only.
- `sentencepiece` (sentencepiece_model.py): a `.model`, or a directory holding
  `tokenizer.model` and no tokenizer.json.
- `tiktoken` (tiktoken_encoding.py): `tiktoken:NAME`, from tiktoken's cache or the network.
Training a BPE is offline only: jaxtrain.prepare.bpe.

A saved tokenizer is a directory: the library's own file plus `jaxtrain_tokenizer.json`
(kind, vocabulary size, EOS/BOS ids, fingerprint), so it loads back offline with the same
ids. The fingerprint is a hash of what decides the ids, not of where the files are.
"""

from jaxtrain.data.tokenizers.base import (
                                           HF_FILE,
                                           META_FILE,
                                           NO_TOKENIZER,
                                           PROBE_TEXT,
                                           SPM_FILE,
                                           TIKTOKEN_FILE,
                                           Tokenizer,
                                           TokenizerKind,
)
from jaxtrain.data.tokenizers.huggingface import HFTokenizer
from jaxtrain.data.tokenizers.loading import (
                                           KINDS,
                                           kind_of,
                                           load_recorded,
                                           load_tokenizer,
                                           read_meta,
                                           require_tokenizer_package,
)
from jaxtrain.data.tokenizers.sentencepiece_model import SentencePieceTokenizer
from jaxtrain.data.tokenizers.tiktoken_encoding import TiktokenTokenizer
from jaxtrain.data.tokenizers.utf8 import ByteTokenizer

__all__ = ["HF_FILE", "META_FILE", "NO_TOKENIZER", "PROBE_TEXT", "SPM_FILE", "TIKTOKEN_FILE",
           "KINDS", "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer",
           "TiktokenTokenizer", "Tokenizer", "TokenizerKind", "kind_of",
           "load_recorded", "load_tokenizer", "read_meta", "require_tokenizer_package"]
