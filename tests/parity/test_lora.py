"""LoRA (models/lora.py, train/frozen.py, hf/adapter.py): against the merged weights, PEFT,
transformers and the single-device run."""

import json

import jax
import numpy as np
import pytest
from conftest import small_config
from flax import nnx, traverse_util
from helpers import first_batches, hf_llama, losses_and_norms, stepping

from jaxtrain.config import validate
from jaxtrain.errors import ConfigError
from jaxtrain.models import lora
from jaxtrain.train.setup import build

ALL_DENSE = "q,k,v,o,up,gate,down"


def _llama(**overrides):
    return small_config("llama", **{"model.num_heads": 4, "model.num_kv_heads": 2,
                                    "model.norm_eps": 1e-6, "model.lora.rank": 4,
                                    "model.lora.alpha": 8.0, **overrides})


def _moe(**overrides):
    return _llama(**{"model.moe.num_experts": 4, "model.moe.expert_mlp_dim": 64,
                     "model.moe.dispatch": "dropless", "model.lora.targets": "q,v,experts",
                     **overrides})


def _random_adapters(params, key):
    """Non-zero B (and A) everywhere, as after training."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, x.dtype)
                                     for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("cfg", [_llama(**{"model.lora.targets": ALL_DENSE}), _moe()],
                         ids=["dense", "experts"])
def test_the_lora_forward_equals_the_merged_forward(cfg, devices):
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    adapters = _random_adapters(state.params, jax.random.key(3))
    tokens = np.random.default_rng(0).integers(0, 256, (4, cfg.model.seq_len))
    with jax.set_mesh(setup.mesh):
        full = lora.join(state.frozen_params("base"), adapters)
        ours = nnx.merge(setup.graphdef, full)(tokens)
        merged = lora.merged(setup.spec, full)
        plain = nnx.merge(setup.base_graphdef, merged)(tokens)
        base = nnx.merge(setup.base_graphdef, state.frozen_params("base"))(tokens)
    np.testing.assert_allclose(ours, plain, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(ours) - np.asarray(base)).max() > 1e-2  # the adapters matter


def _steps(cfg, devices, steps=3):
    """(losses, grad norms, first state's base, last state) of `steps` steps."""
    setup = build(cfg, devices)
    state = setup.init_state()
    base = jax.tree.map(np.asarray, state.frozen_params("base"))
    after = list(stepping(setup, state, first_batches(cfg, steps)))
    losses, norms = ([float(m[key]) for _, m in after] for key in ("loss", "grad_norm"))
    return losses, norms, base, after[-1][0]


@pytest.fixture(scope="module")
def single(devices):
    return {"dense": _steps(_llama(**{"model.lora.targets": ALL_DENSE}), devices[:1]),
            "moe": _steps(_moe(), devices[:1])}


def test_the_base_is_frozen_and_only_adapters_have_optimizer_state(single):
    _, norms, base, state = single["dense"]
    assert all(n > 0 for n in norms)
    same = jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), base, state.frozen_params("base"))
    assert all(jax.tree.leaves(same))
    adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
    assert all(lora.is_adapter(tuple(k.key for k in path)) for path, _ in
               jax.tree_util.tree_flatten_with_path(state.params)[0])
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {x.shape for x in moments} <= adapter_shapes
    b = [x for p, x in traverse_util.flatten_dict(state.params).items() if p[-1] == "b"]
    assert all(np.abs(np.asarray(x)).max() > 0 for x in b)  # trained away from zero


@pytest.mark.parametrize("kind,mesh", [
    ("dense", {"mesh.fsdp": 2, "mesh.tensor": 2}),
    ("moe", {"mesh.expert": 2, "mesh.fsdp": 2}),
], ids=["fsdp2xtensor2", "expert2"])
def test_lora_on_a_mesh_gives_the_single_device_losses_and_grad_norms(kind, mesh, single,
                                                                       devices):
    make = _moe if kind == "moe" else _llama
    extra = {} if kind == "moe" else {"model.lora.targets": ALL_DENSE}
    losses, norms, _, _ = _steps(make(**extra, **mesh), devices[:4])
    np.testing.assert_allclose(losses, single[kind][0], rtol=1e-5)
    np.testing.assert_allclose(norms, single[kind][1], rtol=1e-4)


