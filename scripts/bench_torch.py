"""The PyTorch peer of scripts/bench_train.py: the same model shape in plain PyTorch, eager and
torch.compile, on the same synthetic batches, timed the same way (2 warm-up steps, the median
of the timed ones, the optimizer step included).

    python scripts/bench_torch.py --config configs/bench_cpu.py [--config.KEY=VALUE ...]
        [--mode eager|compile] [--steps 5] [--json]

`scripts/bench_train.py --config ... --against torch` runs this beside jaxtrain's own figure and
prints the ratios. The model follows the config's family: GPT-2 (LayerNorm with biases,
learned positions, tanh-GELU MLP, tied head) or Llama (RMSNorm, RoPE, SwiGLU, grouped K/V,
separate head); attention is torch's scaled_dot_product_attention with the causal flag, the
optimizer torch's AdamW (foreach) after global-norm clipping, as jaxtrain's optax chain.
The test extra installs torch; the jaxtrain package itself never imports it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_MODE = flags.DEFINE_enum("mode", "compile", ["eager", "compile"], "PyTorch execution mode.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of lines.")
flags.mark_flags_as_required(["config"])


def _modules():
    """The model classes, defined once torch is imported (absl parses flags first)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d: int, eps: float):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Block(nn.Module):
        def __init__(self, m, llama: bool, cos_sin):
            super().__init__()
            d, h, g, k = m.d_model, m.num_heads, m.num_kv_heads or m.num_heads, m.head_dim
            self.h, self.g, self.k, self.llama, self.cos_sin = h, g, k, llama, cos_sin
            norm = (lambda: RMSNorm(d, m.norm_eps)) if llama else (
                lambda: nn.LayerNorm(d, eps=m.norm_eps))
            self.norm1, self.norm2 = norm(), norm()
            self.qkv = nn.Linear(d, (h + 2 * g) * k, bias=not llama)
            self.out = nn.Linear(h * k, d, bias=not llama)
            self.up = nn.Linear(d, m.mlp_dim * (2 if llama else 1), bias=not llama)
            self.down = nn.Linear(m.mlp_dim, d, bias=not llama)

        def attend(self, x_BLD):
            B, L, _ = x_BLD.shape
            q, k, v = self.qkv(x_BLD).split([self.h * self.k, self.g * self.k,
                                             self.g * self.k], dim=-1)
            q, k, v = (t.view(B, L, -1, self.k).transpose(1, 2) for t in (q, k, v))
            if self.llama:
                q, k = _rotate(q, *self.cos_sin), _rotate(k, *self.cos_sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=self.g != self.h)
            return self.out(o.transpose(1, 2).reshape(B, L, -1))

        def forward(self, x_BLD):
            x_BLD = x_BLD + self.attend(self.norm1(x_BLD))
            h_BLF = self.up(self.norm2(x_BLD))
            if self.llama:
                gate, up = h_BLF.chunk(2, dim=-1)
                h_BLF = F.silu(gate) * up
            else:
                h_BLF = F.gelu(h_BLF, approximate="tanh")
            return x_BLD + self.down(h_BLF)

    def _rotate(x, cos, sin):  # rotate-half RoPE, as jaxtrain's Llama
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class GPT(nn.Module):
        def __init__(self, m, llama: bool):
            super().__init__()
            self.llama = llama
            self.embed = nn.Embedding(m.vocab_size, m.d_model)
            if not llama:
                self.pos = nn.Embedding(m.seq_len, m.d_model)
            cos_sin = _rope(m) if llama else None
            self.blocks = nn.ModuleList(Block(m, llama, cos_sin) for _ in range(m.num_layers))
            self.norm = RMSNorm(m.d_model, m.norm_eps) if llama else nn.LayerNorm(
                m.d_model, eps=m.norm_eps)
            self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)
            if not llama:
                self.head.weight = self.embed.weight
            for p in self.parameters():  # GPT-2's initialisation, as jaxtrain's (scale only)
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens_BL):
            x = self.embed(tokens_BL[:, :-1])
            if not self.llama:
                x = x + self.pos.weight[: x.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.flatten(0, 1), tokens_BL[:, 1:].flatten())

    def _rope(m):
        inv = 1.0 / m.rope_theta ** (torch.arange(0, m.head_dim, 2).float() / m.head_dim)
        angles = torch.outer(torch.arange(m.seq_len).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    return GPT


def _spec(cfg):
    """The model's shape, as jaxtrain resolves it (head_dim, kv heads, family fields)."""
    from jaxtrain.models.families import FAMILIES
    from jaxtrain.models.transformer import ModelSpec

    spec = ModelSpec.from_config(cfg)
    if spec.moe is not None or spec.lora is not None or spec.sliding_window:
        sys.exit("bench_torch: error: the PyTorch peer is a dense model without LoRA or a "
                 "sliding window; model.moe, model.lora and model.sliding_window must be unset")
    return spec, FAMILIES[cfg.model.family].rope


def _batches(cfg):
    """Two of jaxtrain's own training batches (rows of seq_len + 1 tokens), as torch tensors."""
    import numpy as np
    import torch

    from jaxtrain.data.batches import make_batches

    rows = make_batches(cfg).train_iter(0)
    return [torch.from_numpy(np.asarray(next(rows)).astype(np.int64)) for _ in range(2)]


def bench(cfg, mode: str, steps: int) -> dict:
    import torch

    from jaxtrain.models.flops import flops_per_token

    torch.manual_seed(cfg.seed)
    spec, llama = _spec(cfg)
    model = _modules()(spec, llama)
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)

    def step(tokens):
        loss = model(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = torch.compile(step) if mode == "compile" else step
    batches = _batches(cfg)
    t0 = time.perf_counter()
    for i in range(2):
        run(batches[i % 2])
    warmup_s = time.perf_counter() - t0
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = run(batches[i % 2]).item()
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    return {"impl": f"torch {mode}", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "tokens_per_s": tokens / step_time,
            "step_time_s": step_time, "step_time_min_s": min(times),
            "model_tflops": flops_per_token(spec) * tokens / step_time / 1e12,
            "warmup_s": warmup_s, "loss": loss if math.isfinite(loss) else None}


def main(argv) -> None:
    del argv
    result = bench(_CONFIG.value, _MODE.value, _STEPS.value)
    if _JSON.value:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>16}: {value:.4g}" if isinstance(value, float) else f"{key:>16}: {value}")


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(
        __import__("os").path.abspath(__file__))))
    from jaxtrain.commands.common import parse_flags

    app.run(main, flags_parser=parse_flags)
