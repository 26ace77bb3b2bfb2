#!/bin/bash
# Multi-host data-parallel training on a Cloud TPU VM slice: the same command on every
# worker; jax.distributed.initialize() finds the other workers through the TPU metadata.
#
#   launch/tpu_vm.sh my-tpu us-central2-b configs/omniglot_t5.py gs://bucket/workdirs/t5 \
#       --config.train.episodes_per_step=256
set -euo pipefail
tpu=${1:?usage: launch/tpu_vm.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]}
zone=${2:?}; config=${3:?}; workdir=${4:?}
shift 4
gcloud compute tpus tpu-vm ssh "${tpu}" --zone="${zone}" --worker=all --command="
  cd ~/cht_jax && pip install -q -e . 'jax[tpu]' &&
  python -m cht_jax.main --config=${config} --workdir=${workdir} --distributed $*"