def test_rank_zero_trains_every_parameter_as_before(devices):
    cfg = small_config("llama")
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    assert state.frozen == {}
    assert set(state.tree()) == {"step", "params", "opt_state"}


@pytest.mark.parametrize("key,value,says", [
    ("model.lora.rank", -1, "must be 0 (off) or >= 1"),
    ("model.lora.targets", "q,x", "a comma list of distinct names among q, k, v"),
    ("model.lora.targets", "gate", "has no gate projection"),
    ("model.lora.targets", "experts", "experts needs an MoE model"),
    ("model.lora.dropout", 1.0, "must be in [0, 1)"),
    ("model.lora.dropout", 0.1, "only 0.0 is supported"),
    ("model.lora.alpha", 0.0, "must be > 0"),
    ("model.lora.rank", 65, "at most 64, the width (min(in, out)) of target q"),
])
def test_config_errors_are_one_line(key, value, says):
    cfg = small_config("gpt2", **{"model.lora.rank": 4, key: value})
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1, "cpu")
    assert key in str(e.value) and says in str(e.value) and "\n" not in str(e.value)
    moe_only = small_config("llama", **{"model.lora.rank": 4, "model.lora.targets": "up",
                                        "model.moe.num_experts": 4})
    with pytest.raises(ConfigError, match="use experts"):
        validate(moe_only, 1, "cpu")


@pytest.mark.slow
def test_a_resume_is_bitwise_and_refuses_another_base(tmp_path, devices):
    from jaxtrain.train.loop import run

    cfg = _llama(steps=4, **{"checkpoint.every_steps": 2})
    straight = run(cfg, tmp_path / "straight", devices[:1])
    first = run(_llama(steps=2, **{"checkpoint.every_steps": 2}), tmp_path / "resumed",
                devices[:1])
    rest = run(cfg, tmp_path / "resumed", devices[:1])
    assert [r["step"] for r in first + rest] == [1, 2, 3, 4]
    key = ("loss", "grad_norm")
    assert [[r[k] for k in key] for r in straight] == [[r[k] for k in key] for r in first + rest]
    with pytest.raises(ConfigError) as e:  # another seed: another base
        run(_llama(steps=6, seed=7), tmp_path / "resumed", devices[:1])
    assert "is not the base these adapters were trained on" in str(e.value)
    assert "\n" not in str(e.value)


def _logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


@pytest.mark.slow
def test_peft_loads_the_exported_adapter_and_gives_the_same_logits(tmp_path, devices):
    import transformers
    from peft import PeftModel

    from jaxtrain.hf.load import import_hf
    from jaxtrain.hf.save import export_hf, load_for_export
    from jaxtrain.train.loop import run

    base_cfg = _llama(**{"model.lora.rank": 0})
    hf_llama(base_cfg).save_pretrained(tmp_path / "hf")
    import_hf(base_cfg, tmp_path / "hf", tmp_path / "base", devices[:1])
    cfg = _llama(**{"model.lora.targets": ALL_DENSE, "model.lora.base": str(tmp_path / "base"),
                    "optimizer.lr": 1e-2})
    run(cfg, tmp_path / "run", devices[:1])
    export_hf(tmp_path / "run", tmp_path / "adapter", devices=devices[:1], adapter=True)
    export_hf(tmp_path / "run", tmp_path / "merged", devices=devices[:1])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"])

    setup, params, _ = load_for_export(tmp_path / "run", devices[:1])
    tokens = np.random.default_rng(1).integers(0, 256, (4, cfg.model.seq_len))
    with jax.set_mesh(setup.mesh):
        ours = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, tokens))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    before = _logits(base, tokens)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_logits(peft_model, tokens), ours, atol=1e-5, rtol=0)
    assert np.abs(before - ours).max() > 1e-3  # the trained adapters change the logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_logits(merged, tokens), ours, atol=1e-5, rtol=0)


