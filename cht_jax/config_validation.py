"""Start-up checks of a config: every mistake named before anything is compiled or downloaded.

`validate(config)` checks each field against `SCHEMA` (add new fields there; unknown ones are
typos), then relations between fields (an episode's classes against the split's, by
`episodes.spec_problems`; image size against CNN depth; ...), and raises one `ConfigError`
naming every problem. `flags_parser` reports bad `--config.*` overrides and config files the
same way.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from typing import Any, Callable, Sequence

from absl import flags
import ml_collections

from cht_jax import continual
from cht_jax import losses
from cht_jax import optim
from cht_jax.data import datasets
from cht_jax.data import episodes
from cht_jax.data import multidomain
from cht_jax.data import omniglot
from cht_jax.models import cnn
from cht_jax.models import ops
from cht_jax.models import transformer

# `config.method`: the first three train on an episode loss, the others by gradient steps.
EPISODE_LOSS_METHODS = ('cht', 'constpn', 'merged_ht')
METHODS = EPISODE_LOSS_METHODS + ('finetune', 'ewc', 'maml')
ON_DIVERGENCE = ('stop', 'skip')

Check = Callable[[Any], str | None]  # A value -> what would be valid, or None if it is.


class ConfigError(ValueError):
  """A config field has a wrong value, or fields contradict each other."""


def _integer(minimum: int, why: str = '') -> Check:
  """An integer >= minimum; `why` (' (...)') says what a smaller one would do."""
  def check(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    return None if ok else f'an integer >= {minimum}{why}'
  return check


def _number(minimum: float, inclusive: bool = False, maximum: float | None = None) -> Check:
  """A finite number > minimum (>= if inclusive), and < maximum if given."""
  bounds = f'{">=" if inclusive else ">"} {minimum:g}'
  if maximum is not None:
    bounds += f' and < {maximum:g}'

  def check(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return f'a number {bounds}'
    ok = (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
          and (maximum is None or value < maximum))
    return None if ok else f'a finite number {bounds}'
  return check


def _off_or_above(minimum: float) -> Check:
  """0 (off), or a finite number > minimum."""
  above = _number(minimum)
  return lambda value: (None if value == 0 and not isinstance(value, bool) or above(value) is None
                        else f'0 (off) or a finite number > {minimum:g}')


def _choice(options: Sequence[Any]) -> Check:
  return lambda value: None if value in options else f'one of {tuple(options)}'


def _boolean(value) -> str | None:
  return None if isinstance(value, bool) else 'True or False'


def _remat(value) -> str | None:
  try:
    continual.remat_option(value, vectorize=True, num_tasks=1)
  except ValueError:
    return f'one of {continual.REMAT_OPTIONS}'
  return None


def _string(value) -> str | None:
  return None if isinstance(value, str) else "a string ('' for the default)"


def _between(low: float, high: float, low_open: bool = False) -> Check:
  """A number in [low, high] ((low, high] if low_open)."""
  bounds = f'{"(" if low_open else "["}{low:g}, {high:g}]'

  def check(value):
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and
          math.isfinite(value) and (value > low if low_open else value >= low)
          and value <= high)
    return None if ok else f'a number in {bounds}'
  return check


def _domains(value) -> str | None:
  ok = (isinstance(value, (tuple, list)) and len(value) >= 1 and
        len(set(value)) == len(value) and all(v in multidomain.DOMAINS for v in value))
  return None if ok else f'a non-empty tuple of distinct names from {multidomain.DOMAINS}'


def _fractions(value) -> str | None:
  ok = (isinstance(value, (tuple, list)) and len(value) == 3 and
        all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for v in value) and value[0] > 0 and abs(sum(value) - 1) < 1e-6)
  return None if ok else ('three fractions (train, validation, test) >= 0 adding up to 1, '
                          'train > 0')


SCHEMA: dict[str, Check] = {
    'seed': _integer(0),
    'data.dataset': _choice(datasets.DATASETS),
    'data.pipeline': _choice(datasets.PIPELINES),
    'data.data_dir': _string,
    'data.manual_dir': _string,
    'data.split_scheme': _choice(omniglot.SPLIT_SCHEMES),
    'data.split_seed': _integer(0),
    'data.image_size': _integer(1),
    'data.rotate': _boolean,
    'data.images_per_class': _integer(1),
    'data.check_class_counts': _boolean,
    'data.binarize': _boolean,
    'data.domains': _domains,
    'data.domain_split': _fractions,
    'data.augment.flip': _boolean,
    'data.augment.hue': _between(0, 0.5),
    'data.augment.brightness': _between(0, 1),
    'data.augment.contrast': _between(0, 1),
    'data.augment.crop_min_scale': _between(0, 1, low_open=True),
    'episode.num_tasks': _integer(1),
    # One way per task is degenerate at any T: at T=1 the loss and its gradient are 0 at every
    # step; at T>1 the task-incremental loss (eq. 5) still is and each task's own accuracy is
    # 1, so the class-incremental loss only asks which task an image came from.
    'episode.ways': _integer(2, ' (with one class per task every query has a single possible '
                            'label: the loss is 0 and the accuracy 1 whatever the model, so '
                            'nothing is learnt)'),
    'episode.shots': _integer(1),
    'episode.queries_per_class': _integer(1),
    'episode.task_classes': _choice(episodes.TASK_CLASSES),
    'episode.unlabeled_per_class': _integer(0),
    'episode.independent_draws': _boolean,
    'model.channels': _integer(1),
    'model.num_blocks': _integer(1),
    'model.cnn_embedding_dim': _integer(1),
    'model.embedding_dim': _integer(1),
    'model.image_features': _integer(1),
    'model.activation_features': _integer(1),
    'model.num_layers': _integer(1),
    'model.num_heads': _integer(1),
    'model.query_key_fraction': _number(0),
    'model.value_fraction': _number(0),
    'model.inner_fraction': _number(0),
    'model.activation': _choice(tuple(transformer.ACTIVATIONS)),
    'model.generate_bn': _boolean,
    'model.head_scale': _number(0, inclusive=True),
    'model.learned_base': _number(0, inclusive=True),
    'model.trained_layers': _integer(-1_000_000),
    'model.feature_norm': _boolean,
    'model.conv_impl': _choice(ops.CONV_IMPLS),
    'model.compute_dtype': _choice(ops.COMPUTE_DTYPES),
    'model.encoder_impl': _choice(transformer.ENCODER_IMPLS),
    'model.remat': _remat,
    'model.vectorize': _choice(continual.VECTORIZE_OPTIONS),
    'loss': _choice(losses.LOSSES),
    'method': _choice(METHODS),
    'constpn_ways_multiplier': _integer(1),
    'optim.name': _choice(optim.OPTIMIZERS),
    'optim.learning_rate': _number(0),
    'optim.decay_rate': _number(0),
    'optim.decay_steps': _integer(1),
    'optim.momentum': _number(0, inclusive=True, maximum=1),
    'optim.schedule': _choice(optim.SCHEDULES),
    'optim.warmup_steps': _integer(0),
    'optim.end_fraction': _number(0, inclusive=True, maximum=1),
    'optim.weight_decay': _number(0, inclusive=True),
    'optim.grad_clip_norm': _number(0, inclusive=True),
    'train.num_steps': _integer(1),
    'train.episodes_per_step': _integer(1),
    'train.log_every_steps': _integer(1),
    'train.checkpoint_every_steps': _integer(1),
    'train.keep_checkpoints': _integer(1),
    'train.eval_every_steps': _integer(0),
    'train.eval_episodes': _integer(1),
    'train.on_divergence': _choice(ON_DIVERGENCE),
    'train.loss_spike_factor': _off_or_above(1),
    # Table 1 baselines trained by gradient descent (cht_jax/methods).
    'baseline.inner_steps': _integer(1),
    'baseline.inner_learning_rate': _number(0),
    'baseline.head_init': _choice(('zeros', 'glorot')),
    'baseline.pretrain_batch_size': _integer(1),
    'baseline.ewc_lambda': _number(0, inclusive=True),
    'baseline.ewc_fisher': _choice(('empirical', 'true')),
    'baseline.maml_learn_inner_lr': _boolean,
    'baseline.maml_first_order_steps': _integer(0),
    'baseline.maml_multi_step_loss': _boolean,
    'baseline.maml_msl_anneal_steps': _integer(1),
    'baseline.maml_cosine_annealing': _boolean,
    'baseline.maml_min_learning_rate': _number(0, inclusive=True),
}


def _leaves(config: ml_collections.ConfigDict, prefix: str = '') -> dict[str, Any]:
  """Dotted path -> value of every non-ConfigDict field."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_leaves(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _did_you_mean(path: str, known: Sequence[str]) -> str:
  close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
  if close:
    return f'did you mean {close[0]}?'
  section = path.rsplit('.', 1)[0] + '.' if '.' in path else ''
  siblings = sorted(k for k in known if k.startswith(section) and '.' not in k[len(section):])
  return f'the known fields there are {", ".join(siblings) or "none"}.'


