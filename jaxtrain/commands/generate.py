"""jaxtrain generate --workdir RUN (--prompt TEXT | --prompt_ids 1,2,3 | --chat MESSAGE |
    --prompts FILE.jsonl [--output OUT.jsonl])
    [--max_new_tokens N --temperature T --top_k K --top_p P --min_p M --seed S --n N
     --stop STR,... --logprobs --top_logprobs K --ignore_eos --slots N --tensor N --json]

Continues prompts with the newest checkpoint of a run (or a quantized model directory) on
the generation engine (jaxtrain/engine/): KV cache, continuous batching over --slots rows.
A sample ends at one of the run's EOS ids (its generation_config.json's and its tokenizer's
EOS token; --ignore_eos: never), at a --stop string, or after --max_new_tokens. Temperature 0
(the default) is greedy and deterministic; a seed fixes a sample.

--chat renders MESSAGE as a user turn with the run's chat template (its tokenizer's, or
--chat_template FILE|NAME) and prints only the reply. --prompt is encoded, and the output
decoded, with the run's tokenizer; runs without one take --prompt_ids and print ids.
--prompts reads JSON Lines ({"prompt": TEXT} | {"prompt_ids": [...]} | {"messages": [...]},
each with optional max_new_tokens, temperature, top_k, top_p, min_p, seed, n, stop) and
writes one line per sample: prompt_index, sample, text, ids, finish_reason (stop | length),
and with --logprobs the log-probability of each token (--top_logprobs: the K likeliest
alternatives too). --tensor N shards the model over N devices.
"""

from __future__ import annotations

import json
import sys
import time

from absl import flags, logging

from jaxtrain import inference, storage
from jaxtrain.commands.common import run_absl
from jaxtrain.data import record
from jaxtrain.engine import Engine, Model, Request, SamplingParams, run_io
from jaxtrain.errors import ConfigError

ROW_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n", "stop")


def _define_flags() -> dict:
    s, i, f, b, li = (flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float,
                      flags.DEFINE_bool, flags.DEFINE_list)
    values = {
        "workdir": s("workdir", None, "A run directory, or a quantized model's."),
        "prompt": s("prompt", None, "Prompt text (encoded with the run's tokenizer)."),
        "prompt_ids": li("prompt_ids", None, "Prompt token ids, comma-separated."),
        "chat": s("chat", None, "A user message, rendered with the run's chat template; "
                  "prints only the reply."),
        "chat_template": s("chat_template", None, "A chat template file or shipped name "
                           "instead of the tokenizer's own."),
        "prompts": s("prompts", None, "A JSON Lines file of prompts."),
        "output": s("output", None, "Where --prompts' results go (default: stdout)."),
        "max_new_tokens": i("max_new_tokens", 64, "New tokens at most."),
        "temperature": f("temperature", 0.0, "0: greedy."),
        "top_k": i("top_k", 0, "Sample among the K most likely tokens; 0: all."),
        "top_p": f("top_p", 1.0, "Nucleus sampling mass; 1: off."),
        "min_p": f("min_p", 0.0, "Drop tokens under min_p times the likeliest's probability."),
        "seed": i("seed", 0, "Sampling seed."),
        "n": i("n", 1, "Samples per prompt (sharing its prefill)."),
        "stop": li("stop", [], "Stop strings, comma-separated."),
        "logprobs": b("logprobs", False, "Write each new token's log-probability."),
        "top_logprobs": i("top_logprobs", 0, "And the K likeliest alternatives'."),
        "ignore_eos": b("ignore_eos", False, "Go on past EOS (fixed-length output)."),
        "slots": i("slots", 8, "Rows decoded together (continuous batching)."),
        "tensor": i("tensor", 1, "Devices to shard the model over (tensor axis)."),
        "json": b("json", False, "Print the prompt and generated ids as JSON."),
    }
    flags.mark_flags_as_required(["workdir"])
    return values


def _params(f: dict, row: dict | None = None) -> SamplingParams:
    values = {k: f[k].value for k in ROW_KEYS}
    values.update({k: v for k, v in (row or {}).items() if k in ROW_KEYS})
    values["stop"] = tuple([values["stop"]] if isinstance(values["stop"], str)
                           else values["stop"])
    return SamplingParams(**values, logprobs=f["logprobs"].value,
                          top_logprobs=f["top_logprobs"].value,
                          ignore_eos=f["ignore_eos"].value)


def _one_prompt(f: dict, cfg, tokenizer, workdir) -> list[int]:
    if f["chat"].value is not None:
        template = run_io.chat_template(workdir, tokenizer, f["chat_template"].value)
        return run_io.chat_ids(template, tokenizer, [{"role": "user",
                                                       "content": f["chat"].value}])
    return inference.prompt_tokens(cfg, f["prompt"].value, f["prompt_ids"].value,
                                   f["max_new_tokens"].value, tokenizer)


