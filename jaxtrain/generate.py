"""python -m jaxtrain.generate --workdir RUN (--prompt TEXT | --prompt_ids 1,2,3)
    [--max_new_tokens N --temperature T --top_k K --top_p P --seed S --tensor N --json]

Continues a prompt with the newest checkpoint of a run (or a quantized model directory),
decoding with a KV cache. Temperature 0 (the default) is greedy and deterministic. --prompt
is UTF-8 bytes for byte-level models (the built-in corpus); models trained on token files
take --prompt_ids. --tensor N shards the model over N devices (tensor parallel).
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory, or a quantized model's.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (byte-level models).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "Prompt token ids, comma-separated.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the K most likely tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1: off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Devices to shard the model over (tensor axis).")
_JSON = flags.DEFINE_bool("json", False, "Print the prompt and generated ids as JSON.")
flags.mark_flags_as_required(["workdir"])


def prompt_tokens(cfg, text: str | None, ids: list[str] | None) -> list[int]:
    """The prompt as token ids; ValueError (one line) for what this model cannot take."""
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of --prompt and --prompt_ids")
    if text is not None:
        if cfg.data.source != "stdlib":
            raise ValueError(f"this model was trained on token ids (data.source="
                             f"{cfg.data.source!r}) and has no tokenizer here; pass "
                             "--prompt_ids")
        tokens = list(text.encode("utf-8"))
    else:
        try:
            tokens = [int(i) for i in ids]
        except ValueError:
            raise ValueError(f"--prompt_ids={','.join(ids)} is invalid: integers, "
                             "comma-separated") from None
    bad = [t for t in tokens if not 0 <= t < cfg.model.vocab_size]
    if not tokens or bad:
        raise ValueError(f"the prompt must be 1 or more token ids in [0, "
                         f"{cfg.model.vocab_size}); got {bad or 'none'}")
    return tokens


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain import inference
    from jaxtrain.checkpoint import CheckpointError
    from jaxtrain.config import ConfigError
    from jaxtrain.sampling import Sampling, make_generate

    try:
        sampling = Sampling(_MAX_NEW.value, _TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
        sampling.check()
        loaded = inference.load(_WORKDIR.value, tensor=_TENSOR.value)
        prompt = prompt_tokens(loaded.cfg, _PROMPT.value, _PROMPT_IDS.value)
        limit = loaded.cfg.model.seq_len
        if len(prompt) + sampling.max_new_tokens > limit:
            raise ValueError(f"--max_new_tokens={sampling.max_new_tokens} is too many: the "
                             f"prompt ({len(prompt)} tokens) plus new tokens must fit the "
                             f"model's model.seq_len={limit}")
    except (ValueError, ConfigError, CheckpointError) as e:
        sys.exit(f"jaxtrain: error: {e}")
    setup = loaded.setup
    with jax.set_mesh(setup.mesh):
        generate = make_generate(setup.graphdef, sampling, setup.spec.rules)
        args = (loaded.params, jnp.asarray([prompt], jnp.int32), jax.random.key(_SEED.value))
        compiled = generate.lower(*args).compile()
        start = time.perf_counter()
        tokens = np.asarray(jax.device_get(compiled(*args)))[0].tolist()
        seconds = time.perf_counter() - start
    rate = f"{len(tokens) / seconds:.1f} tokens/s"
    if _JSON.value:
        print(json.dumps({"prompt_ids": prompt, "generated_ids": tokens, "step": loaded.step,
                          "tokens_per_s": round(len(tokens) / seconds, 1)}))
    elif loaded.cfg.data.source == "stdlib":
        print(bytes(prompt + tokens).decode("utf-8", errors="replace"))
    else:
        print(" ".join(map(str, tokens)))
    print(f"jaxtrain: {len(tokens)} tokens from step {loaded.step} at {rate} "
          f"({len(setup.mesh.devices.flat)} device(s), compile excluded)", file=sys.stderr)


if __name__ == "__main__":
    from jaxtrain.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
