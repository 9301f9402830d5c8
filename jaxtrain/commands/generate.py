"""jaxtrain generate --workdir RUN (--prompt TEXT | --prompt_ids 1,2,3)
    [--max_new_tokens N --temperature T --top_k K --top_p P --seed S --tensor N --json]

Continues a prompt with the newest checkpoint of a run (or a quantized model directory),
decoding with a KV cache. Temperature 0 (the default) is greedy and deterministic. --prompt
is encoded, and the output decoded, with the run's tokenizer (WORKDIR/tokenizer: bytes for
the built-in corpus, the prepared dataset's otherwise); runs without one (synthetic data, a
.bin without data.tokenizer, a Hugging Face import without tokenizer files) take
--prompt_ids and print ids. Ids always work; text is printed only where the tokenizer covers
every id (else the ids, and a line on stderr saying why). --tensor N shards the model over N
devices.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from jaxtrain import inference
from jaxtrain.commands.common import run_absl
from jaxtrain.data import record
from jaxtrain.sampling import Sampling, make_generate


def _define_flags() -> dict:
    values = {
        "workdir": flags.DEFINE_string("workdir", None, "A run directory, or a quantized "
                                       "model's."),
        "prompt": flags.DEFINE_string("prompt", None, "Prompt text (encoded with the run's "
                                      "tokenizer)."),
        "prompt_ids": flags.DEFINE_list("prompt_ids", None, "Prompt token ids, "
                                        "comma-separated."),
        "max_new_tokens": flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate."),
        "temperature": flags.DEFINE_float("temperature", 0.0, "0: greedy."),
        "top_k": flags.DEFINE_integer("top_k", 0, "Sample among the K most likely tokens; "
                                      "0: all."),
        "top_p": flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1: off."),
        "seed": flags.DEFINE_integer("seed", 0, "Sampling seed."),
        "tensor": flags.DEFINE_integer("tensor", 1, "Devices to shard the model over (tensor "
                                       "axis)."),
        "json": flags.DEFINE_bool("json", False, "Print the prompt and generated ids as JSON."),
    }
    flags.mark_flags_as_required(["workdir"])
    return values


def _generate(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    sampling = Sampling(f["max_new_tokens"].value, f["temperature"].value, f["top_k"].value,
                        f["top_p"].value)
    sampling.check()
    _, cfg = inference.run_config(f["workdir"].value)  # the prompt is checked before loading
    tokenizer = record.run_tokenizer(f["workdir"].value, cfg)
    prompt = inference.prompt_tokens(cfg, f["prompt"].value, f["prompt_ids"].value,
                                     sampling.max_new_tokens, tokenizer)
    loaded = inference.load(f["workdir"].value, tensor=f["tensor"].value)
    setup = loaded.setup
    with jax.set_mesh(setup.mesh):
        generate = make_generate(setup.graphdef, sampling, setup.spec.rules)
        args = (loaded.params, jnp.asarray([prompt], jnp.int32),
                jax.random.key(f["seed"].value))
        compiled = generate.lower(*args).compile()
        start = time.perf_counter()
        tokens = np.asarray(jax.device_get(compiled(*args)))[0].tolist()
        seconds = time.perf_counter() - start
    text, why = inference.decode_text(tokenizer, prompt + tokens)
    if why:
        print(f"jaxtrain: {why}", file=sys.stderr)
    if f["json"].value:
        print(json.dumps({"prompt_ids": prompt, "generated_ids": tokens, "text": text,
                          "step": loaded.step, "tokens_per_s": round(len(tokens) / seconds, 1)}))
    elif text is not None:
        print(text)
    else:
        print(" ".join(map(str, tokens)))
    print(f"jaxtrain: {len(tokens)} tokens from step {loaded.step} at "
          f"{len(tokens) / seconds:.1f} tokens/s ({len(setup.mesh.devices.flat)} device(s), "
          "compile excluded)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("generate", lambda args: _generate(values, args), argv, paths=("workdir",))


if __name__ == "__main__":
    main()
