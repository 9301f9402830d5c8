"""Multi-token prediction (models/mtp.py) against a small PyTorch reference written here
from the DeepSeek-V3 report (§2.2; transformers has no MTP module), its blocks
transformers' DeepseekV3DecoderLayer: the loss per depth, and the gradients of the main
model's representation, the shared embedding and head, and every MTP weight."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from flax import nnx
from test_mla import NOPE, RKV, ROPE, D, H, V, _copied
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from jaxtrain.config import ConfigError
from jaxtrain.models import ModelSpec
from jaxtrain.models import mla as mla_lib
from jaxtrain.models import mtp as mtp_lib
from jaxtrain.models.layers import Norm
from jaxtrain.models.mlp import Mlp

VOCAB, F, B, L, DEPTHS, LAMBDA = 24, 20, 2, 12, 2, 0.3


class TorchMtp(torch.nn.Module):
    """The report's MTP, each depth on its own T−k positions (not masked: cut)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.depths = torch.nn.ModuleList()
        for _ in range(DEPTHS):
            depth = torch.nn.Module()
            depth.enorm, depth.hnorm = DeepseekV3RMSNorm(D), DeepseekV3RMSNorm(D)
            depth.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
            depth.block = DeepseekV3DecoderLayer(cfg, layer_idx=0)  # dense: first_k_dense
            depth.norm = DeepseekV3RMSNorm(D)
            self.depths.append(depth)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)

    def forward(self, h, tokens):
        losses = []
        for k, depth in enumerate(self.depths, start=1):
            n = L - k  # positions i = 0..T-k-1: h^{k-1}_i with Emb(t_{i+k})
            x = depth.eh_proj(torch.cat([depth.enorm(self.embed(tokens[:, k:])),
                                         depth.hnorm(h[:, :n])], -1))
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            h = depth.block(x, attention_mask=mask,
                            position_embeddings=self.rotary(x, torch.arange(n)[None]))
            logits = self.head(depth.norm(h))[:, :n - 1]  # the last has no target
            losses.append(torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), tokens[:, k + 1:].reshape(-1)))
        return LAMBDA * sum(losses) / DEPTHS, losses


class Block(nnx.Module):
    """DeepseekV3DecoderLayer (dense) from jaxtrain's parts: MLA, SwiGLU, pre-norms."""

    def __init__(self, spec, rngs):
        mla = mla_lib.MlaSpec(RKV, NOPE, ROPE, V, 12)
        self.norm1 = Norm(D, rms=True, eps=1e-6, dtype=jnp.float32, rngs=rngs)
        self.attn = mla_lib.Mla(spec, mla, rngs=rngs)
        self.norm2 = Norm(D, rms=True, eps=1e-6, dtype=jnp.float32, rngs=rngs)
        self.mlp = Mlp(spec, rngs=rngs, width=F)

    def __call__(self, x_BLD):  # (x, aux) as the model's blocks
        x_BLD = x_BLD + self.attn(self.norm1(x_BLD))
        return x_BLD + self.mlp(self.norm2(x_BLD)), {}


def _jax_mtp(ref: TorchMtp):
    spec = ModelSpec("llama", D, 2, H, H, NOPE + ROPE, F, VOCAB, L, attention="chunked",
                     norm_eps=1e-6)
    t = lambda w: jnp.asarray(w.detach().numpy())  # noqa: E731
    depths = []
    for theirs in ref.depths:
        rngs = nnx.Rngs(0)
        depth = mtp_lib.MtpDepth(spec, Block(spec, rngs), rngs=rngs)
        depth.enorm.scale[...] = t(theirs.enorm.weight)
        depth.hnorm.scale[...] = t(theirs.hnorm.weight)
        depth.norm.scale[...] = t(theirs.norm.weight)
        depth.w_eh[...] = t(theirs.eh_proj.weight).T
        block, tb = depth.block, theirs.block
        block.norm1.scale[...] = t(tb.input_layernorm.weight)
        block.norm2.scale[...] = t(tb.post_attention_layernorm.weight)
        _copied(tb.self_attn, block.attn)
        for name in ("up", "gate", "down"):
            getattr(block.mlp, f"w_{name}")[...] = t(getattr(tb.mlp, f"{name}_proj").weight).T
        depths.append(depth)
    return depths, t(ref.embed.weight), t(ref.head.weight).T


def _reference():
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                           q_lora_rank=12, kv_lora_rank=RKV, qk_nope_head_dim=NOPE,
                           qk_rope_head_dim=ROPE, v_head_dim=V, intermediate_size=F,
                           first_k_dense_replace=1, vocab_size=VOCAB,
                           attn_implementation="eager")
    ref = TorchMtp(cfg).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return ref


