"""DPO (train.objective='dpo'): preference pairs from prepare --preference, rows of pairs,
the loss, rewards and gradients against a plain PyTorch DPO (TRL's formulas) on an HF-made
Llama, with LoRA (PEFT's model, adapters disabled as the reference) and without (a frozen
copy), micro-batches, a run through the loop, and the config errors."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config

from jaxtrain.commands import prepare as prepare_cmd
from jaxtrain.config import validate
from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.packing import Packed
from jaxtrain.errors import ConfigError
from jaxtrain.models import lora
from jaxtrain.objectives import DPO_METRICS
from jaxtrain.prepare import merge as merge_lib
from jaxtrain.train.setup import build

BETA = 0.1


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def _random_pairs(count: int = 40):
    """`count` preference records of random lengths (seeded): prompts of 1-9 q's, chosen
    replies of "yes"s, rejected ones of "no"s."""
    rng = np.random.default_rng(0)
    return [{"prompt": "q" * int(rng.integers(1, 10)), "chosen": "yes" * int(
        rng.integers(1, 5)), "rejected": "no" * int(rng.integers(1, 5))} for _ in range(count)]


def _prepare(data, out, *more):
    return prepare_cmd.main([str(data), "--preference", "--chat-template", "chatml",
                             "--tokenizer", "bytes", "--no-progress", "--processes", "1",
                             "--max-bad-fraction", "1", "--out", str(out), *more])


def _text(ds, start, length, masked=False):
    tokens = ds.read(start, length)
    if masked:
        tokens = tokens[ds.read_mask(start, length).astype(bool)]
    return bytes(tokens.astype(np.uint8)).decode()


def test_prepare_stores_pairs_adjacent_masked_on_replies_and_counts_bad_records(
        tmp_path, capsys):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "2+2?"}]
    records = [
        {"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."},
        {"messages": history, "chosen": {"role": "assistant", "content": "4"},
         "rejected": [{"role": "assistant", "content": "5"}]},
        {"prompt": "x", "chosen": "a"},  # 3: no rejected
        {"prompt": "x", "chosen": "", "rejected": "b"},  # 4: empty reply
        {"messages": [{"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"},
        {"prompt": "x", "chosen": {"role": "user", "content": "a"}, "rejected": "b"},  # 6
        {"prompt": "long " * 50, "chosen": "a", "rejected": "b"},  # 7: the pair > 400
        "not json",  # 8
        {"chosen": "a", "rejected": "b"},  # 9: no prompt
    ]
    data = _jsonl(tmp_path / "pairs.jsonl", records)
    assert _prepare(data, tmp_path / "a", "--max-length", "400") == 0
    err = capsys.readouterr().err
    for kind, line, count in (("no reply", 3, 2), ("unknown role", 5, 2), ("too long", 7, 1),
                              ("malformed json", 8, 1), ("no messages", 9, 1)):
        assert f"skipped {count} {kind} (first: {data}:{line}" in err, err
    ds = PreparedDataset(tmp_path / "a")
    assert ds.pairs and ds.masked and ds.num_documents == 4
    docs = [ds.document(i) for i in range(4)]
    # documents 2k and 2k+1: the same prompt, then the chosen and the rejected reply
    assert _text(ds, *docs[0]).startswith("<|im_start|>user\nSay yes.<|im_end|>\n")
    assert [_text(ds, *d, masked=True) for d in docs] == [
        "Yes.<|im_end|>\n", "No.<|im_end|>\n", "4<|im_end|>\n", "5<|im_end|>\n"]  # not "Hello."
    assert "Hello.<|im_end|>" in _text(ds, *docs[2]) and "Hello." in _text(ds, *docs[3])
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["pairs"] is True and manifest["chat"]["preference"] is True
    # --train-on all is refused in one line
    assert _prepare(data, tmp_path / "b", "--train-on", "all") == 2
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and "--preference" in said and not (tmp_path / "b").exists()


def test_shards_and_merge_never_separate_a_pair(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"prompt": "q" * int(rng.integers(1, 20)),
                "chosen": "c" * int(rng.integers(1, 20)),
                "rejected": "r" * int(rng.integers(1, 20))} for _ in range(40)]
    data = _jsonl(tmp_path / "pairs.jsonl", records)
    sizes = ("--unit-bytes", "300", "--tokens-per-file", "700")
    assert _prepare(data, tmp_path / "one", *sizes) == 0
    for i in range(3):
        assert _prepare(data, tmp_path / "parts", *sizes, "--shard", f"{i}/3") == 0
    merged = merge_lib.merge(tmp_path / "parts")
    one, parts = PreparedDataset(tmp_path / "one"), PreparedDataset(tmp_path / "parts")
    assert len(one.shards) > 1 and merged["fingerprint"] == one.fingerprint
    assert merged["pairs"] and all(s["num_documents"] % 2 == 0 for s in merged["shards"])
    for ds in (one, parts):
        for k in range(40):
            chosen, rejected = (_text(ds, *ds.document(2 * k + j), masked=True)
                                for j in (0, 1))
            assert chosen == "c" * len(records[k]["chosen"]) + "<|im_end|>\n"
            assert rejected == "r" * len(records[k]["rejected"]) + "<|im_end|>\n"


def _dpo_config(path="unused", family="llama", **overrides):
    return small_config(family, **{
        "train.objective": "dpo", "train.dpo.beta": BETA, "data.source": "prepared",
        "data.path": str(path), "data.packing": "pairs", **overrides})


def test_rows_of_pairs_hold_chosen_then_rejected_with_their_masks(tmp_path):
    records = [{"prompt": f"p{k}", "chosen": "c" * (k + 1), "rejected": "r" * (k + 2)}
               for k in range(20)]
    assert _prepare(_jsonl(tmp_path / "p.jsonl", records), tmp_path / "d") == 0
    cfg = _dpo_config(tmp_path / "d", **{"model.seq_len": 192, "train.global_batch": 4,
                                         "data.val_fraction": 0.2})
    batches = make_batches(cfg)
    assert (len(batches.train_source), len(batches.val_source)) == (16, 4)
    row = batches.train_source[3]
    segments, positions = np.asarray(row.segments), np.asarray(row.positions)
    n_c, n_r = (segments == 1).sum(), (segments == 2).sum()
    assert (segments[:n_c] == 1).all() and (segments[n_c:n_c + n_r] == 2).all()
    assert (segments[n_c + n_r:] == 0).all() and (row.tokens[n_c + n_r:] == 0).all()
    assert (positions[:n_c] == np.arange(n_c)).all()
    assert (positions[n_c:n_c + n_r] == np.arange(n_r)).all()
    kept = bytes(np.asarray(row.tokens)[np.asarray(row.mask, bool)].astype(np.uint8)).decode()
    assert kept == "cccc<|im_end|>\nrrrrr<|im_end|>\n"  # pair 3
    # a pair longer than the row is refused before anything compiles
    with pytest.raises(Exception, match="more than a row of model.seq_len"):
        make_batches(_dpo_config(tmp_path / "d", **{"model.seq_len": 96}))


@pytest.mark.parametrize("key, value, says", [
    ("train.dpo.beta", 0.0, "train.dpo.beta"),
    ("data.packing", "documents", "data.packing='pairs'"),
    ("data.mixture", "a:1,b:1", "mixtures of preference datasets"),
    ("train.dpo.reference", "runs/x", "with LoRA the reference is the frozen base"),
    ("data.source", "synthetic", "data.source='prepared'"),
    ("train.objective", "ppo", "valid values are lm, dpo"),
])
def test_config_errors_are_one_line(key, value, says):
    extra = {"model.lora.rank": 4} if key == "train.dpo.reference" else {}
    if key == "data.mixture":
        extra = {"data.path": ""}
    cfg = _dpo_config(**{key: value, **extra})
    with pytest.raises(ConfigError, match=says) as e:
        validate(cfg, 1, "cpu")
    assert "\n" not in str(e.value)


def test_pairs_and_the_lm_objective_refuse_each_other(tmp_path):
    with pytest.raises(ConfigError, match="train.objective='dpo'") as e:
        validate(small_config(**{"data.packing": "pairs"}), 1, "cpu")
    assert "\n" not in str(e.value)
    records = [{"prompt": "p", "chosen": "c", "rejected": "r"}] * 4
    assert _prepare(_jsonl(tmp_path / "p.jsonl", records), tmp_path / "d") == 0
    with pytest.raises(ConfigError, match="holds preference pairs"):
        make_batches(small_config(**{"data.source": "prepared", "data.path": str(
            tmp_path / "d"), "data.packing": "documents"}))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("plain text " * 20)
    assert prepare_cmd.main([str(tmp_path / "t"), "--tokenizer", "bytes", "--no-progress",
                             "--out", str(tmp_path / "text")]) == 0
    with pytest.raises(ConfigError, match="needs a dataset of preference pairs"):
        make_batches(_dpo_config(tmp_path / "text"))


# --- the loss against PyTorch ----------------------------------------------------------

SHAPE = {"model.d_model": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.mlp_dim": 64, "model.vocab_size": 128, "model.norm_eps": 1e-6,
         "model.num_layers": 2, "model.attention": "xla", "model.seq_len": 48,
         "train.global_batch": 4}
SYNTHETIC = {"data.source": "synthetic"}  # the base's import: a vocabulary under 256


def _pairs(rng, rows, seq, vocab):
    """Rows of pairs [prompt+chosen][prompt+rejected], masks on the replies; and each
    document alone ([2 · rows] of (ids, mask): the chosen ones, then the rejected ones)."""
    arrays = np.zeros((4, rows, seq + 1), np.int32)
    alone = [[], []]
    for r in range(rows):
        prompt = rng.integers(1, vocab, int(rng.integers(3, 8)))
        at = 0
        for k in (1, 2):
            reply = rng.integers(1, vocab, int(rng.integers(2, (seq + 1) // 2 - 8)))
            ids = np.r_[prompt, reply]
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(reply))]
            n = len(ids)
            arrays[:, r, at:at + n] = np.stack([ids, np.full(n, k), np.arange(n), mask])
            alone[k - 1].append((ids, mask))
            at += n
    return Packed(*arrays), alone[0] + alone[1]


def _torch_logps(model, docs):
    """[2B] sums of log p(target) over each document's masked targets (TRL's
    per_token_logps summed under the completion mask), one right-padded batch."""
    import torch

    width = max(len(ids) for ids, _ in docs)
    ids = torch.zeros((len(docs), width), dtype=torch.long)
    mask = torch.zeros((len(docs), width))
    for i, (d, m) in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(m)] = torch.from_numpy(d), torch.from_numpy(m)
    logits = model(input_ids=ids[:, :-1]).logits.float()
    per_token = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (per_token * mask[:, 1:]).sum(-1)


def _torch_dpo(policy, reference, docs, beta):
    """TRL's sigmoid DPO (DPOTrainer._compute_loss, reverse KL): (loss, metrics)."""
    import torch

    chosen, rejected = _torch_logps(policy, docs).chunk(2)
    with torch.no_grad():
        ref_chosen, ref_rejected = _torch_logps(reference, docs).chunk(2)
    chosen_rewards = beta * (chosen - ref_chosen)
    rejected_rewards = beta * (rejected - ref_rejected)
    loss = -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).mean()
    metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected":
               rejected_rewards.mean(), "rewards/margins": (chosen_rewards
                                                            - rejected_rewards).mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
               "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean()}
    return loss, {k: float(v.detach()) for k, v in metrics.items()}


