r"""Entry point: meta-train a Continual HyperTransformer.

  python -m cht_jax.main --config=configs/omniglot_t5.py --workdir=/tmp/cht_t5
  python -m cht_jax.main --config=configs/omniglot_t5.py:smoke --workdir=/tmp/smoke \
      --config.data.manual_dir=../shared/data/omniglot --config.train.episodes_per_step=8

A workdir that already holds checkpoints is resumed from the latest one.
"""

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from cht_jax import train

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and logs go.')
flags.DEFINE_enum('mode', 'train', ['train'], 'What to run.')
config_flags.DEFINE_config_file('config', None, 'A config file (see configs/).',
                                lock_config=True)
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.info('JAX %s, process %d/%d, devices: %s', jax.__version__,
               jax.process_index(), jax.process_count(), jax.devices())
  logging.info('Config:\n%s', FLAGS.config)
  train.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main)
