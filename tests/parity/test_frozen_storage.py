"""A LoRA run's frozen base held in model.lora.base_dtype's form (models/base_storage.py,
train/frozen.py, plan/memory.py): the NF4 forward against PEFT's QLoRA, a bf16 base against
the float32 base over 50 steps, dequantization inside the layer scan, the resume check, the
config errors and the planner's 8B figures."""

import jax
import jax.extend
import numpy as np
import pytest
from conftest import small_config
from flax import nnx
from helpers import hf_llama, train_steps

from jaxtrain.config import validate
from jaxtrain.errors import ConfigError
from jaxtrain.models import lora
from jaxtrain.models.base_storage import NF4Weight
from jaxtrain.train import frozen
from jaxtrain.train.setup import build

ALL_DENSE = "q,k,v,o,up,gate,down"


def _llama(**overrides):
    return small_config("llama", **{"model.num_heads": 4, "model.num_kv_heads": 2,
                                    "model.norm_eps": 1e-6, "model.lora.rank": 4,
                                    "model.lora.alpha": 8.0, "model.lora.targets": ALL_DENSE,
                                    **overrides})


@pytest.mark.parametrize("overrides,says", [
    ({"model.lora.base_dtype": "fp4"}, "one of float32, bfloat16, int8, nf4"),
    ({"model.lora.base_dtype": "nf4", "model.mlp_dim": 96}, "w_down (96)"),
    ({"model.lora.base_dtype": "bfloat16", "model.lora.rank": 0}, "needs LoRA"),
])
def test_a_storage_kind_that_cannot_work_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        validate(_llama(**overrides), 1)
    assert "model.lora.base_dtype=" in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)


def _matmul_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NF4Weight))
            if isinstance(x, NF4Weight)]