def _field_problems(values: dict[str, Any]) -> list[str]:
  problems = []
  for path, check in SCHEMA.items():
    if path not in values:
      problems.append(f'{path} is missing: it must be {check(None) or "set"}.')
      continue
    expected = check(values[path])
    if expected:
      problems.append(f'{path} = {values[path]!r}: must be {expected}.')
  for path in sorted(values.keys() - SCHEMA.keys()):
    problems.append(f'{path} = {values[path]!r} is not a known config field; '
                    + _did_you_mean(path, list(SCHEMA)))
  return problems


def _episode_problems(c: ml_collections.ConfigDict) -> list[str]:
  """Classes and images an episode needs against those of the splits."""
  images_per_class, images = _images_per_class(c)
  return (_dataset_problems(c) + _split_problems(c) + episodes.spec_problems(
      datasets.episode_spec(c), images_per_class=images_per_class, images=images))


def _split_problems(c: ml_collections.ConfigDict) -> list[str]:
  """Classes (and domains) an episode needs against those of each split sampled."""
  spec = datasets.episode_spec(c)
  if spec.task_classes == 'domain' and c.data.dataset != 'multidomain':
    return []  # No domains to check against (named by _dataset_problems).
  problems = []
  for split, (num_classes, domain_sizes) in _split_classes(c).items():
    split_spec = spec._replace(domain_sizes=domain_sizes)
    remedy = _remedy(spec.task_classes, split)
    if split == 'validation' and spec.task_classes == 'disjoint':
      # Validation runs as many tasks as its classes allow (train.validation_tasks).
      split_spec = split_spec._replace(num_tasks=1)
    if split == 'train' and c.method == 'constpn':
      # ConstPN trains on single tasks of multiplier * K ways (methods/constpn.py).
      split_spec = split_spec._replace(num_tasks=1,
                                       ways=c.episode.ways * c.constpn_ways_multiplier)
      remedy = 'lower constpn_ways_multiplier'
    problems += episodes.spec_problems(
        split_spec, num_classes, split=f'the {split!r} split of {_split_name(c)}',
        remedy=remedy)
  return problems


