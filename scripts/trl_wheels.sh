#!/usr/bin/env bash
# Downloads (on the CPU machine, which reaches PyPI) the wheels TRL 1.16.0's GRPO path needs on
# the GPU device machine beyond its image, into .whl_trl/ (pyarrow, with PYARROW=1, into
# .whl_trl_pyarrow/; both kept out of git); scripts/gpu_trl.sh installs them there with
# `pip install --no-index --no-deps --target /tmp/trl_site`.
#
#   bash scripts/trl_wheels.sh            # from the project root; a few seconds, 2.4 MB
#   PYARROW=1 bash scripts/trl_wheels.sh  # also pyarrow (~55 MB, into .whl_trl_pyarrow/)
#
# The list, read from the dependency metadata (Requires-Dist) of trl 1.16.0, datasets 5.2.0 and
# accelerate 1.15.0, against the device image's package list (.library device notes, KINDS.md):
#   trl 1.16.0       accelerate>=1.10.1 datasets>=4.7.0 huggingface_hub>=0.34 jinja2 numpy
#                    packaging pandas>=2.1.1 psutil pyarrow>=21 pyyaml transformers>=4.56.2
#   datasets 5.2.0   filelock numpy pyarrow>=24 dill<0.4.2 pandas tqdm xxhash
#                    multiprocess<0.70.20 fsspec<=2026.9.0 huggingface-hub>=1.31,<3 packaging pyyaml
#   accelerate 1.15  numpy packaging psutil pyyaml torch huggingface_hub safetensors
# The image has accelerate (1.15.0 seen), pandas, pyarrow, psutil, jinja2, pyyaml, tqdm, filelock,
# fsspec, xxhash, huggingface-hub (1.33.0 seen), safetensors, transformers 5.17, numpy, torch.
# Missing there: trl, datasets, dill, multiprocess (all pure Python). Carried as well, pinned to
# the versions the CPU tests run: accelerate (same as the image's, so the import is known) and
# fsspec (datasets caps it at 2026.9.0; the image's version is not known). pyarrow only with
# PYARROW=1: datasets 5.2.0 wants >= 24 and the image's version is not known (gpu_trl.sh prints
# it); TRL imports datasets (and pyarrow) at import, and GRPOTrainer takes only a
# datasets.Dataset / IterableDataset as train_dataset, so neither can be left out.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl_trl}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_28_x86_64 --platform any)
WHEELS="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 accelerate==1.15.0
fsspec==2026.9.0"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT" $WHEELS
dirs=("$OUT")
if [ "${PYARROW:-0}" = 1 ]; then
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT"_pyarrow pyarrow==26.0.1
  dirs+=("$OUT"_pyarrow)
fi
ls -l "${dirs[@]}"
du -cb "${dirs[@]/%//}"*.whl | tail -1