def _row_prompt(row: dict, cfg, tokenizer, template) -> list[int]:
    if "messages" in row:
        return run_io.chat_ids(template(), tokenizer, row["messages"])
    text, ids = row.get("prompt"), row.get("prompt_ids")
    return inference.prompt_tokens(cfg, text, None if ids is None else [str(i) for i in ids],
                                   0, tokenizer)


def _engine(f: dict, workdir, tokenizer, top_n: int) -> tuple[Engine, int]:
    loaded = inference.load(workdir, tensor=f["tensor"].value)
    return Engine(Model.of(loaded), slots=f["slots"].value,
                  eos_ids=run_io.eos_ids(workdir, tokenizer), tokenizer=tokenizer,
                  top_n=top_n), loaded.step


def _generate(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    workdir = f["workdir"].value
    chosen = [k for k in ("prompt", "prompt_ids", "chat", "prompts") if f[k].value is not None]
    if len(chosen) != 1:
        raise ConfigError("give exactly one of --prompt, --prompt_ids, --chat, --prompts")
    _, cfg = inference.run_config(workdir)  # prompts are checked before loading
    tokenizer = record.run_tokenizer(workdir, cfg)
    _params(f).check(f["top_logprobs"].value)
    if f["prompts"].value is not None:
        return _generate_file(f, workdir, cfg, tokenizer)
    prompt = _one_prompt(f, cfg, tokenizer, workdir)
    engine, step = _engine(f, workdir, tokenizer, f["top_logprobs"].value)
    request = Request(tuple(prompt), _params(f))
    engine.check(request)
    start = time.perf_counter()
    completions = engine.generate([request])[0]
    seconds = time.perf_counter() - start
    for c in completions:
        _print_one(f, prompt, c, tokenizer, step, len(c.ids) / seconds)
    count = sum(len(c.ids) for c in completions)
    print(f"jaxtrain: {count} tokens from step {step} at {count / seconds:.1f} tokens/s "
          f"({f['tensor'].value} device(s), compile included), finished: "
          f"{', '.join(c.finish_reason for c in completions)}", file=sys.stderr)


def _print_one(f: dict, prompt: list[int], c, tokenizer, step: int, rate: float) -> None:
    text, why = inference.decode_text(tokenizer, prompt + c.ids)
    if f["chat"].value is not None:
        text, why = c.text, None
    if why:
        print(f"jaxtrain: {why}", file=sys.stderr)
    if f["json"].value:
        out = {"prompt_ids": prompt, "generated_ids": c.ids, "text": text, "step": step,
               "finish_reason": c.finish_reason, "tokens_per_s": round(rate, 1)}
        if f["logprobs"].value:
            out.update(logprobs=c.logprobs, top_logprobs=c.top_logprobs)
        print(json.dumps(out))
    elif text is not None:
        print(text)
    else:
        print(" ".join(map(str, c.ids)))


def _generate_file(f: dict, workdir, cfg, tokenizer) -> None:
    rows = run_io.read_prompts(f["prompts"].value)
    templates = []

    def template():  # read once, on the first chat row
        if not templates:
            templates.append(run_io.chat_template(workdir, tokenizer, f["chat_template"].value))
        return templates[0]

    prompts = [_row_prompt(row, cfg, tokenizer, template) for row in rows]
    requests = [Request(tuple(p), _params(f, row)) for p, row in zip(prompts, rows)]
    top_n = max(r.params.top_logprobs for r in requests)
    engine, _ = _engine(f, workdir, tokenizer, top_n)
    for number, request in enumerate(requests, 1):
        try:
            engine.check(request)
        except ConfigError as e:
            raise ConfigError(f"--prompts={f['prompts'].value} line {number}: {e}") from None
    lines = []
    for index, completions in enumerate(engine.generate(requests)):
        for c in completions:
            out = {"prompt_index": index, "sample": c.index, "text": c.text, "ids": c.ids,
                   "finish_reason": c.finish_reason}
            if f["logprobs"].value:
                out.update(logprobs=c.logprobs, top_logprobs=c.top_logprobs)
            lines.append(json.dumps(out))
    _write(f["output"].value, lines)


def _write(path: str | None, lines: list[str]) -> None:
    if path is None:
        print("\n".join(lines))
        return
    target = storage.as_path(path, "--output")
    storage.make_parent(target)
    target.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("generate", lambda args: _generate(values, args), argv,
             paths=("workdir", "prompts", "output"))


if __name__ == "__main__":
    main()
