"""The 13B GPT on two 8-GPU nodes (A100-80GB/H100) with pipeline parallelism across them:
2 stages over the slow inter-node links (only activations cross them), tensor parallel
within each node, GPipe with 16 micro-batches (bubble 1/17 ≈ 6%)."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("gpt13b.py"))
    c.name = "gpt13b_pp"
    # The stages across the nodes; gpt13b's tensor=8 within each node, no FSDP.
    c.mesh.update(dcn_pipeline=2, pipeline=1, fsdp=1)
    c.pipeline.schedule = "gpipe"
    c.pipeline.repeats = 1
    # gpt13b's 1M-token batches, 8 accumulation steps of 64 sequences, each piped as 16
    # micro-batches of 4.
    c.pipeline.microbatches = 16
    return c
