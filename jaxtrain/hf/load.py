"""Import: a Hugging Face directory -> a step-0 jaxtrain checkpoint (commands/convert.py)."""

from __future__ import annotations

import functools
import json
import pathlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.data import record, tokenizers
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.hf import family_of, generation, layer_types
from jaxtrain.hf.files import SafetensorsDir, read_config
from jaxtrain.prepare import chat_template
from jaxtrain.train.setup import Setup, build, loss_scale_init
from jaxtrain.train.state import LossScale, TrainState
from jaxtrain.workdir import CHECKPOINTS, prepare_workdir, write_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Tensors a checkpoint may hold that are no parameters: buffers older transformers saved
# (RoPE's inverse frequencies, GPT-2's causal mask).
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def hf_tokenizer(directory, vocab_size: int) -> tokenizers.Tokenizer | None:
    """The tokenizer of a Hugging Face model directory (None if it has none), checked to fit
    the model's vocabulary."""
    if not any((pathlib.Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        return None
    tokenizer = tokenizers.load_tokenizer(directory, "--from-hf")
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"--from-hf={directory}: its tokenizer has {tokenizer.vocab_size} ids, "
                        f"more than model.vocab_size={vocab_size}")
    return tokenizer


def import_hf(cfg, hf_dir, workdir, devices: Sequence[jax.Device] | None = None,
              allow_unused: bool = False) -> tuple[Setup, TrainState]:
    """Imports HF `hf_dir` into a step-0 checkpoint of `cfg` in `workdir`, with the
    directory's tokenizer as the run's (WORKDIR/tokenizer; without tokenizer files, a record
    that the run has none, so that bytes are not assumed for a config on the byte corpus)
    and its generation_config.json as the run's (hf/generation.py).

    What is read is questioned before anything is written: the directory, the
    architecture, every config.json value against cfg.model (one error naming each
    mismatch), the tokenizer's size, generation_config.json, every safetensors file (a
    truncated download: DataError naming it), every tensor's shape in their headers, and
    tensors that map to nothing (refused, listed, unless `allow_unused`). Each tensor read
    is checked finite (DataError naming it) before the checkpoint is saved.

    Each parameter is read with safetensors (only the slice it needs: q, k and v each read
    their third of GPT-2's fused c_attn) and placed straight into its shards with
    device_put; a per-layer HF tensor goes to the devices layer by layer and the stacked
    [layers, ...] parameter is assembled there by one jitted stack. Peak host memory is
    about two copies of the largest single HF tensor read (the slice and its
    transposed/reshaped copy), usually the embedding table; peak device memory is the
    params plus, transiently, a second copy of one stacked parameter (its per-layer
    pieces), and then the optimizer state the checkpoint needs.
    """
    hf_dir, workdir = pathlib.Path(hf_dir), storage.as_path(workdir, "--workdir")
    hf = read_config(hf_dir)
    family = family_of(hf, f"{hf_dir / 'config.json'}")
    _check_matches(cfg, hf, family, hf_dir)
    tokenizer = hf_tokenizer(hf_dir, cfg.model.vocab_size)
    generation_text = _generation_config(hf_dir)
    setup = build(cfg, devices)
    checkpoints_dir = workdir / CHECKPOINTS
    if checkpoints_dir.is_dir() and any(checkpoints_dir.iterdir()):
        raise ConfigError(f"--workdir={workdir} already holds checkpoints; import into a new "
                          "or empty directory")
    abstract = traverse_util.flatten_dict(setup.abstract_state().params)
    tensors, layers = family.tensors(setup.spec, hf), setup.spec.num_layers
    sources = _sources(tensors, abstract)
    with SafetensorsDir(hf_dir) as files:
        files.check_readable()
        _check_tensors(files, tensors, layers, hf_dir)
        _check_unused(files, tensors, layers, hf, hf_dir, allow_unused,
                      getattr(family, "LEFT_PREFIX", None))
        prepare_workdir(workdir)
        params = _load_all(files, abstract, sources, hf_dir)
    state = _fresh_state(setup, params)
    checkpoints = Checkpoints(checkpoints_dir, cfg.checkpoint.keep, cfg.checkpoint.keep_period,
                              log=_say)
    checkpoints.save(0, state.tree(), cfg.to_dict())
    checkpoints.close()
    if jax.process_index() == 0:
        write_config(workdir, cfg)
        template = chat_template.own_source(hf_dir) if tokenizer is not None else None
        record.store_tokenizer(workdir, tokenizer,
                               {"chat_template.jinja": template} if template else None)
        if generation_text is not None:
            storage.atomic_write(workdir / generation.FILE, generation_text)
    return setup, state


def _generation_config(hf_dir: pathlib.Path) -> str | None:
    """generation_config.json's text, checked (hf/generation.py parse), or None."""
    path = hf_dir / generation.FILE
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        blob = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    generation.parse(blob, str(path))
    return text


def _load_all(files, abstract: dict, sources: dict, hf_dir) -> dict:
    """Every parameter read, checked finite and placed in its shards."""
    params = {}
    work = sum(abstract[path].shape[0] if path[0] in ("blocks", "moe_blocks", "linear_blocks")
               else 1
               for path in abstract)
    with tqdm(total=work, desc="import", unit="tensor", file=sys.stderr) as bar:
        for path, target in abstract.items():
            params[path] = _load(files, sources[path], target, bar, hf_dir)
    return traverse_util.unflatten_dict(params)


def _check_matches(cfg, hf: dict, family, hf_dir: pathlib.Path) -> None:
    """ConfigError naming every way config.json differs from cfg.model."""
    problems = []
    if cfg.model.family != family.FAMILY:
        problems.append(f"model.family={cfg.model.family!r} but config.json "
                        f"model_type={hf['model_type']!r} (jaxtrain family {family.FAMILY!r})")
    else:
        problems += family.check_config(hf, cfg.model)
    windows = layer_types.windows(cfg.model)
    if not family.SLIDING_WINDOW and any(w and w < cfg.model.seq_len for w in windows):
        problems.append(f"model.sliding_window={cfg.model.sliding_window} but "
                        f"{hf['model_type']} attends to every earlier token (use 0)")
    elif not getattr(family, "LAYER_TYPES", False) and len(set(windows)) > 1:
        problems.append(f"model.layer_types={cfg.model.layer_types!r} mixes sliding and full "
                        f"layers but {hf['model_type']} has one window for every layer")
    if problems:
        raise ConfigError(f"{hf_dir} does not match the config: {'; '.join(problems)}")


def _sources(hf_tensors, abstract: dict) -> dict:
    """jaxtrain path -> (HF tensor, offset along its axis, part), covering every param."""
    sources = {}
    for tensor in hf_tensors:
        offset = 0
        for part in tensor.parts:
            sources[part.path] = (tensor, offset, part)
            offset += part.size
    assert set(sources) == set(abstract), set(sources) ^ set(abstract)
    return sources


def _check_tensors(files: SafetensorsDir, hf_tensors, layers: int, hf_dir) -> None:
    missing, wrong = [], []
    for tensor in hf_tensors:
        for name, _, _ in tensor.names(layers):
            if files.resolve(name) is None:
                missing.append(name)
            elif not tensor.shape_ok(files.shape(name)):
                wrong.append(f"{name} {list(files.shape(name))} (expected "
                             f"{list(tensor.shape)})")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{hf_dir} lacks tensors {', '.join(missing[:3])}{more}")
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ConfigError(f"{hf_dir} has tensors of unexpected shapes: "
                          f"{'; '.join(wrong[:3])}{more}")


@functools.cache
def _stacker(sharding: NamedSharding):
    return jax.jit(lambda *layers: jnp.stack(layers), out_shardings=sharding)


def _check_unused(files: SafetensorsDir, hf_tensors, layers: int, hf: dict, hf_dir,
                  allow_unused: bool, left_prefix: str | None = None) -> None:
    """ConfigError listing the checkpoint's tensors that map to no parameter (dropping them
    would import another model), unless `allow_unused`. Not counted, as transformers reads
    none of them either: buffers (BUFFER_SUFFIXES), a tied checkpoint's lm_head (the table
    is the head) and DeepSeek's multi-token prediction layers past num_hidden_layers (the
    family module says so in a note). left_prefix: a part of the checkpoint the family
    imports without (a multimodal model's vision tower), said in one line."""
    used = {files.resolve(name) for tensor in hf_tensors for name, _, _ in tensor.names(layers)}
    ignored = ("lm_head.weight",) if hf.get("tie_word_embeddings") else ()
    extra = tuple(f"model.layers.{i}." for i in range(
        layers, layers + int(hf.get("num_nextn_predict_layers") or 0)))
    unused = sorted(name for name in files.files if name not in used
                    and not name.endswith(BUFFER_SUFFIXES) and name not in ignored
                    and not name.startswith(extra))
    left = [name for name in unused if left_prefix and name.startswith(left_prefix)]
    if left:
        _say(f"jaxtrain: importing the text model of {hf_dir}; its {len(left)} "
             f"{left_prefix}* tensors (the vision tower) are left")
        unused = [name for name in unused if name not in left]
    if not unused:
        return
    more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
    if allow_unused:
        _say(f"jaxtrain: --allow-unused: not importing {len(unused)} tensors of {hf_dir}: "
             f"{', '.join(unused[:5])}{more}")
        return
    raise ConfigError(f"{hf_dir} holds {len(unused)} tensors that map to no parameter of "
                      f"the model: {', '.join(unused[:5])}{more}; pass --allow-unused to "
                      "import without them")


def _load(files, source, target: jax.ShapeDtypeStruct, bar, hf_dir) -> jax.Array:
    tensor, offset, part = source

    def read(layer=None) -> np.ndarray:
        if tensor.experts:  # this layer's experts, stacked
            return np.stack([read_one(layer, e) for e in range(tensor.experts)])
        return read_one(layer)

    def read_one(layer, expert=None) -> np.ndarray:
        start, stop = (0, None) if tensor.read_whole else (offset, offset + part.size)
        name = tensor.named(layer, expert)
        value = tensor.select(files.read(name, tensor.axis, start, stop), offset, part.size)
        if not np.isfinite(value).all():  # training would call step 0 damaged
            raise DataError(f"{hf_dir}: tensor {name} holds non-finite values (NaN or inf); "
                            "the checkpoint is damaged")
        return np.asarray(part.to_jax(value), dtype=target.dtype)

    if not tensor.per_layer:
        value = jax.device_put(read(), target.sharding)
        bar.update(1)
        return value
    layer_sharding = NamedSharding(target.sharding.mesh, P(*target.sharding.spec[1:]))
    pieces = []
    for index in range(target.shape[0]):
        pieces.append(jax.device_put(read(tensor.hf_layer(index)), layer_sharding))
        bar.update(1)
    stacked = _stacker(target.sharding)(*pieces)
    del pieces
    return stacked


def _fresh_state(setup: Setup, params: dict) -> TrainState:
    """The train state at step 0 around imported params: the optimizer state is created
    in its shards from them, as Setup.init_state would."""
    shardings = setup.shardings
    with jax.set_mesh(setup.mesh):
        opt_state = jax.jit(setup.optimizer.init, in_shardings=(shardings.params,),
                            out_shardings=shardings.opt_state)(params)
    scale = loss_scale_init(setup.cfg)
    if scale is not None:
        scale = LossScale(jax.device_put(np.float32(scale), shardings.loss_scale.scale),
                          jax.device_put(np.int32(0), shardings.loss_scale.good_steps))
    return TrainState(step=jax.device_put(np.int32(0), shardings.step), params=params,
                      opt_state=opt_state, loss_scale=scale)