def _ours(setup, state, batch):
    """(loss, metrics, gradients of the trained parameters) of jaxtrain's DPO loss, and the
    train step's metrics on the same batch."""
    loss = setup.losses()[0]

    def objective(trained):
        base = state.frozen_params("base")
        full = trained if base is None else lora.join(base, trained)
        return loss(full, batch, 0, state.reference_params())

    with jax.set_mesh(setup.mesh):
        batch = to_global(batch, setup.tokens_sharding)
        (value, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(
            state.params)
        _, stepped = setup.train_step()(jax.tree.map(jnp.copy, state), batch)
    return float(value), jax.device_get(metrics), jax.device_get(grads), jax.device_get(
        stepped)


def _hf_llama(tmp_path, devices, cfg):
    """An HF-made Llama (random init, saved), imported into the run directory BASE."""
    torch = pytest.importorskip("torch")
    from test_convert import _hf_model

    from jaxtrain.hf.load import import_hf

    torch.manual_seed(0)
    model = _hf_model(cfg).float().eval()
    model.save_pretrained(tmp_path / "hf")
    import_hf(cfg, tmp_path / "hf", tmp_path / "base", devices[:1])
    return model


def _check_metrics(ours, theirs, stepped, loss, torch_loss, grad_norm, torch_norm):
    np.testing.assert_allclose(loss, float(torch_loss), rtol=1e-5)
    for name in DPO_METRICS:
        np.testing.assert_allclose(float(ours[name]), theirs[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_norm, torch_norm, rtol=1e-5)
    # the step differentiates the same loss and logs the same metrics
    np.testing.assert_allclose(float(stepped["loss"]), loss, rtol=1e-6)
    np.testing.assert_allclose(float(stepped["grad_norm"]), grad_norm, rtol=1e-5)
    for name in DPO_METRICS:
        np.testing.assert_allclose(float(stepped[name]), float(ours[name]), rtol=1e-5,
                                   atol=1e-7)


@pytest.mark.slow
def test_lora_dpo_equals_pytorch_with_peft_adapters_disabled_as_reference(tmp_path, devices):
    """LoRA: jaxtrain's reference is the frozen base (the same arrays); PEFT's is the model
    with its adapters disabled. Random non-zero adapters, exported to PEFT's format, so that
    both hold the same A and B: loss, rewards, gradient norm and every adapter's gradient
    equal within 1e-5."""
    torch = pytest.importorskip("torch")
    from peft import PeftModel

    from jaxtrain.hf.adapter import export_adapter, tensors

    model = _hf_llama(tmp_path, devices, small_config("llama", **SHAPE, **SYNTHETIC))
    cfg = _dpo_config(**SHAPE, **{"model.lora.rank": 4, "model.lora.alpha": 8.0,
                                  "model.lora.targets": "q,v,down",
                                  "model.lora.base": str(tmp_path / "base")})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    state = state.replace(params=jax.tree.unflatten(tree, [
        jax.device_put(0.2 * jax.random.normal(k, x.shape), x.sharding)
        for k, x in zip(keys, leaves)]))
    export_adapter(setup, state.model_params(), 0, tmp_path, tmp_path / "adapter", "float32")
    batch, docs = _pairs(np.random.default_rng(0), 4, cfg.model.seq_len, 128)
    loss, ours, grads, stepped = _ours(setup, state, batch)

    policy = PeftModel.from_pretrained(model, tmp_path / "adapter", is_trainable=True)
    policy.train()

    class Disabled(torch.nn.Module):  # the reference: the same model, adapters off
        def forward(self, **kwargs):
            with policy.disable_adapter():
                return policy(**kwargs)

    torch_loss, theirs = _torch_dpo(policy, Disabled(), docs, BETA)
    torch_loss.backward()
    trained = {n.replace(".default", ""): p for n, p in policy.named_parameters()
               if p.requires_grad}
    torch_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in trained.values())))
    _check_metrics(ours, theirs, stepped, loss, torch_loss,
                   float(optax.tree.norm(grads)), torch_norm)
    ours_by_key = tensors(setup.spec, grads)
    assert set(ours_by_key) == set(trained)
    for key, value in ours_by_key.items():
        np.testing.assert_allclose(value, trained[key].grad.numpy(), rtol=1e-4, atol=1e-6)
    # the adapters move the policy away from the reference
    assert min(abs(theirs["rewards/chosen"]), abs(theirs["rewards/rejected"])) > 1e-3