def _remedy(task_classes: str, split: str) -> str:
  """What to change when a split has too few classes or domains for an episode."""
  if task_classes == 'domain':
    remedy = 'add domains, or lower episode.num_tasks or episode.ways'
  else:
    remedy = "lower episode.ways or episode.num_tasks, or use episode.task_classes='same'"
  if split == 'validation':
    remedy += (', or set train.eval_every_steps=0 to skip validation during training '
               '(evaluate on the test split afterwards)')
  return remedy


def nominal_split_classes(c: ml_collections.ConfigDict) -> dict[str, tuple[int, tuple[int, ...]]]:
  """(classes, domain sizes) of the 'train', 'validation' and 'test' splits from the config
  alone: nominal counts (loading may drop classes with too few images); no empty domains."""
  data = c.data
  if data.dataset == 'omniglot':
    ids = omniglot.class_split(data.split_scheme, data.split_seed)
    return {s: (len(ids[s]), ()) for s in ('train', 'validation', 'test')}
  if data.dataset == 'tiered_imagenet':
    from cht_jax.data import tiered_imagenet  # pylint: disable=g-import-not-at-top
    return {s: (n, ()) for s, n in tiered_imagenet.SPLIT_CLASSES.items()}
  per_domain = zip(*(multidomain.split_sizes(multidomain.NUM_CLASSES[name], data.domain_split)
                     for name in data.domains))
  sizes = {s: tuple(n for n in counts if n) for s, counts in zip(multidomain.SPLITS, per_domain)}
  return {s: (sum(sizes[s]), sizes[s]) for s in multidomain.SPLITS}


