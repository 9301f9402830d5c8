"""The planner's calibration pipeline: the compiles and fits behind plan/*.json, each a
module run as `python -m jaxtrain.plan.calibrate.NAME` (docs/planner.md):

- memory_check: the memory estimate against XLA:CPU's compiled step (CI runs it);
  --update stores the compiled figures in plan/memory_fit.json;
- tpu_aot_check: compiles for TPU topologies through libtpu, with no TPU (offload, splash,
  MoE, long context; --plan: the published TPU layouts for plan/memory_fit.json);
- fit_memory: fits the memory estimate's factors on those figures;
- fit_planner: fits the time model on published runs (plan/calibration.json);
- plan_vs_compiler: the estimate against XLA on the test grid (plan/grid.py).

Nothing in the package imports these: they write what the planner reads. This file stays
free of imports, because tpu_aot_check and plan_vs_compiler set up jax's environment
before jax loads.
"""

import os

# The repository's root: the configs these compile (configs/*.py) live beside the package,
# so the pipeline runs from a source checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