@pytest.mark.slow
def test_full_dpo_equals_pytorch_with_a_frozen_copy_as_reference(tmp_path, devices):
    """Without LoRA: the reference is train.dpo.reference's parameters, and the policy
    starts from them; one AdamW step moves the policy, then loss, rewards, gradient norm
    and the embedding and head gradients equal a PyTorch DPO (policy, deep-copied frozen
    reference) within 1e-5."""
    torch = pytest.importorskip("torch")
    model = _hf_llama(tmp_path, devices, small_config("llama", **SHAPE, **SYNTHETIC))
    cfg = _dpo_config(**SHAPE, **{"train.dpo.reference": str(tmp_path / "base"),
                                  "optimizer.lr": 3e-3, "optimizer.warmup_steps": 0})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    first, docs0 = _pairs(np.random.default_rng(1), 4, cfg.model.seq_len, 128)
    with jax.set_mesh(setup.mesh):  # one step, so that policy and reference differ
        state, _ = setup.train_step()(state, to_global(first, setup.tokens_sharding))
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                            weight_decay=0.0)
    decayed = [p for n, p in model.named_parameters()
               if n.endswith("proj.weight") or n == "lm_head.weight"]
    model.train()
    loss0, _ = _torch_dpo(model, reference, docs0, BETA)
    loss0.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
    with torch.no_grad():  # AdamW's decoupled decay on the projections and the head only
        for p in decayed:
            p.mul_(1 - o.lr * o.weight_decay)
    opt.step()
    opt.zero_grad()

    batch, docs = _pairs(np.random.default_rng(2), 4, cfg.model.seq_len, 128)
    loss, ours, grads, stepped = _ours(setup, state, batch)
    torch_loss, theirs = _torch_dpo(model, reference, docs, BETA)
    torch_loss.backward()
    torch_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
    _check_metrics(ours, theirs, stepped, loss, torch_loss,
                   float(optax.tree.norm(grads)), torch_norm)
    np.testing.assert_allclose(grads["tok_embed"],
                               model.model.embed_tokens.weight.grad.numpy(), rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(grads["lm_head"]).T,
                               model.lm_head.weight.grad.numpy(), rtol=1e-4, atol=1e-7)
    assert abs(theirs["rewards/margins"]) > 1e-4  # one step moved the policy


