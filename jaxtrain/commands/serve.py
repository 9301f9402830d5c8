"""jaxtrain serve --workdir RUN [--host 127.0.0.1 --port 8000 --api_key KEY --model_name NAME
    --slots 8 --max_len N --max_tokens N --top_logprobs 20 --max_body_bytes B --tensor N
    --chat_template FILE|NAME]

An OpenAI-compatible HTTP server on the generation engine (docs/serving.md): /v1/models,
/v1/completions and /v1/chat/completions, streamed (server-sent events) or whole, with n,
stop, logprobs, max_tokens, temperature, top_p, seed. Concurrent requests share one
continuous batch of --slots rows. It listens on 127.0.0.1 unless --host says otherwise;
with --api_key (or JAXTRAIN_API_KEY) every /v1 request needs `Authorization: Bearer KEY`.
Needs the serve extra: pip install 'jaxtrain[serve]'. Ctrl-C stops it.
"""

from __future__ import annotations

import os
import sys

from absl import flags, logging

from jaxtrain import inference
from jaxtrain.commands.common import run_absl
from jaxtrain.data import record
from jaxtrain.engine import Engine, Model, Request, SamplingParams, run_io
from jaxtrain.errors import ConfigError, DataError, require_package
from jaxtrain.serve.app import Served, make_app
from jaxtrain.serve.protocol import Limits
from jaxtrain.serve.worker import Worker


def _define_flags() -> dict:
    s, i = flags.DEFINE_string, flags.DEFINE_integer
    values = {
        "workdir": s("workdir", None, "A run directory, or a quantized model's."),
        "host": s("host", "127.0.0.1", "Address to listen on."),
        "port": i("port", 8000, "Port to listen on."),
        "api_key": s("api_key", None, "Bearer key every /v1 request needs (default: "
                     "$JAXTRAIN_API_KEY; neither: open)."),
        "model_name": s("model_name", None, "The model's id (default: the workdir's name)."),
        "slots": i("slots", 8, "Rows decoded together (continuous batching)."),
        "max_len": i("max_len", 0, "Prompt plus new tokens at most; 0: model.seq_len."),
        "max_tokens": i("max_tokens", 0, "A request's max_tokens at most; 0: max_len."),
        "top_logprobs": i("top_logprobs", 20, "A request's top_logprobs at most."),
        "max_body_bytes": i("max_body_bytes", 1 << 20, "Largest request body."),
        "tensor": i("tensor", 1, "Devices to shard the model over (tensor axis)."),
        "chat_template": s("chat_template", None, "A chat template file or shipped name "
                           "instead of the tokenizer's own."),
    }
    flags.mark_flags_as_required(["workdir"])
    return values


def _template(workdir, tokenizer, option):
    try:
        return run_io.chat_template(workdir, tokenizer, option)
    except DataError:
        if option:
            raise
        return None  # no chat endpoint; completions still work


def _served(f: dict) -> Served:
    workdir = f["workdir"].value
    _, cfg = inference.run_config(workdir)
    tokenizer = record.run_tokenizer(workdir, cfg)
    if tokenizer is None:
        raise ConfigError(f"--workdir={workdir}: the run has no tokenizer, which serve needs")
    template = _template(workdir, tokenizer, f["chat_template"].value)
    loaded = inference.load(workdir, tensor=f["tensor"].value)
    engine = Engine(Model.of(loaded), slots=f["slots"].value, max_len=f["max_len"].value or None,
                    eos_ids=run_io.eos_ids(workdir, tokenizer), tokenizer=tokenizer,
                    top_n=f["top_logprobs"].value)
    engine.generate([Request((0,), SamplingParams(max_new_tokens=2))])  # compile the step
    limit = min(f["max_tokens"].value or engine.max_len, engine.max_len)
    name = f["model_name"].value or str(workdir).rstrip("/").rsplit("/", 1)[-1]
    return Served(Worker(engine), name, tokenizer, template,
                  Limits(limit, min(16, limit), f["top_logprobs"].value),
                  f["api_key"].value or os.environ.get("JAXTRAIN_API_KEY") or None,
                  f["max_body_bytes"].value)


def _serve(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    for name in ("fastapi", "uvicorn"):
        require_package(name, "jaxtrain serve")
    for name, low in (("port", 0), ("slots", 1), ("top_logprobs", 0), ("max_body_bytes", 1)):
        if f[name].value < low:
            raise ConfigError(f"--{name}={f[name].value} is invalid: must be >= {low}")
    import uvicorn

    served = _served(f)
    print(f"jaxtrain serve: {served.model_name} on http://{f['host'].value}:"
          f"{f['port'].value}/v1 ({served.worker.engine.slots} slots, "
          f"{'key required' if served.api_key else 'no key'})", file=sys.stderr, flush=True)
    uvicorn.run(make_app(served), host=f["host"].value, port=f["port"].value,
                log_level="warning")


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("serve", lambda args: _serve(values, args), argv, paths=("workdir",))


if __name__ == "__main__":
    main()