def test_the_adapter_export_of_experts_is_refused_in_one_line(tmp_path, devices):
    from jaxtrain.hf.adapter import check

    setup = build(_moe(), devices[:1])
    with pytest.raises(ConfigError, match="export the merged weights") as e:
        check(setup.spec)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a run to export
def test_an_adapter_whose_base_has_no_hf_form_is_refused_before_writing(tmp_path, devices):
    """A llama with MoE every 2 layers exports as Mixtral, whose layers are all MoE: its
    adapter would have no base to load onto, so --adapter refuses as the merged export."""
    from jaxtrain.hf.save import export_hf
    from jaxtrain.train.loop import run

    run(_moe(**{"model.moe.every_n_layers": 2, "model.lora.targets": "q,v", "steps": 1}),
        tmp_path / "run", devices[:1])
    for adapter in (True, False):
        with pytest.raises(ConfigError, match="every_n_layers=2") as e:
            export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1], adapter=adapter)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_optimizer_holds_state_for_the_adapters_alone_in_bytes(devices):
    """The memory the issue asks to measure: LoRA's optimizer state against a full
    fine-tune's, on the same model."""
    def opt_bytes(cfg):
        setup = build(cfg, devices[:1])
        opt_state = setup.abstract_state().opt_state
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))

    full = opt_bytes(_llama(**{"model.lora.rank": 0}))
    adapted = opt_bytes(_llama())
    assert adapted < 0.2 * full, (adapted, full)


def test_the_planner_fits_a_llama_3_8b_lora_on_one_80gb_gpu_and_not_the_full_fine_tune():
    from configs.llama_1b import get_config
    from jaxtrain import hardware
    from jaxtrain.config import apply_overrides
    from jaxtrain.plan.planner import make_plan

    llama_3_8b = {"model.d_model": 4096, "model.num_layers": 32, "model.num_heads": 32,
                  "model.num_kv_heads": 8, "model.mlp_dim": 14336, "model.vocab_size": 128256,
                  "model.rope_theta": 500000.0, "model.seq_len": 2048, "model.remat": "full",
                  "train.global_batch": 4, "mesh.fsdp": 1}
    gpu = hardware.get("H100-SXM")  # 80 GB
    full = make_plan(apply_overrides(get_config(), llama_3_8b), gpu, 1)
    adapted = make_plan(apply_overrides(get_config(), {**llama_3_8b, "model.lora.rank": 16}),
                        gpu, 1)
    assert 7.9e9 < full["params"] < 8.1e9
    assert not full["memory"]["fits"] and adapted["memory"]["fits"]
    parts, full_parts = adapted["memory"]["parts"], full["memory"]["parts"]
    assert parts["optimizer"] < 0.01 * full_parts["optimizer"]
    assert parts["gradients"] < 0.01 * full_parts["gradients"]
    assert parts["params"] >= full_parts["params"]  # the frozen base is still there


def _compiled_flops(cfg, devices) -> tuple[float, float]:
    """(XLA's cost analysis of the compiled train step, our model FLOPs for its batch)."""
    from jaxtrain.models.flops import flops_per_token

    setup = build(cfg, devices[:1])
    state = setup.init_state()
    with jax.set_mesh(setup.mesh):
        compiled = setup.train_step().lower(state, setup.abstract_batch()).compile()
    ours = flops_per_token(setup.spec) * cfg.train.global_batch * cfg.model.seq_len
    return compiled.cost_analysis()["flops"], ours


@pytest.mark.slow
def test_the_mfu_numerator_drops_the_frozen_weights_gradients_as_xla_does(devices):
    """MFU counts 4 FLOPs per frozen base weight and token (no weight gradient), not a full
    fine-tune's 6: the LoRA/full ratio of our count equals the ratio of XLA's own cost
    analysis of the two compiled steps (no remat, so nothing is recomputed), to 3%. (Counting
    6 for the base gives a ratio near 1.0 against XLA's 0.76, and an MFU over 1.)"""
    shape = {"model.d_model": 128, "model.mlp_dim": 512, "model.vocab_size": 512,
             "model.remat": "none", "model.lora.targets": ALL_DENSE}
    full_xla, full_ours = _compiled_flops(_llama(**shape, **{"model.lora.rank": 0}), devices)
    lora_xla, lora_ours = _compiled_flops(_llama(**shape, **{"model.lora.rank": 8}), devices)
    assert lora_ours / full_ours == pytest.approx(lora_xla / full_xla, rel=0.03)


