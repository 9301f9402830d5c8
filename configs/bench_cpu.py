"""The CPU benchmark model (scripts/bench_train.py): GPT-2 style, 512 wide, 8 layers, float32."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "bench_cpu"
    c.steps = 20
    c.model.update(family="gpt2", d_model=512, num_layers=8, num_heads=8, mlp_dim=2048,
                   vocab_size=32000, seq_len=512)
    c.train.global_batch = 8
    c.train.precision = "float32"
    c.data.source = "synthetic"
    return c
