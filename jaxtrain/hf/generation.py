"""A run's generation defaults: Hugging Face's `generation_config.json`, kept as
WORKDIR/generation_config.json by `convert --from-hf` and written back by `--to-hf`.

It says where a reply ends (its EOS ids: one id or a list, as transformers allows), which id
pads, and the model's default sampling. `generate`, `eval`, `serve` and the engine read it
through `read`; a run without the file (trained here from scratch) has no defaults beyond
its tokenizer's EOS token.
"""

from __future__ import annotations

import dataclasses
import json

from jaxtrain import storage
from jaxtrain.errors import ConfigError

FILE = "generation_config.json"
# The sampling keys kept, with the names transformers gives them.
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "max_new_tokens",
                 "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    bos_id: int | None = None
    sampling: dict = dataclasses.field(default_factory=dict)  # SAMPLING_KEYS present


def _ids(value, key: str, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where}: {key}={value!r} must be a token id or a list of them")
    return tuple(values)


def parse(blob: dict, where: str = FILE) -> GenerationDefaults:
    """GenerationDefaults from generation_config.json's content; ConfigError (one line,
    naming the key) for ids that are not ids."""
    if not isinstance(blob, dict):
        raise ConfigError(f"{where}: must hold a JSON object")
    pad = _ids(blob.get("pad_token_id"), "pad_token_id", where)
    bos = _ids(blob.get("bos_token_id"), "bos_token_id", where)
    return GenerationDefaults(
        eos_ids=_ids(blob.get("eos_token_id"), "eos_token_id", where),
        pad_id=pad[0] if pad else None, bos_id=bos[0] if bos else None,
        sampling={k: blob[k] for k in SAMPLING_KEYS if blob.get(k) is not None})


def text(workdir) -> str | None:
    """The run's generation_config.json as it was imported (None: the run has none), for
    export."""
    try:
        return (storage.as_path(workdir, "--workdir") / FILE).read_text()
    except FileNotFoundError:
        return None


def read(workdir) -> GenerationDefaults:
    """The run's defaults; empty ones when the run has no generation_config.json."""
    path = storage.as_path(workdir, "--workdir") / FILE
    text_ = text(workdir)
    if text_ is None:
        return GenerationDefaults()
    try:
        blob = json.loads(text_)
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from e
    return parse(blob, str(path))
