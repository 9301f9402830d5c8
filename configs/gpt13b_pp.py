"""The 13B GPT on two 8-GPU nodes (A100-80GB/H100) with pipeline parallelism across them:
2 stages over the slow inter-node links (only activations cross them), FSDP × tensor
parallel within each node, a circular schedule with 2 chunks per stage and 16 micro-batches
(bubble 1/33 ≈ 3%)."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "gpt13b", pathlib.Path(__file__).with_name("gpt13b.py"))
_gpt13b = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt13b)


def get_config():
    c = _gpt13b.get_config()
    c.name = "gpt13b_pp"
    c.mesh.dcn_pipeline = 2
    c.mesh.pipeline = 1
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 8
    c.pipeline.schedule = "circular"
    c.pipeline.repeats = 2
    c.pipeline.microbatches = 16
    c.train.global_batch = 512
    c.train.microbatches = 8
    return c
