"""Shared by the tests against transformers' models and a plain PyTorch loop: a tiny random
transformers model, its import, the logits of both sides, and the PyTorch side of the
N-step training parity tests. torch and transformers are imported inside the functions."""

import math

import jax
import numpy as np
from flax import nnx

# The 20-step training parity tests' run (loss and gradient norm of each step, jaxtrain's
# against PyTorch's): a small vocabulary, synthetic rows, a short warm-up, a learning rate
# and clipping that move the weights.
TWENTY_STEPS = {"model.vocab_size": 128, "data.source": "synthetic", "train.global_batch": 4,
                "steps": 20, "optimizer.warmup_steps": 5, "optimizer.lr": 3e-3,
                "optimizer.clip_norm": 0.5}


def hf_logits(model, tokens):
    """A transformers model's logits of `tokens` (numpy)."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def jax_logits(setup, params, tokens):
    """jaxtrain's logits of `tokens` under setup's mesh."""
    with jax.set_mesh(setup.mesh):
        forward = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))
        return np.asarray(forward(params, tokens))


def random_tokens(cfg, batch: int = 8):
    """`batch` rows of cfg's length, random over its vocabulary (seeded)."""
    return np.random.default_rng(1).integers(0, cfg.model.vocab_size, (batch, cfg.model.seq_len))


def randomized(model, seed: int = 0, std=0.1, around_one=("norm.weight",)):
    """`model` (a transformers model) with each weight drawn N(0, std) in turn, seeded (std:
    a number, or a function of the parameter's name), and those whose names end with
    `around_one` (the norms' scales) moved to around 1, so that a misplaced or dropped
    tensor shows; float32, in eval mode."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std(name) if callable(std) else std)
            if name.endswith(around_one):
                p.add_(1.0)
    return model.float().eval()


def imported(cfg, model, tmp_path, devices):
    """(setup, state) of `model` saved to tmp_path/hf and imported (`convert --from-hf`)
    into the run tmp_path/run on `devices`."""
    from jaxtrain.hf.load import import_hf

    model.save_pretrained(tmp_path / "hf")
    return import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices)


def logits_against(model, setup, params, tokens):
    """(transformers' logits of `tokens`, the largest |Δ| of jaxtrain's from them)."""
    want = hf_logits(model, tokens)
    return want, float(np.abs(jax_logits(setup, params, tokens) - want).max())


def imported_logit_error(cfg, model, tmp_path, devices, batch: int = 4) -> float:
    """The largest |Δ| of jaxtrain's logits of `batch` random rows from transformers', once
    `model` is imported under cfg on `devices` (`imported`)."""
    setup, state = imported(cfg, model, tmp_path, devices)
    return logits_against(model, setup, state.params, random_tokens(cfg, batch))[1]


def lr_at(step, cfg):
    """optim.make_schedule's warm-up and cosine, written out for the PyTorch loop."""
    o, warmup = cfg.optimizer, cfg.optimizer.warmup_steps
    if step < warmup:
        return o.lr / warmup + (o.lr - o.lr / warmup) * step / warmup
    t, steps = step - warmup, cfg.steps - warmup
    return o.lr * ((1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
                   + o.min_lr_ratio)


def decay_groups(model, decays, weight_decay):
    """AdamW's parameter groups: the parameters whose names `decays` picks, decayed by
    `weight_decay`, then the rest, not decayed."""
    decay = [p for n, p in model.named_parameters() if decays(n)]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def next_token_loss(model, tokens, **forward):
    """(transformers' forward of `tokens` but the last, the mean cross entropy of the next
    token over every target)."""
    import torch

    tokens = torch.from_numpy(tokens.astype(np.int64))
    out = model(input_ids=tokens[:, :-1], **forward)
    return out, torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), tokens[:, 1:])


def torch_steps(model, batches, cfg, groups, loss_of):
    """(loss, gradient norm) of each step of a plain PyTorch loop over `batches`:
    `loss_of(model, batch)` gives (the loss logged, the loss differentiated);
    torch.optim.AdamW over the parameter `groups` with cfg.optimizer's betas and eps,
    global-norm clipping at its clip_norm, jaxtrain's schedule (`lr_at`)."""
    import torch

    o = cfg.optimizer
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
    model.train()
    out = []
    for step, batch in enumerate(batches):
        logged, loss = loss_of(model, batch)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        out.append((float(logged.detach()), float(norm)))
    return out