def test_mtp_loss_and_gradients_equal_the_report_reference():
    ref = _reference()
    rng = np.random.default_rng(0)
    h = rng.normal(size=(B, L, D)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=(B, L))
    h_t = torch.from_numpy(h).requires_grad_()
    want, want_parts = ref(h_t, torch.from_numpy(tokens))
    want.backward()

    depths, table_VD, head_DV = _jax_mtp(ref)
    mtp = mtp_lib.MtpSpec(DEPTHS, LAMBDA)

    def loss(depths, h, table, head):
        return mtp_lib.mtp_loss(depths, mtp, h, jnp.asarray(tokens), lambda t: table[t],
                                lambda x: x @ head)

    (got, parts), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                     has_aux=True))(depths, h, table_VD, head_DV)
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)
    np.testing.assert_allclose([parts[f"mtp_loss_{k}"] for k in (1, 2)],
                               [p.item() for p in want_parts], rtol=1e-5)
    d_depths, d_h, d_table, d_head = grads
    np.testing.assert_allclose(d_h, h_t.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(d_table, ref.embed.weight.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(d_head, ref.head.weight.grad.numpy().T, rtol=1e-4, atol=1e-6)
    # Every MTP weight's gradient: torch's grads put in the weights' places.
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.grad)
    want_depths = _jax_mtp(ref)[0]
    got_leaves = jax.tree.leaves(nnx.state(d_depths, nnx.Param))
    want_leaves = jax.tree.leaves(nnx.state(want_depths, nnx.Param))
    assert len(got_leaves) == len(want_leaves) > 20
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mtp, match", [
    ({"depths": -1}, "model.mtp.depths=-1 is invalid"),
    ({"depths": 11}, "model.mtp.depths=11 is invalid: must leave a target"),
    ({"loss_weight": -0.1}, "model.mtp.loss_weight=-0.1 is invalid"),
])
def test_mtp_config_errors_name_the_key(mtp, match):
    c = ml_collections.ConfigDict({"model": {"seq_len": 12, "mtp": {**mtp_lib.defaults(),
                                                                   "depths": 1, **mtp}}})
    with pytest.raises(ConfigError, match=match):
        mtp_lib.check(c)


def _model_config(**overrides):
    from conftest import small_config

    return small_config("deepseek_v3", **{
        "model.num_layers": 2, "model.num_heads": 4, "model.attention": "chunked",
        "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 8,
        "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 6,
        "model.mtp.depths": 2, "optimizer.lr": 1e-2, **overrides})


def _run(cfg, devices, steps: int = 4):
    """[(loss, grad_norm, mtp_loss_1)] of `steps` train steps from init."""
    from helpers import first_batches, stepping

    from jaxtrain.train.setup import build

    setup = build(cfg, devices)
    return np.asarray([(float(m["loss"]), float(m["grad_norm"]), float(m.get("mtp_loss_1", 0)))
                       for _, m in stepping(setup, setup.init_state(), first_batches(cfg, steps))])


@pytest.mark.slow  # three runs of four steps (20 s); the module's parity test stays fast
def test_mtp_in_the_model_trains_through_the_shared_embedding_and_head(devices):
    """model.mtp.depths in the train step: the logged loss is the main model's cross
    entropy, each depth's loss is logged, and its gradient reaches the model (grad_norm
    moves); at loss_weight 0 the step is the model's without MTP (the depths are drawn after
    every other weight, so the same main model)."""
    without = _run(_model_config(**{"model.mtp.depths": 0}), devices[:1])
    weight0 = _run(_model_config(**{"model.mtp.loss_weight": 0.0}), devices[:1])
    trained = _run(_model_config(), devices[:1])
    np.testing.assert_allclose(weight0[:, :2], without[:, :2], rtol=1e-6)
    assert trained[0, 0] == pytest.approx(without[0, 0], rel=1e-6)  # CE is the logged loss
    assert abs(trained[0, 1] - without[0, 1]) > 1e-3 * without[0, 1]
    assert np.all(trained[:, 2] > 0) and trained[-1, 2] < trained[0, 2]


@pytest.mark.slow
def test_mtp_under_fsdp_by_tensor_equals_one_device(devices):
    one = _run(_model_config(), devices[:1])
    many = _run(_model_config(**{"mesh.fsdp": 2, "mesh.tensor": 2}), devices[:4])
    np.testing.assert_allclose(many, one, rtol=2e-5)


def test_mtp_is_refused_where_it_would_read_across_bounds():
    from jaxtrain.config import validate

    with pytest.raises(ConfigError, match=r"^model.mtp.depths=2 is invalid: predicts across "
                       r"packed documents"):
        validate(_model_config(**{"data.packing": "documents"}), 1, "cpu")
    with pytest.raises(ConfigError, match=r"^model.mtp.depths=2 is invalid: shifts tokens"):
        validate(_model_config(**{"mesh.context": 2, "model.mla.kv_lora_rank": 0,
                                  "model.family": "llama"}), 2, "cpu")