@pytest.mark.parametrize("overrides,limit,target", [
    ({}, 32, "k"),  # 4 kv heads of 8: k and v are [64, 32]
    ({"model.lora.targets": "q,up", "model.mlp_dim": 48}, 48, "up"),
    ({"model.lora.targets": "q,experts", "model.moe.num_experts": 4,
      "model.moe.expert_mlp_dim": 16}, 16, "experts"),
])
def test_a_rank_wider_than_a_target_is_refused_and_its_width_accepted(overrides, limit,
                                                                      target):
    validate(small_config("llama", **{"model.lora.rank": limit, **overrides}), 1, "cpu")
    with pytest.raises(ConfigError) as e:
        validate(small_config("llama", **{"model.lora.rank": limit + 1, **overrides}), 1,
                 "cpu")
    assert str(e.value).startswith(f"model.lora.rank={limit + 1} is invalid: at most {limit}")
    assert f"of target {target} " in str(e.value) and "\n" not in str(e.value)


def test_weight_decay_reaches_the_adapters_unless_turned_off():
    """optimizer.weight_decay decays the adapters (as PEFT under the HF Trainer decays every
    trainable weight); model.lora.weight_decay=False leaves them alone. A zero gradient
    moves a parameter by decay alone."""
    from jaxtrain.optim import make_optimizer

    ones = np.ones((4, 4), np.float32)
    params = {"blocks": {"attn": {"w_q": ones, "lora_q": {"a": ones, "b": ones}},
                         "norm": {"scale": ones[0]}}}

    def moved(**overrides):
        cfg = _llama(**{"optimizer.weight_decay": 0.5, "optimizer.warmup_steps": 0,
                        **overrides})
        optimizer, _ = make_optimizer(cfg)
        updates, _ = optimizer.update(jax.tree.map(np.zeros_like, params),
                                      optimizer.init(params), params)
        return {"/".join(k): bool(np.abs(v).max() > 0)
                for k, v in traverse_util.flatten_dict(updates).items()}

    assert moved() == {"blocks/attn/w_q": True, "blocks/attn/lora_q/a": True,
                       "blocks/attn/lora_q/b": True, "blocks/norm/scale": False}
    assert moved(**{"model.lora.weight_decay": False}) == {
        "blocks/attn/w_q": True, "blocks/attn/lora_q/a": False, "blocks/attn/lora_q/b": False,
        "blocks/norm/scale": False}


def test_weight_decay_changes_a_lora_run(single, devices):
    """The issue's symptom: weight decay 0.0 and the default 0.1 gave bit-identical LoRA
    runs. The first loss is the same (step 0 is the base); the decay shows from step 2."""
    losses, norms, _, _ = _steps(_llama(**{"model.lora.targets": ALL_DENSE,
                                           "optimizer.weight_decay": 0.0}), devices[:1])
    decayed_losses, decayed_norms = single["dense"][:2]
    assert losses[0] == decayed_losses[0]
    assert losses[1:] != decayed_losses[1:] and norms[1:] != decayed_norms[1:]


def _torch_lora(model, batches, cfg, weight_decay):
    """(loss, gradient norm) of each step of PyTorch over a PEFT model's trainable (adapter)
    parameters: torch.optim.AdamW with `weight_decay` on all of them (what the HF Trainer
    does: no biases or norms among them), global-norm clipping, jaxtrain's schedule."""
    from hf_parity import next_token_loss, torch_steps

    trained = [p for p in model.parameters() if p.requires_grad]
    return torch_steps(model, batches, cfg, [{"params": trained, "weight_decay": weight_decay}],
                       lambda model, tokens: (next_token_loss(model, tokens)[1],) * 2)


