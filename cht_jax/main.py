r"""Entry point: meta-train (or evaluate) a Continual HyperTransformer or a baseline.

  python -m cht_jax.main --config=configs/omniglot_t5.py --workdir=/tmp/cht_t5
  python -m cht_jax.main --config=configs/omniglot_t5.py:smoke --workdir=/tmp/smoke \
      --config.data.manual_dir=../shared/data/omniglot --config.train.episodes_per_step=8
  python -m cht_jax.main --config=configs/baselines_table1.py:ewc,5 --workdir=/tmp/ewc_t5
  python -m cht_jax.main --mode=eval --config=configs/omniglot_t5.py --workdir=/tmp/cht_t5 \
      [--eval_tasks=5] [--checkpoint_step=N] [--eval_split=test]   # cht_jax/evaluate.py

A workdir (default: workdirs/<config name>[_<config argument>]) with checkpoints is resumed;
one training run per workdir. Ctrl-C, like SIGTERM, checkpoints the current step and exits
(130; a second one at once).
"""

import os
import re
import sys
import threading
import traceback

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from cht_jax import config_validation
from cht_jax import evaluate
from cht_jax import train
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import preemption
from cht_jax.runtime import workdir as workdir_lib

FLAGS = flags.FLAGS
_STOPPING = threading.Lock()
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and logs go (default: '
                    'workdirs/<config name>[_<config argument>]).')
flags.DEFINE_enum('mode', 'train', ['train', 'eval'],
                  'train, or eval: the evaluation protocol on a checkpoint of --workdir.')
# --mode=eval (defaults: the paper's protocol; see cht_jax/evaluate.py). The bounds are
# checked as the flags are parsed: a mistake is named before anything is restored.
flags.DEFINE_integer('checkpoint_step', None, 'Checkpoint step to evaluate; default latest.',
                     lower_bound=0)
flags.DEFINE_integer('eval_tasks', None, 'T_eval, tasks per episode; default the trained '
                     'T, from the workdir (more extrapolates).', lower_bound=1)
flags.DEFINE_enum('eval_split', 'test', ['test', 'validation', 'train'],
                  'Classes to evaluate on (train: the generalisation gap).')
flags.DEFINE_integer('eval_episodes', 1024, 'Evaluation episodes.', lower_bound=1)
flags.DEFINE_integer('eval_query_draws', 16, 'Query draws per episode (same support set).',
                     lower_bound=1)
flags.DEFINE_integer('eval_queries_per_class', None, 'Queries per class in each draw; '
                     "default the config's episode.queries_per_class.", lower_bound=1)
flags.DEFINE_integer('eval_seed', evaluate.DEFAULT_SEED, 'Seed of the evaluation episodes.')
flags.DEFINE_integer('eval_batch_size', 8, 'Episodes per compiled call (memory only).',
                     lower_bound=1)
flags.DEFINE_enum('eval_sampler', 'strict', list(evaluate.SAMPLERS), 'Query draws: strict '
                  "(never a support image) or the original HT's (docs/evaluation.md).")
flags.DEFINE_integer('eval_specificity_pairs', 256, 'Pairs of tasks on which to measure '
                     "whether the written CNN depends on its task (own vs another task's "
                     'weights); 0: not measured.')
flags.DEFINE_enum('eval_embeddings', None, ['umap', 'pca'], 'Also plot prototypes and '
                  'queries of one episode in 2-D (umap needs umap-learn).')
# Multi-host: every process runs the same command; jax.distributed finds the others.
flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() first.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (default: '
                    'from the cluster environment).')
flags.DEFINE_integer('num_processes', None, 'Number of processes (default: from the cluster).')
flags.DEFINE_integer('process_id', None, 'This process (default: from the cluster).')
flags.DEFINE_integer('heartbeat_timeout_seconds', 100, 'With --distributed: a process silent '
                     'this long is taken for lost, and the others stop.')
flags.DEFINE_integer('coordinator_timeout_seconds', 180, 'With --distributed: how long to '
                     'wait for the coordinator and the other processes to join the job.')
flags.DEFINE_bool('accept_config_changes', False, 'Resume a workdir with --config.* overrides '
                  'that change its run from here on (recorded in config_history.jsonl); '
                  'without it only steps, cadences, data paths and compute options change.')
config_flags.DEFINE_config_file('config', None, 'A config file (see configs/).',
                                lock_config=True)
flags.mark_flags_as_required(['config'])


class ConfigFileError(Exception):
  """A config file raised, or did not compile, as it was loaded."""


def _report_load_failures(load):
  """Wraps the --config flag's loader: a failure becomes a one-line ConfigFileError."""
  def load_or_explain(argument: str):
    try:
      return load(argument)
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigFileError(_load_failure(argument.split(':', 1)[0], e)) from e
  return load_or_explain


def _load_failure(path: str, error: Exception) -> str:
  """'The config file F, line N, failed to load: ValueError: ...'."""
  # config_flags re-raises a ValueError or TypeError with the traceback as its text.
  if 'Error whilst parsing config file' in str(error) and error.__context__ is not None:
    error = error.__context__
  if isinstance(error, SyntaxError):
    where, line = error.filename, error.lineno
  else:  # The innermost frame outside the libraries: the config file, or what it called.
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(('<', sys.prefix, sys.base_prefix))]
    where, line = (frames[-1].filename, frames[-1].lineno) if frames else (path, None)
  text = ' '.join((error.msg if isinstance(error, SyntaxError) else str(error)).split())
  place = (f'{path}, line {line},' if os.path.abspath(where) == os.path.abspath(path) else
           f'{path} (at {where}, line {line})')
  return (f'The config file {place} failed to load: {type(error).__name__}: {text} '
          '(--verbosity=1 for the full traceback)')


