"""A prompt set (`jaxtrain prepare --prompts` output) as training reads it: its lines, its
tokenizer, its fingerprint, and which prompts a step draws (data.source='prompts',
train.objective='grpo').

The prompts of step s are a pure function of (seed, s): the set is walked in epochs, each
a permutation drawn from (seed, epoch), step s taking positions [s·B, (s+1)·B) of that walk.
A run that resumes at step s therefore draws exactly the prompts an uninterrupted run would
have, with nothing to checkpoint but the step (as data/batches.py addresses batches).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from jaxtrain.data import fingerprints
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    path: str
    lines: list[dict]  # {"prompt_ids": [...], "prompt": ..., column: value, ...}
    manifest: dict

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def columns(self) -> list[str]:
        return sorted({k for line in self.lines for k in line} - {"prompt_ids", "prompt"})

    @property
    def longest(self) -> int:
        return max(len(line["prompt_ids"]) for line in self.lines)

    def step_indices(self, seed: int, step: int, count: int) -> np.ndarray:
        """[count] indices of the prompts step `step` draws (module docstring)."""
        n = len(self.lines)
        at = np.arange(step * count, (step + 1) * count, dtype=np.int64)
        epochs, positions = np.divmod(at, n)
        out = np.empty(count, np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            out[epochs == epoch] = order[positions[epochs == epoch]]
        return out


def _manifest(directory: pathlib.Path) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        raise DataError(f"data.path={str(directory)!r}: no prompt set here (no readable "
                        f"{MANIFEST}: make one with jaxtrain prepare --prompts)") from None
    if manifest.get("kind") != "prompts":
        raise DataError(f"data.path={str(directory)!r}: a dataset of kind "
                        f"{manifest.get('kind')!r}, not of prompts (make one with jaxtrain "
                        "prepare --prompts, or use data.source='prepared')")
    return manifest


def load(path) -> PromptSet:
    """The prompt set at `path`; DataError (one line) for a directory that is not one."""
    directory = pathlib.Path(path)
    manifest = _manifest(directory)
    with open(directory / manifest["file"], encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines:
        raise DataError(f"data.path={str(path)!r}: the prompt set holds no prompts")
    return PromptSet(str(path), lines, manifest)


def fingerprint(c) -> dict[str, dict]:
    """{data.path: its sha256 over the lines file and the manifest}."""
    directory = pathlib.Path(c.data.path)
    manifest = _manifest(directory)
    h = hashlib.sha256((directory / MANIFEST).read_bytes())
    h.update((directory / manifest["file"]).read_bytes())
    digest = h.hexdigest()
    return {"data.path": fingerprints.item(
        digest, f"{directory} ({manifest.get('prompts', '?')} prompts, sha256 {digest[:12]})")}


def tokenizer(c) -> tokenizers_lib.Tokenizer:
    """The tokenizer the prompts were rendered with (checked against the manifest)."""
    directory = pathlib.Path(c.data.path)
    return tokenizers_lib.load_recorded(directory / "tokenizer", _manifest(directory)["tokenizer"],
                                        "data.path")


def splits(c):
    """The prompt set is sampled from, not cut into windows: the GRPO loop reads it."""
    raise DataError(f"data.source='prompts' (data.path={c.data.path!r}) is a prompt set, "
                    "no batches of tokens: train.objective='grpo' samples from it; measure "
                    "a GRPO run by its rewards, or with jaxtrain generate --prompts")