@pytest.mark.slow
def test_lora_weight_decay_equals_peft_with_torch_adamw(tmp_path, devices):
    """5 steps of LoRA with weight decay 0.5 on an HF-made Llama: jaxtrain against PEFT with
    torch.optim.AdamW(weight_decay=0.5) over the adapters, from the same adapters (random
    non-zero A and B, exported to PEFT's format): losses and gradient norms within 1e-5.
    Without decay on the PyTorch side they differ by more than that."""
    pytest.importorskip("torch")
    import transformers
    from peft import PeftModel

    from jaxtrain.hf.adapter import export_adapter
    from jaxtrain.hf.load import import_hf

    shape = {"model.attention": "xla", "optimizer.lr": 1e-2, "optimizer.warmup_steps": 2,
             "steps": 5, "optimizer.clip_norm": 0.5, "optimizer.weight_decay": 0.5}
    base_cfg = _llama(**shape, **{"model.lora.rank": 0})
    hf_llama(base_cfg).save_pretrained(tmp_path / "hf")
    import_hf(base_cfg, tmp_path / "hf", tmp_path / "base", devices[:1])
    cfg = _llama(**shape, **{"model.lora.targets": ALL_DENSE,
                             "model.lora.base": str(tmp_path / "base")})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    adapters = _random_adapters(state.params, jax.random.key(5))
    state = state.replace(params=jax.tree.map(
        lambda x, old: jax.device_put(x, old.sharding), adapters, state.params))
    export_adapter(setup, state.model_params(), 0, tmp_path, tmp_path / "adapter", np.float32)
    batches = list(first_batches(cfg, cfg.steps))
    ours = losses_and_norms(setup, state, batches)

    def peft_model():
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        return PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)

    np.testing.assert_allclose(ours, _torch_lora(peft_model(), batches, cfg, 0.5), rtol=1e-5)
    undecayed = _torch_lora(peft_model(), batches, cfg, 0.0)
    assert np.abs(np.asarray(ours) / np.asarray(undecayed) - 1).max() > 1e-3


def _save_run(workdir, cfg, devices):
    """A run directory holding one checkpoint (step 1) of `cfg`'s fresh state, without
    training (a LoRA config: its adapters, on model.lora.base, with that base's
    fingerprint)."""
    from jaxtrain.checkpoint import Checkpoints

    state = build(cfg, devices[:1]).init_state()
    checkpoints = Checkpoints(workdir / "checkpoints", keep=1, log=lambda _: None)
    checkpoints.save(1, state.tree(), cfg.to_dict())
    checkpoints.close()


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, devices):
    """{"base", "other" (the same shape, another seed), "narrow" (another mlp_dim), "lora"
    (adapters trained on "base", a non-zero B so that the base shows through)} run
    directories."""
    root = tmp_path_factory.mktemp("lora_runs")
    plain = {"model.lora.rank": 0}
    _save_run(root / "base", _llama(**plain), devices)
    _save_run(root / "other", _llama(seed=7, **plain), devices)
    _save_run(root / "narrow", _llama(**plain, **{"model.mlp_dim": 96}), devices)
    _save_run(root / "lora", _llama(**{"model.lora.base": str(root / "base")}), devices)
    return root


def _swap_base(root, replacement):
    """model.lora.base's directory replaced by `replacement`'s (undone by the caller)."""
    import shutil

    shutil.move(root / "base", root / "base.orig")
    shutil.copytree(root / replacement, root / "base")


def _restore_base(root):
    import shutil

    shutil.rmtree(root / "base")
    shutil.move(root / "base.orig", root / "base")