FLAGS['config'].parser.parse = _report_load_failures(FLAGS['config'].parser.parse)


def _parse_flags(argv: list[str]) -> list[str]:
  """config_validation's flag parsing, and a config file that fails to load in one line."""
  try:
    return config_validation.flags_parser(argv)
  except ConfigFileError as e:
    if _verbose(argv[1:]):
      traceback.print_exception(e.__cause__)
    print(f'ConfigError: {e}', file=sys.stderr)
    sys.exit(1)


def _verbose(args: list[str]) -> bool:
  """Whether --verbosity=N, -v=N, --verbosity N or -v N asks for N > 0 (before absl parses)."""
  for i, arg in enumerate(args):
    flag, equals, value = arg.partition('=')
    if re.fullmatch(r'--?v(erbosity)?', flag):
      value = value if equals else (args[i + 1] if i + 1 < len(args) else '')
      if re.fullmatch(r'[1-9]\d*', value):
        return True
  return False


def default_workdir(config_flag: str) -> str:
  """'configs/omniglot_t5.py:smoke' -> 'workdirs/omniglot_t5_smoke'."""
  path, _, arg = config_flag.partition(':')
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join('workdirs', re.sub(r'[^A-Za-z0-9_.-]+', '_', f'{name}_{arg}' if arg
                                         else name))


def _say(message: str) -> None:
  """The run's last word, in one write that Orbax's shutdown output cannot split."""
  sys.stderr.write(f'\n{message}\n')
  sys.stderr.flush()


def _last_line(error: Exception, workdir: str) -> str:
  """What a process of a multi-process job says when `error` stops it."""
  if isinstance(error, devices.LostProcessError):
    error = devices.LostProcessError(
        f'{error} Stopping; the complete checkpoints in {os.path.abspath(workdir)}/'
        f'checkpoints are kept: restart all {jax.process_count()} processes with the same '
        'command to resume from the latest.')
  return f'{type(error).__name__}: {error}'


def _stop_job(error: Exception, workdir: str) -> None:
  """Ends a process of a multi-process job at once (a normal exit could wait on the others)."""
  _STOPPING.acquire()  # The watch and the main thread may both stop it: one line.
  devices.stand_down()
  _say(_last_line(error, workdir))
  os._exit(1)  # pylint: disable=protected-access


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  devices.use_cpu_cores()  # Where the CPU is the backend, each core takes its own episodes.
  checkpoints.quiet_orbax_logs(verbose=FLAGS.verbosity > 0)
  workdir = FLAGS.workdir
  if workdir is None:
    workdir = default_workdir(FLAGS['config'].config_filename)
    print(f'No --workdir given: using {os.path.abspath(workdir)}', file=sys.stderr, flush=True)
  if FLAGS.distributed:
    devices.initialize_distributed(
        FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
        FLAGS.heartbeat_timeout_seconds, FLAGS.coordinator_timeout_seconds,
        stop=lambda error: _stop_job(error, workdir),
        last_line=lambda error: _last_line(error, workdir))
  logging.info('JAX %s, process %d/%d, devices: %s', jax.__version__,
               jax.process_index(), jax.process_count(), jax.devices())
  try:
    config = config_validation.validate(FLAGS.config)
    # The workdir's record is the run's config (runtime/workdir.py).
    config = config_validation.validate(workdir_lib.run_config(
        workdir, config, FLAGS.mode, config_flags.get_override_values(FLAGS['config']),
        FLAGS.accept_config_changes))
    logging.info('Config:\n%s', config)
    if FLAGS.mode == 'eval':
      evaluate.evaluate_checkpoint(
          config, workdir, step=FLAGS.checkpoint_step, num_tasks=FLAGS.eval_tasks,
          split=FLAGS.eval_split, num_episodes=FLAGS.eval_episodes,
          num_query_draws=FLAGS.eval_query_draws,
          queries_per_class=FLAGS.eval_queries_per_class, seed=FLAGS.eval_seed,
          batch_size=FLAGS.eval_batch_size, embeddings=FLAGS.eval_embeddings,
          sampler=FLAGS.eval_sampler, specificity_pairs=FLAGS.eval_specificity_pairs)
    else:
      train.train_and_evaluate(config, workdir)
  except Exception as e:  # pylint: disable=broad-except
    if devices.lost_process(e):  # Checked first: a peer's loss can break a save too.
      _stop_job(e if isinstance(e, devices.LostProcessError) else
                devices.lost_process_error(str(e)), workdir)
    if isinstance(e, train.USER_ERRORS):  # Their message says what is wrong and what to do.
      if jax.process_count() > 1:  # The others may wait for this one in a collective.
        _stop_job(e, workdir)
      _say(f'{type(e).__name__}: {e}')
      return 1
    if isinstance(e, preemption.Preempted):
      _say(f'{e.label}: {e}')
      return e.exit_code
    raise
  except KeyboardInterrupt:  # Ctrl-C before the run's SignalFlag: nothing to save.
    print('Interrupted before the evaluation started; no result file was written.'
          if FLAGS.mode == 'eval' else
          'Interrupted before training started; no checkpoint was written by this run.',
          file=sys.stderr)
    return preemption.INTERRUPTED_EXIT_CODE


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main, flags_parser=_parse_flags)
