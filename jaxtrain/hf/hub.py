"""`--from-hf org/name`: a Hub model id, read from the local Hugging Face cache, offline.

The cache is the one huggingface_hub fills (`hf download org/name`): $HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub, holding models--org--name/snapshots/<commit>/
with refs/main naming the commit downloaded last. Nothing is fetched: a model not there is
a one-line error with the command that fetches it.
"""

from __future__ import annotations

import os
import pathlib
import re

from jaxtrain.errors import ConfigError

# org/name as the Hub spells ids: one slash, no leading dot, slash or tilde.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_model_id(value: str) -> bool:
    return bool(_ID.match(str(value)))


def cache_dir() -> pathlib.Path:
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def snapshot(model_id: str) -> pathlib.Path:
    """The cached snapshot of `model_id` (refs/main's commit, else the only snapshot), or a
    ConfigError naming the command that downloads it."""
    repo = cache_dir() / f"models--{model_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    why = ("holds several snapshots and no refs/main" if found else
           "holds no snapshot of it")
    raise ConfigError(f"--from-hf={model_id}: no such directory, and the Hugging Face cache "
                      f"{cache_dir()} {why} (jaxtrain reads the Hub offline): fetch it with "
                      f"`hf download {model_id}` (or `huggingface-cli download {model_id}`)")