def _split_classes(c: ml_collections.ConfigDict) -> dict[str, tuple[int, tuple[int, ...]]]:
  """(classes, domain sizes) of the splits training samples; {} if unknown."""
  if c.data.dataset == 'tiered_imagenet' and not c.data.check_class_counts:
    return {}
  splits = ('train', 'validation') if c.train.eval_every_steps else ('train',)
  counts = nominal_split_classes(c)
  return {s: counts[s] for s in splits}


def _images_per_class(c: ml_collections.ConfigDict) -> tuple[int, str]:
  """(images of each class an episode can draw from, what the message says of them)."""
  if c.data.dataset == 'omniglot':
    n = omniglot.IMAGES_PER_CLASS
    return n, f'Omniglot has {n} per class'
  # Validation (and, with the device pipeline, training) classes keep that many images.
  n = c.data.images_per_class
  return n, (f'data.images_per_class = {n} images are kept per class (raise it, or lower '
             'episode.queries_per_class)')


def _split_name(c: ml_collections.ConfigDict) -> str:
  if c.data.dataset == 'omniglot':
    return f'data.split_scheme={c.data.split_scheme!r}'
  if c.data.dataset == 'multidomain':
    return (f'data.domains={tuple(c.data.domains)} with '
            f'data.domain_split={tuple(c.data.domain_split)}')
  return 'tieredImageNet'


def _dataset_problems(c: ml_collections.ConfigDict) -> list[str]:
  """Dataset, pipeline and sampler options that do not go together."""
  data, problems = c.data, []
  if data.pipeline == 'host' and data.dataset not in datasets.HOST_PIPELINE_DATASETS:
    problems.append(f"data.pipeline = 'host' is implemented for data.dataset in "
                    f"{datasets.HOST_PIPELINE_DATASETS}, not {data.dataset!r}: use "
                    "data.pipeline = 'device'.")
  if data.binarize and data.dataset != 'omniglot':
    problems.append(f"data.binarize = True binarises Omniglot's strokes as the original HT's "
                    f"cache holds them, for data.dataset = 'omniglot' only, not "
                    f'{data.dataset!r}: set data.binarize = False.')
  if c.episode.task_classes == 'domain' and data.dataset != 'multidomain':
    problems.append(f"episode.task_classes = 'domain' (one domain per task) needs "
                    f"data.dataset = 'multidomain', not {data.dataset!r}.")
  return problems


def _model_problems(c: ml_collections.ConfigDict, num_devices: int) -> list[str]:
  problems = []
  size, blocks = c.data.image_size, c.model.num_blocks
  if size < 2 ** blocks:
    chain = ' -> '.join(str(s) for s in cnn.feature_map_sizes(size, blocks))
    problems.append(
        f'data.image_size = {size} is too small for model.num_blocks = {blocks}: '
        f'each block halves the feature map ({chain}), so it must be >= '
        f'{2 ** blocks}, or model.num_blocks <= {max(int(math.log2(size)), 0)}.')
  trained = c.model.trained_layers
  if abs(trained) > blocks:
    problems.append(
        f'model.trained_layers = {trained} leaves no layer of the {blocks + 1} '
        f'(model.num_blocks = {blocks} conv blocks and the head) for the transformers '
        f'to write: its absolute value must be at most {blocks} (for a CNN with no generated '
        "layer, use method = 'constpn').")
  if c.loss == 'cross_entropy' and c.model.cnn_embedding_dim != c.episode.ways:
    problems.append(
        f"loss = 'cross_entropy' reads the CNN's final layer as class logits, so "
        f'model.cnn_embedding_dim = {c.model.cnn_embedding_dim} must equal '
        f'episode.ways = {c.episode.ways}.')
  if c.train.episodes_per_step % num_devices:
    problems.append(
        f'train.episodes_per_step = {c.train.episodes_per_step} must be a multiple '
        f'of the {num_devices} devices the batch is split over.')
  if c.model.conv_impl == 'fused_cpu' and c.model.compute_dtype != 'float32':
    problems.append(
        f"model.conv_impl = 'fused_cpu' computes in float32 only, not model.compute_dtype "
        f"= {c.model.compute_dtype!r}; use conv_impl auto or patches, or float32.")
  elif c.model.conv_impl == 'fused_cpu':  # Where it cannot run ('auto' falls back).
    try:
      ops.resolve_conv_impl(c.model.conv_impl, second_order=c.method == 'maml')
    except ValueError as e:
      problems.append(str(e))
  if c.model.encoder_impl == 'fused_cpu':
    try:
      transformer.resolve_encoder_impl(c.model.encoder_impl)
    except ValueError as e:
      problems.append(str(e))
  return problems


