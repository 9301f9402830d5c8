#!/usr/bin/env bash
# Wheels for the lent GPU machine, which has jax (CUDA), flax, optax, orbax and tensorstore
# in its image but no network (docs: /work/.library/device): the few pure-Python packages
# jaxtrain needs beyond them, for its Python 3.12, into .whl/ (git-ignored; carry it):
#   bash scripts/accelerator/gpu_wheels.sh        # here, where pip reaches PyPI
# then on the device: bash scripts/accelerator/gpu_check.sh OUT  (it installs .whl/ when jax
# sees a GPU)
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: .whl/ is there
mkdir -p .whl
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  PLATFORMS="$PLATFORMS --platform $p"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLATFORMS -d .whl \
  'grain==0.2.18' 'array-record>=0.5' 'portpicker' 'ml-collections>=1.0' 'tensorboardX>=2.6'
ls -la .whl