@pytest.mark.slow
def test_micro_batches_give_the_loss_and_grad_norm_of_one(devices):
    """Pairs of very different lengths in each micro-batch: DPO's mean is over pairs, so
    two micro-batches weigh equally (not by their counted targets)."""
    results = []
    batch, _ = _pairs(np.random.default_rng(4), 8, 48, 128)
    for micro in (1, 2):
        cfg = _dpo_config(**{**SHAPE, "train.global_batch": 8, "train.microbatches": micro,
                             "model.num_layers": 1})
        setup = build(cfg, devices[:1])
        state = setup.init_state()
        # a policy away from the reference, so that rewards are not all zero
        state = state.replace(params=jax.tree.map(lambda x: x * 1.1, state.params))
        with jax.set_mesh(setup.mesh):
            _, metrics = setup.train_step()(state, to_global(batch, setup.tokens_sharding))
        results.append([float(metrics[k]) for k in ("loss", "grad_norm", "rewards/margins",
                                                    "rewards/accuracies")])
    np.testing.assert_allclose(results[0], results[1], rtol=2e-5)
    assert results[0][2] != 0.0


@pytest.mark.slow
def test_a_dpo_run_logs_rewards_and_a_resume_refuses_another_reference(tmp_path, devices):
    from jaxtrain.metrics_log import read_metrics
    from jaxtrain.train.loop import run

    assert _prepare(_jsonl(tmp_path / "p.jsonl", _random_pairs()), tmp_path / "d") == 0
    overrides = {"model.seq_len": 192, "train.global_batch": 8, "model.num_layers": 1,
                 "eval_batches": 1, "checkpoint.every_steps": 2, "optimizer.lr": 1e-2,
                 "eval_every_steps": 2}
    cfg = _dpo_config(tmp_path / "d", family="gpt2", steps=2, **overrides)
    run(cfg, tmp_path / "run", devices[:1])
    rows = read_metrics(tmp_path / "run", say=lambda _: None)
    stepped = [r for r in rows if "rewards/chosen" in r]
    assert [r["step"] for r in stepped] == [1, 2]
    assert all(name in stepped[-1] for name in DPO_METRICS)
    assert stepped[0]["rewards/accuracies"] == 0.0  # the policy is the reference: all ties
    assert abs(rows[0]["val_loss"] - np.log(2)) < 1e-6  # the policy starts as the reference
    assert any("val_loss" in r and r["step"] == 2 for r in rows)
    _eval_reports_the_dpo_loss(tmp_path / "run", rows)
    with pytest.raises(ConfigError, match="is not the reference this run") as e:
        run(_dpo_config(tmp_path / "d", family="gpt2", steps=4, seed=5, **overrides),
            tmp_path / "run", devices[:1])
    assert "\n" not in str(e.value)
    rest = run(_dpo_config(tmp_path / "d", family="gpt2", steps=3, **overrides),
               tmp_path / "run", devices[:1])
    assert [r["step"] for r in rest if "rewards/chosen" in r] == [3]