def _method_problems(c: ml_collections.ConfigDict) -> list[str]:
  """The baselines of `config.method` (cht_jax/methods/)."""
  problems = []
  if c.method != 'cht' and c.loss != 'class_incremental':
    problems.append(
        f"method = {c.method!r} trains a prototypical network: loss must be "
        f"'class_incremental', got {c.loss!r}.")
  if c.method == 'merged_ht' and c.episode.task_classes != 'disjoint':
    problems.append(
        "method = 'merged_ht' merges the T tasks of an episode into one K*T-way task, so "
        "their classes must differ: episode.task_classes must be 'disjoint'.")
  if c.method != 'cht' and c.episode.unlabeled_per_class:
    problems.append(
        f'episode.unlabeled_per_class = {c.episode.unlabeled_per_class}: unlabeled support '
        f"images reach the HyperTransformer of method = 'cht' only, not method = "
        f"{c.method!r}; set episode.unlabeled_per_class = 0.")
  return problems


def validate(config: Any, num_devices: int | None = None) -> ml_collections.ConfigDict:
  """Checks every field of a training config (or what `config_flags` left of one that failed
  to load); returns it unchanged, or raises ConfigError."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'The config could not be loaded: {_load_failure(config)}')
  problems = _field_problems(_leaves(config))
  if not problems:  # Relations between fields need each field to be valid.
    if num_devices is None:
      from cht_jax.runtime import devices  # pylint: disable=g-import-not-at-top
      num_devices = devices.num_data_devices(config.train.episodes_per_step)
    problems = (_episode_problems(config) + _model_problems(config, num_devices)
                + _method_problems(config))
  if problems:
    count = f'{len(problems)} problems' if len(problems) > 1 else 'a problem'
    raise ConfigError(f'The config has {count}: ' + ' '.join(problems))
  return config


def _load_failure(config: Any) -> str:
  """What `config_flags` recorded about a config file that failed to load."""
  try:
    config.keys()
  except Exception as e:  # pylint: disable=broad-except
    return _one_paragraph(str(e))
  return f'expected an ml_collections.ConfigDict, got {type(config).__name__}.'


def _one_paragraph(text: str) -> str:
  """Joins the lines of an error message, dropping any traceback in it."""
  lines = [line.strip() for line in text.strip().splitlines()]
  if 'Traceback (most recent call last):' in lines:  # Keep the exception line only.
    lines = lines[:lines.index('Traceback (most recent call last):')] + lines[-1:]
  return ' '.join(line for line in lines if line)


def _override_message(argv: Sequence[str], error: Exception) -> str:
  """Names the `--config.*` override whose field does not exist."""
  text = str(error).replace('\\', '')  # ml_collections: 'name' Did you mean "x" instead of "name"?
  match = re.search(r'instead of "(\w+)"', text) or re.search(r"'(\w+)'", text)
  name = match.group(1) if match else None
  for arg in argv:
    path = re.match(r'-{1,2}(?:no)?config\.([\w.]+)', arg)
    if path and name and name in path.group(1).split('.'):
      return (f'{arg}: the config has no field {path.group(1)}; '
              + _did_you_mean(path.group(1), list(SCHEMA)))
  return ('A --config.* override names a field the config does not have: '
          + _one_paragraph(str(error)))


def flags_parser(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with config mistakes reported in one paragraph (exit 1)."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # An override of a field that does not exist.
    message = _override_message(argv, e)
  except flags.Error as e:
    message = _one_paragraph(str(e))
  print(f'FATAL Flags parsing error: {message}\nPass --helpshort or --helpfull to see '
        'help on flags.', file=sys.stderr)
  sys.exit(1)