def _top_level_eqns(jaxpr):
    """The equations outside any scan body (into jit and custom-vjp bodies)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
            continue
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _top_level_eqns(sub)


def test_the_step_holds_nf4_and_dequantizes_inside_the_layer_scan(devices):
    setup = build(_llama(**{"model.lora.base_dtype": "nf4"}), devices[:1])
    state = setup.abstract_step_state()
    base = state.frozen_params("base")
    weights = _matmul_leaves(base)
    assert len(weights) == 7 and all(w.codes.dtype == np.uint8 for w in weights)
    assert base["tok_embed"].dtype == jax.numpy.bfloat16
    assert base["blocks"]["attn_norm"]["scale"].dtype == np.float32
    jaxpr = jax.make_jaxpr(setup.train_step())(state, setup.abstract_batch())
    stacked = {w.shape for w in weights}  # [layers, ...] of each weight read as an array
    eqns = list(_top_level_eqns(jaxpr.jaxpr))
    scans = [e for e in eqns if e.primitive.name == "scan"]
    assert any(v.aval.dtype == np.uint8 and v.aval.shape[:1] == (2,)
               for e in scans for v in e.invars), "the scan takes the NF4 codes per layer"
    widened = [e for e in eqns if e.primitive.name != "scan" for v in e.outvars
               if tuple(v.aval.shape) in stacked]
    assert not widened, widened  # no whole-model dequantized copy outside the scan


def test_a_resume_refuses_the_same_base_in_another_storage_kind(devices):
    stored_f32 = build(_llama(), devices[:1])
    state = stored_f32.init_state()
    nf4 = build(_llama(**{"model.lora.base_dtype": "nf4"}), devices[:1])
    with pytest.raises(ConfigError) as e:
        frozen.attach(state.without_frozen_params(), nf4.cfg, nf4.spec, nf4.shardings, False)
    assert "model.lora.base_dtype='nf4'" in str(e.value) and "\n" not in str(e.value)
    assert "is not the base these adapters were trained on" in str(e.value)
    again = frozen.attach(state.without_frozen_params(), stored_f32.cfg, stored_f32.spec,
                          stored_f32.shardings, False)
    for a, b in zip(jax.tree.leaves(again.frozen), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(a, b)  # float32: today's base, bitwise


@pytest.mark.slow
def test_a_bf16_base_tracks_the_float32_base_over_50_steps(devices):
    # tests/unit/test_precision.py's bfloat16 tolerance (mean, max of |loss − float32 loss|), on
    # its run (50 steps, lr 3e-3): at lr 1e-2 the drift reached 0.0055 on an Intel CPU
    # (mean 0.00016, max 0.00037 at 3e-3), a tolerance's worth of the learning rate, not of the storage.
    from test_precision import TOLERANCE

    run = {"steps": 50, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 5}
    base = np.array(train_steps(_llama(**run), devices[:1], 50)[0])
    bf16 = np.array(train_steps(_llama(**run, **{"model.lora.base_dtype": "bfloat16"}),
                                devices[:1], 50)[0])
    diff = np.abs(bf16 - base)
    assert base[-1] < base[0] - 0.2, "the adapters must actually learn"
    mean_tol, max_tol = TOLERANCE["bfloat16"]
    assert diff.mean() < mean_tol and diff.max() < max_tol, (diff.mean(), diff.max())
    assert diff.max() > 0  # the base was stored in bfloat16


def _peft_qlora(directory, cfg, adapters):
    """PEFT's QLoRA model (transformers' bitsandbytes NF4, blocks of 64, double-quantized
    absmax; prepare_model_for_kbit_training; float32 compute) with our adapters."""
    import bitsandbytes as bnb
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from peft.utils import set_peft_model_state_dict

    from jaxtrain.hf.adapter import tensors

    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=quant, device_map="cpu", dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # On a CPU with AVX512-BF16, bitsandbytes runs an eval-mode forward through a
            # repacked kernel with bfloat16 absmax and compute; off, it runs its reference
            # path: dequantize_4bit then a float32 matmul.
            module.support_avx512bf16_for_cpu = False
    model = get_peft_model(model, LoraConfig(
        r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                        "down_proj"]))
    state = {k: torch.from_numpy(v) for k, v in tensors(None, adapters).items()}
    missing = set_peft_model_state_dict(model, state).unexpected_keys
    assert not missing, missing
    return model.eval()


_HF_MODULES = {("attn", "w_q"): "self_attn.q_proj", ("attn", "w_k"): "self_attn.k_proj",
               ("attn", "w_v"): "self_attn.v_proj", ("attn", "w_o"): "self_attn.o_proj",
               ("mlp", "w_up"): "mlp.up_proj", ("mlp", "w_gate"): "mlp.gate_proj",
               ("mlp", "w_down"): "mlp.down_proj"}


def _their_absmax(peft_model, base: dict) -> dict:
    """Our NF4 weights with bitsandbytes' stored absmax (its CPU kernel rounds a few of
    them the other way: tests/parity/test_base_storage.py), after checking the codes are its."""
    layers = peft_model.base_model.model.model.layers
    out = {}
    for (module, name), hf in _HF_MODULES.items():
        ours = base["blocks"][module][name]
        linears = [layer.get_submodule(hf).base_layer.weight for layer in layers]
        codes = np.stack([w.data.numpy().reshape(-1) for w in linears])
        np.testing.assert_array_equal(np.asarray(ours.codes), codes)
        states = [w.quant_state for w in linears]
        theirs = {"absmax": np.stack([s.absmax.numpy() for s in states]),
                  "absmax_scale": np.stack([s.state2.absmax.numpy() for s in states]),
                  "absmax_offset": np.stack([np.float32(s.offset) for s in states])}
        off = theirs["absmax"].astype(int) - np.asarray(ours.absmax).astype(int)
        assert np.abs(off).max() <= 1 and (off != 0).mean() < 0.05, off
        out[(module, name)] = NF4Weight(codes=ours.codes, layer_shape=ours.layer_shape,
                                        axes=ours.axes, **jax.tree.map(jax.numpy.asarray,
                                                                       theirs))
    return out


@pytest.mark.slow
def test_lora_on_an_nf4_base_gives_peft_qloras_logits(tmp_path, devices):
    import torch

    from jaxtrain.hf.load import import_hf

    base_cfg = _llama(**{"model.lora.rank": 0})
    hf_llama(base_cfg).save_pretrained(tmp_path / "hf")
    import_hf(base_cfg, tmp_path / "hf", tmp_path / "base", devices[:1])
    cfg = _llama(**{"model.lora.base": str(tmp_path / "base"), "model.lora.base_dtype": "nf4"})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    keys = jax.random.split(jax.random.key(3), len(jax.tree.leaves(state.params)))
    adapters = jax.tree.unflatten(jax.tree.structure(state.params), [
        0.1 * jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, jax.tree.leaves(state.params))])
    peft_model = _peft_qlora(tmp_path / "hf", cfg, adapters)
    stored = state.frozen_params("base")
    base = dict(stored, blocks={m: dict(v) for m, v in stored["blocks"].items()})
    for (module, name), weight in _their_absmax(peft_model, stored).items():
        base["blocks"][module][name] = weight
    tokens = np.random.default_rng(1).integers(0, 256, (2, cfg.model.seq_len))
    with jax.set_mesh(setup.mesh):
        ours = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(
            lora.join(base, adapters), tokens))
    # The nf4 entry holds the embedding and the head in bfloat16 (QLoRA keeps them in the
    # load dtype): PEFT's are rounded alike, the compute is float32 on both sides.
    inner = peft_model.base_model.model
    with torch.no_grad():
        for table in (inner.model.embed_tokens.weight, inner.lm_head.weight):
            table.copy_(table.to(torch.bfloat16).to(torch.float32))
        theirs = peft_model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 0.5  # logits of a size where 1e-4 tells


def _llama_3_8b(kind: str):
    from configs.llama_1b import get_config
    from jaxtrain.config import apply_overrides
    return apply_overrides(get_config(), {
        "model.d_model": 4096, "model.num_layers": 32, "model.num_heads": 32,
        "model.num_kv_heads": 8, "model.mlp_dim": 14336, "model.vocab_size": 128256,
        "model.rope_theta": 500000.0, "model.seq_len": 2048, "model.remat": "full",
        "train.global_batch": 1, "mesh.fsdp": 1, "model.lora.rank": 16,
        "model.lora.targets": ALL_DENSE, "model.lora.base_dtype": kind})


def test_the_planner_fits_llama_3_8b_qlora_on_one_24gb_gpu():
    from jaxtrain import hardware
    from jaxtrain.plan.planner import make_plan

    gpu = hardware.get("RTX-4090")  # 24 GB
    plans = {kind: make_plan(_llama_3_8b(kind), gpu, 1)["memory"]
             for kind in ("float32", "bfloat16", "int8", "nf4")}
    total = {kind: p["total_bytes_per_device"] / 1e9 for kind, p in plans.items()}
    assert total["bfloat16"] <= 20 and total["nf4"] <= 10, total
    assert not plans["float32"]["fits"] and plans["bfloat16"]["fits"], total
    assert total["float32"] > total["bfloat16"] > total["int8"] > total["nf4"]
    # The base is what changes: 8.0e9 parameters, 7.0e9 of them block matmul weights.
    base = {kind: p["parts"]["params"] / 1e9 for kind, p in plans.items()}
    assert 31 < base["float32"] < 33 and 15.5 < base["bfloat16"] < 16.5, base
    assert 5 < base["nf4"] < 6.5, base


def test_a_checkpoint_holds_each_frozen_models_fingerprint_at_its_old_key():
    """TrainState.frozen is one mapping of role -> (params, fingerprint); a checkpoint holds
    each role's fingerprint alone, under the key it had before the mapping, so checkpoints
    written before it still restore, and a restored state has the parameters to load."""
    from jaxtrain.train.state import Frozen, TrainState

    words = {role: np.arange(8, dtype=np.uint32) + i for i, role in
             enumerate(("base", "reference"))}
    state = TrainState(step=np.int32(3), params={"a": np.ones(2)}, opt_state=(),
                       frozen={role: Frozen({"w": np.zeros(4)}, fp) for role, fp in
                               words.items()})
    tree = state.tree()
    assert set(tree) == {"step", "params", "opt_state", "base_fingerprint",
                         "reference_fingerprint"}
    restored = TrainState.from_tree(tree)
    assert set(restored.frozen) == {"base", "reference"}
    for role, fp in words.items():
        assert restored.frozen[role].params is None
        np.testing.assert_array_equal(restored.frozen[role].fingerprint, fp)
    assert restored.reference_params() is None and restored.model_params() is restored.params


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "nf4"])
def test_a_stored_base_is_the_same_on_every_mesh(kind, devices):
    """The stored form (and so the fingerprint a resume, eval or export compares) does not
    depend on the mesh the base is stored on: NF4's mean of the absmax, summed split over
    fsdp=2, moved by a last bit, and an export (FSDP over every local device) refused the
    run it had just trained."""
    found = []
    for fsdp in (1, 2):
        cfg = _llama(**{"model.lora.base_dtype": kind, "mesh.fsdp": fsdp,
                        "train.global_batch": 2})
        setup = build(cfg, devices[:fsdp])
        found.append(frozen.fingerprint(frozen.load("base", cfg, setup.spec, setup.shardings)))
    np.testing.assert_array_equal(*found)


@pytest.mark.slow  # a run saved, exported and loaded in transformers per kind
def test_a_lora_run_on_a_stored_base_exports_the_model_it_trained(tmp_path, devices, capfd):
    """convert --to-hf and quantize of a LoRA run whose base is held as bf16 bits, int8 or
    nf4: the
    merged Hugging Face model (each layer read back in float32, its adapter folded in)
    gives our forward's logits (the stored base with the adapters); the adapter alone
    exports too. It was refused or failed for every stored kind (a bf16 weight sliced by
    layer, an int8 weight without ndim, an nf4 base stored anew on the export's mesh)."""
    import torch
    import transformers

    from jaxtrain import inference
    from jaxtrain.checkpoint import Checkpoints
    from jaxtrain.commands.quantize import quantize_run
    from jaxtrain.hf.save import export_hf

    base_cfg = _llama(**{"model.lora.rank": 0})
    state = build(base_cfg, devices[:1]).init_state()
    saved = Checkpoints(tmp_path / "base" / "checkpoints", keep=1, log=lambda _: None)
    saved.save(1, state.tree(), base_cfg.to_dict())
    saved.close()
    tokens = np.random.default_rng(1).integers(0, 256, (2, base_cfg.model.seq_len))
    for kind in ("bfloat16", "int8", "nf4"):
        cfg = _llama(**{"model.lora.base": str(tmp_path / "base"),
                        "model.lora.base_dtype": kind})
        setup = build(cfg, devices[:1])
        state = setup.init_state()
        keys = jax.random.split(jax.random.key(3), len(jax.tree.leaves(state.params)))
        state = state.replace(params=jax.tree.unflatten(jax.tree.structure(state.params), [
            0.1 * jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, jax.tree.leaves(state.params), strict=True)]))
        saved = Checkpoints(tmp_path / kind / "checkpoints", keep=1, log=lambda _: None)
        saved.save(1, state.tree(), cfg.to_dict())
        saved.close()
        with jax.set_mesh(setup.mesh):
            ours = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(
                state.model_params(), tokens))
        capfd.readouterr()
        export_hf(tmp_path / kind, tmp_path / f"hf_{kind}")  # FSDP over 8 devices
        said = capfd.readouterr().err
        assert (f"jaxtrain: merging the LoRA adapters into the base (dequantized from its "
                f"{kind} storage): W + scale·A@B, written as float32 weights of the base "
                "model") in said, said
        export_hf(tmp_path / kind, tmp_path / f"adapter_{kind}", adapter=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf_{kind}")
        with torch.no_grad():
            theirs = model.float()(torch.from_numpy(tokens)).logits.numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0, err_msg=kind)
        assert (tmp_path / f"adapter_{kind}" / "adapter_model.safetensors").exists()
    # jaxtrain quantize of the nf4 run: its model directory loads (it restored into the
    # NF4 weights' tree: AttributeError) with the int8 loss quantize measured.
    summary = quantize_run(tmp_path / "nf4", tmp_path / "quantized")
    loaded = inference.load(tmp_path / "quantized", devices=devices[:1])
    _, windows, _ = inference.evaluation_windows(loaded.cfg, None)
    result = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)
    assert result["loss"] == pytest.approx(summary["int8_val_loss"], rel=1e-6)