def _eval_reports_the_dpo_loss(workdir, rows):
    """`jaxtrain eval`'s numbers on the run: its DPO val_loss (not a cross entropy), TRL's
    rewards, by pairs; the default batches (eval_batches, or what the split holds)."""
    from jaxtrain import inference
    from jaxtrain.commands import eval as eval_cmd

    _, cfg = inference.run_config(workdir)
    name, windows, _ = inference.evaluation_windows(cfg, None)
    batches = eval_cmd.batch_count(name, windows, 8, None, cfg.eval_batches)
    result = eval_cmd.evaluate_windows(inference.load(workdir, batch=8), windows, batches)
    val_loss = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    # A small split: 2 pairs, one batch of 8 rows padded with 6 empty ones (the loop's batch
    # repeats the 2 pairs 4 times: the same mean). It was refused: "fewer than 1 batches".
    assert len(windows) == 2 and batches == 1 and result["pairs"] == 2
    np.testing.assert_allclose(result["loss"], val_loss, rtol=1e-5)
    assert abs(result["loss"] - np.log(2)) > 1e-4  # trained, and no cross entropy
    assert set(result) == {"loss", *DPO_METRICS, "pairs"}
    assert eval_cmd.batch_count(name, windows, 8, None, 4) == 1  # eval_batches=4: still 1