def test_every_command_that_loads_a_lora_run_refuses_a_changed_base(saved_runs, devices,
                                                                    tmp_path):
    """inference.load is what eval, generate, quantize and convert --to-hf load a run
    with: a base replaced by another of the same shape is refused in one line."""
    from jaxtrain import inference
    from jaxtrain.commands.quantize import quantize_run
    from jaxtrain.hf.save import export_hf

    inference.load(saved_runs / "lora", devices=devices[:1])  # on its own base: loads
    _swap_base(saved_runs, "other")
    try:
        calls = [lambda: inference.load(saved_runs / "lora", devices=devices[:1]),
                 lambda: inference.task_scorer(saved_runs / "lora", devices=devices[:1],
                                               progress=False),
                 lambda: export_hf(saved_runs / "lora", tmp_path / "hf", devices=devices[:1]),
                 lambda: quantize_run(saved_runs / "lora", tmp_path / "int8")]
        for call in calls:
            with pytest.raises(ConfigError) as e:
                call()
            assert "is not the base these adapters were trained on" in str(e.value)
            assert "put that base back" in str(e.value) and "\n" not in str(e.value)
    finally:
        _restore_base(saved_runs)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "int8").exists()


def test_a_base_of_another_shape_is_refused_naming_the_parameter(saved_runs, devices):
    from jaxtrain import inference

    _swap_base(saved_runs, "narrow")
    try:
        with pytest.raises(ConfigError) as e:
            inference.load(saved_runs / "lora", devices=devices[:1])
    finally:
        _restore_base(saved_runs)
    assert str(e.value) == (
        f"model.lora.base={str(saved_runs / 'base')!r}: its step 1 does not fit this model "
        "(blocks/mlp/w_down is [2, 96, 64] there, [2, 128, 64] here); name a run of the "
        "same model.* shape")


@pytest.mark.parametrize("base,says", [
    ("nowhere", "holds no checkpoints/ directory"),
    ("empty", "holds no usable checkpoint"),
    ("narrow", "blocks/mlp/w_down is [2, 96, 64] there, [2, 128, 64] here"),
])
def test_a_missing_or_misshapen_base_is_refused_before_the_workdir_is_written(
        base, says, saved_runs, tmp_path, devices):
    from jaxtrain.train.loop import run

    (saved_runs / "empty" / "checkpoints").mkdir(parents=True, exist_ok=True)
    cfg = _llama(**{"model.lora.base": str(saved_runs / base)})
    with pytest.raises(ConfigError) as e:
        run(cfg, tmp_path / "run", devices[:1])
    assert str(e.value).startswith(f"model.lora.base={str(saved_runs / base)!r}")
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_cli_refuses_a_changed_or_misshapen_base_in_one_line(saved_runs):
    """exit 2 and one line, without orbax's message or an asyncio traceback at exit."""
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True,
                              text=True, timeout=300)

    for replacement, command, says in [
            ("other", ("generate", "--prompt_ids=1,2,3", "--max_new_tokens=4"), "is not the base these adapters"),
            ("narrow", ("eval", "--batches=1"), "does not fit this model")]:
        _swap_base(saved_runs, replacement)
        try:
            result = cli(*command, f"--workdir={saved_runs / 'lora'}")
        finally:
            _restore_base(saved_runs)
        assert result.returncode == 2, result.stderr[-2000:]
        assert says in result.stderr and result.stderr.strip().count("\n") == 0, \
            result.stderr[-2000:]
        assert "Traceback" not in result.stderr and "strict=False" not in result.stderr


@pytest.mark.slow
def test_a_quantized_lora_model_holds_its_base(saved_runs, tmp_path, devices):
    """quantize writes the whole model (base and adapters): its directory loads (it gave a
    KeyError traceback) with the int8 loss quantize measured, whatever model.lora.base
    holds since."""
    from jaxtrain import inference
    from jaxtrain.commands.quantize import quantize_run

    summary = quantize_run(saved_runs / "lora", tmp_path / "int8")
    _swap_base(saved_runs, "other")
    try:
        loaded = inference.load(tmp_path / "int8", devices=devices[:1])
    finally:
        _restore_base(saved_runs)
    _, windows, _ = inference.evaluation_windows(loaded.cfg, None)
    result = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)
    assert result["loss"] == pytest.approx(summary["int8_val_loss"], rel=1e-6)
