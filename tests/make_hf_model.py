"""A small randomly initialised Hugging Face GPT-2 or Llama, saved with save_pretrained: the
fixture of docs/interop.md's worked examples (tests/parity/test_make_hf_model.py imports it).

    python tests/make_hf_model.py --family llama --out /tmp/hf_llama [--tied]
    python tests/make_hf_model.py --family gpt2 --out /tmp/hf_gpt2 --max_shard_size 500KB

The defaults match configs/tiny.py's shapes (4 layers, d_model 128, 4 heads, MLP 512, byte
vocabulary 256, seq 128); Llama gets 2 kv heads and, with --tied, a head tied to its
embedding table. `jaxtrain convert --from-hf DIR --workdir RUN` imports either with no
--config (the model config is config.json's). Needs torch and transformers (the `test`
extra); nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
import transformers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["gpt2", "llama"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2, help="Llama only")
    p.add_argument("--mlp_dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--norm_eps", type=float, default=1e-5)  # jaxtrain's default
    p.add_argument("--rope_theta", type=float, default=10000.0, help="Llama only")
    p.add_argument("--tied", action="store_true", help="Llama only: tie_word_embeddings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_shard_size", default="2GB")
    a = p.parse_args(argv)

    torch.manual_seed(a.seed)
    if a.family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=a.d_model, n_layer=a.layers, n_head=a.heads, n_inner=a.mlp_dim,
            vocab_size=a.vocab, n_positions=a.seq_len, layer_norm_epsilon=a.norm_eps,
            bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=a.d_model, num_hidden_layers=a.layers, num_attention_heads=a.heads,
            num_key_value_heads=a.kv_heads, intermediate_size=a.mlp_dim, vocab_size=a.vocab,
            max_position_embeddings=a.seq_len, rms_norm_eps=a.norm_eps,
            rope_theta=a.rope_theta, tie_word_embeddings=a.tied, bos_token_id=0,
            eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(a.out, max_shard_size=a.max_shard_size)
    count = model.num_parameters()  # a tied table once
    print(f"saved a random {type(model).__name__} ({count:,} parameters) to {a.out}")


if __name__ == "__main__":
    main()