def test_the_planner_counts_the_reference_copy_without_lora_only():
    from jaxtrain.plan.memory import estimate

    sizes = {a: 1 for a in ("data", "pipeline", "fsdp", "expert", "context", "tensor")}
    lm = estimate(small_config("llama"), sizes)
    dpo = estimate(_dpo_config(), sizes)
    assert dpo["params"] == 2 * lm["params"] and dpo["optimizer"] == lm["optimizer"]
    lora_lm = estimate(small_config("llama", **{"model.lora.rank": 4}), sizes)
    lora_dpo = estimate(_dpo_config(**{"model.lora.rank": 4}), sizes)
    assert lora_dpo["params"] == lora_lm["params"]  # the frozen base is the reference


def test_a_margin_of_float_rounding_is_a_tie_not_a_win():
    """TRL's accuracy is (chosen_rewards > rejected_rewards).mean(): at step 1 the policy is
    the reference and every margin is 0, so it is 0. Our reference and policy passes are
    compiled apart, and their sums can differ in the last bits (gpt2: margins of ~0.5
    float32 epsilons of the log-likelihoods): such a margin is a tie. A real margin, even of
    1e-4 relative, still wins."""
    from jaxtrain.objectives import dpo_loss

    rng = np.random.default_rng(0)
    policy_c, policy_r = (-rng.uniform(5, 200, 64).astype(np.float32) for _ in range(2))
    # the reference's chosen sums a last bit lower: every margin is +1 ulp
    reference_c = np.nextafter(policy_c, np.float32(-np.inf))
    assert ((policy_c - reference_c) - (policy_r - policy_r) > 0).all()
    _, tied = dpo_loss(*map(jnp.asarray, (policy_c, policy_r, reference_c, policy_r)), BETA)
    assert float(tied["rewards/accuracies"]) == 0.0
    moved = policy_c * np.float32(1 - 1e-4)  # a log-likelihood 1e-4 higher
    _, won = dpo_loss(*map(jnp.asarray, (moved, policy_r, policy_c, policy_r)), BETA)
    assert float(won["rewards/accuracies"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_mfu_credits_the_reference_forward_as_xla_counts_it(devices, lora_rank):
    """A DPO step runs the policy's forward and backward and the reference's forward (the
    frozen copy, or LoRA's base): our model FLOPs of a DPO step over an lm step of the same
    model equal the ratio of XLA's cost analysis of the two compiled steps, to 3% (no
    remat; the head is small, so DPO's recomputed head chunks stay under that). Without the
    reference's forward the ratio is 1 against XLA's ~1.3."""
    from jaxtrain.models.flops import flops_per_token

    shape = {"model.d_model": 128, "model.mlp_dim": 512, "model.vocab_size": 64,
             "model.num_heads": 4, "model.num_kv_heads": 2, "model.num_layers": 2,
             "model.seq_len": 64, "train.global_batch": 4, "model.remat": "none",
             "model.attention": "xla", "model.lora.rank": lora_rank}
    results = []
    for cfg in (small_config("llama", **shape, **SYNTHETIC), _dpo_config(**shape)):
        setup = build(cfg, devices[:1])
        with jax.set_mesh(setup.mesh):
            compiled = setup.train_step().lower(setup.abstract_step_state(),
                                                setup.abstract_batch()).compile()
        ours = flops_per_token(setup.spec, setup.objective.reference_forwards)
        results.append((compiled.cost_analysis()["flops"], ours))
    (lm_xla, lm_ours), (dpo_xla, dpo_ours) = results
    assert dpo_ours / lm_ours == pytest.approx(dpo_xla / lm_xla, rel=0.03)
