"""Pipeline parallelism (GPipe and circular) trains the same numbers as one device."""

import jax
import numpy as np
import pytest
from conftest import small_config
from helpers import assert_params_close, train_steps

from jaxtrain.parallel.pipeline import bubble_fraction, microbatches_for_bubble
from jaxtrain.plan.hlo import collective_bytes
from jaxtrain.train.setup import build

CASES = {
    # name: (mesh, schedule, repeats, microbatches, layers)
    "pp2_gpipe": (dict(pipeline=2, data=4), "gpipe", 1, 2, 8),
    "pp8_gpipe": (dict(pipeline=8, data=1), "gpipe", 1, 8, 8),
    "pp2_fsdp2_tp2_gpipe": (dict(pipeline=2, fsdp=2, tensor=2, data=1), "gpipe", 1, 4, 8),
    "pp2_circular": (dict(pipeline=2, data=4), "circular", 2, 2, 8),
    "pp8_circular": (dict(pipeline=8, data=1), "circular", 2, 8, 16),
    "pp2_fsdp2_tp2_circular": (dict(pipeline=2, fsdp=2, tensor=2, data=1), "circular", 2, 4, 8),
}
_references = {}


def _config(family, layers, mesh=None, schedule="gpipe", repeats=1, microbatches=4):
    overrides = {"model.num_layers": layers, "pipeline.schedule": schedule,
                 "pipeline.repeats": repeats, "pipeline.microbatches": microbatches}
    overrides.update({f"mesh.{k}": v for k, v in (mesh or {}).items()})
    return small_config(family, **overrides)


def _reference(family, layers, devices):
    if (family, layers) not in _references:
        _references[family, layers] = train_steps(_config(family, layers), devices[:1])
    return _references[family, layers]


# Every layout on GPT-2, the 3-D one on Llama too (the family changes the block, not the
# schedule), to keep the suite short: 2 and 8 stages bracket 4, whose schedule order
# test_the_schedule_applies_every_layer_in_order_to_every_row checks. The fast tier keeps one
# layout of each schedule on GPT-2 (the rest: slow, ≈ 8–16 s each).
FAST = {("pp2_gpipe", "gpt2"), ("pp2_fsdp2_tp2_circular", "gpt2")}


@pytest.mark.parametrize("case,family", [
    pytest.param(case, family, marks=() if (case, family) in FAST else pytest.mark.slow)
    for case, family in [(case, "gpt2") for case in CASES]
    + [("pp2_fsdp2_tp2_circular", "llama")]])
def test_pipeline_matches_single_device(case, family, devices):
    mesh, schedule, repeats, microbatches, layers = CASES[case]
    ref_losses, ref_params, _ = _reference(family, layers, devices)
    cfg = _config(family, layers, mesh, schedule, repeats, microbatches)
    losses, params, _ = train_steps(cfg, devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-5)


def test_pipelined_step_permutes_and_keeps_stages_local(devices):
    layers, stages = 8, 4
    cfg = _config("gpt2", layers, dict(pipeline=stages, data=2), microbatches=4)
    setup = build(cfg, devices)
    state = setup.abstract_state()
    w_up = state.params["blocks"]["mlp"]["w_up"]
    shard = w_up.sharding.shard_shape(w_up.shape)
    assert shard[0] == layers // stages, "each device holds 1/p of the layer stack"
    tokens = jax.ShapeDtypeStruct((16, 33), np.int32, sharding=setup.tokens_sharding)
    with jax.set_mesh(setup.mesh):
        hlo = setup.train_step().lower(state, tokens).compile().as_text()
    assert "collective-permute" in hlo
    traffic = collective_bytes(hlo)
    assert traffic["collective-permute"] > 0
    # Gathering the whole stack onto each device would move at least its size per step.
    stack_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(state.params["blocks"]))
    assert traffic["all-gather"] < stack_bytes, traffic


def test_bubble_fraction_and_advice():
    assert bubble_fraction(4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert microbatches_for_bubble(4, 1) == 28  # 3 / (28 + 3) < 0.1 <= 3 / 30
    assert bubble_fraction(4, 1, 28) < 0.1 <= bubble_fraction(4, 1, 27)


@pytest.mark.slow
def test_the_step_logs_the_bubble(tmp_path, devices, capfd):
    from jaxtrain.train.loop import run
    cfg = _config("gpt2", 4, dict(pipeline=4, data=2), microbatches=4)
    rows = run(cfg, tmp_path, devices)
    assert rows[0]["pipeline_bubble"] == pytest.approx(3 / 7)
    assert ("warning: the pipeline bubble is 42.9% of each step (4 stages, 4 micro-batches, "
            "1 repeats); pipeline.microbatches=28 or more brings it under 10%"
            ) in capfd.readouterr().err


@pytest.mark.parametrize("stages,repeats,microbatches", [(4, 1, 4), (4, 2, 4), (8, 1, 8),
                                                         (8, 2, 8)])
def test_the_schedule_applies_every_layer_in_order_to_every_row(stages, repeats,
                                                                microbatches, devices):
    """pipeline() against applying the layers one after another in numpy: non-commuting
    layers (x -> tanh(x @ W_l)), distinct rows, 4 and 8 stages, GPipe and circular."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jaxtrain.parallel.pipeline import PipelineSpec, pipeline

    layers, d = stages * repeats * 2, 6
    kw, kx = jax.random.split(jax.random.key(4))
    w_LDD = jax.random.normal(kw, (layers, d, d)) / np.sqrt(d)
    x_BLD = jax.random.normal(kx, (2 * microbatches, 3, d))

    def stage(chunk_w, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, chunk_w)[0]

    want = np.asarray(x_BLD, np.float64)
    for w in np.asarray(w_LDD, np.float64):
        want = np.tanh(want @ w)
    mesh = Mesh(np.asarray(devices[:stages]).reshape(stages), ("pipeline",))
    spec = PipelineSpec(stages, repeats, microbatches)
    with jax.set_mesh(mesh):
        rules = (("stage", "pipeline"), ("layers", "pipeline"))
        got = jax.jit(lambda w, x: pipeline(stage, w, x, spec, rules))(w_LDD, x_BLD)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
