"""The variants of the experiment configs (`--config=configs/omniglot_t2.py:tiny`).

Not a config file itself: the base configs apply their variant with these.
  smoke  minutes on CPU, real data, full model; Adam 1e-3 (the paper's SGD crawls; README).
  tiny   seconds, for tests and debugging: a very small model on 16x16 images.
  fast   the recipe that learns fast (not the paper's; README, docs/recipe.md).
         Its schedule follows train.num_steps: override that to fit a budget.
"""

import ml_collections

NAMES = ('', 'smoke', 'tiny', 'fast')


def check(variant: str | None, known: tuple[str, ...] = NAMES) -> str:
  """Returns the variant's name ('' for none); ValueError if not in `known`."""
  variant = variant or ''
  if variant not in known:
    raise ValueError(f'Unknown config variant {variant!r}; expected one of {known}.')
  return variant


def smoke(config: ml_collections.ConfigDict, num_steps: int) -> None:
  """Turns `config` into its 'smoke' variant of `num_steps` steps."""
  _short_run(config, num_steps, log_every_steps=25, checkpoint_every_steps=num_steps // 3,
             eval_every_steps=num_steps // 3, eval_episodes=8)


def fast(config: ml_collections.ConfigDict, num_steps: int, episodes_per_step: int,
         head_scale: float = 0.1, learning_rate: float = 1e-3) -> None:
  """Turns `config` into its 'fast' recipe of `num_steps` steps."""
  config.model.head_scale = head_scale  # First logits O(1), not O(100).
  config.model.feature_norm = True  # Image features start tiny (docs/results.md, 8).
  config.model.remat = False  # Faster, and the memory fits (docs/performance.md).
  config.data.rotate = False  # Rotations cost short runs accuracy (docs/results.md, 5).
  config.train.loss_spike_factor = 1.1  # Healthy rises < it < collapses (docs/results.md, 11).
  config.model.trained_layers = 2  # Blocks 0-1 trained, not written (docs/results.md, 12-13).
  config.model.learned_base = 0.1  # Else 16 channels do not learn (docs/results.md, 13).
  # The data conventions its results were measured with, not the original HT's (README).
  config.episode.independent_draws = False
  config.data.binarize = False
  optim = config.optim
  optim.name = 'adam'
  optim.learning_rate = learning_rate
  optim.schedule = 'cosine'
  steps = config.train.get_ref('num_steps')  # Warmup and decay follow an override.
  # `* 1`: a new reference, so that setting decay_steps does not set num_steps too.
  optim.decay_steps = steps * 1
  optim.warmup_steps = steps // 20
  optim.end_fraction = 0.0
  train = config.train
  train.num_steps = num_steps
  train.episodes_per_step = episodes_per_step
  train.log_every_steps = 50
  train.checkpoint_every_steps = steps // 4
  train.eval_every_steps = steps // 10
  train.eval_episodes = 32


def tiny(config: ml_collections.ConfigDict, channels: int, num_steps: int,
         log_every_steps: int, checkpoint_every_steps: int) -> None:
  """Turns `config` into its 'tiny' model and run; episodes are the caller's."""
  model = config.model
  model.channels = channels
  model.cnn_embedding_dim = 6
  model.embedding_dim = 8
  model.image_features = 8
  model.num_layers = 1
  model.num_heads = 2
  config.data.image_size = 16
  _short_run(config, num_steps, log_every_steps, checkpoint_every_steps,
             eval_every_steps=num_steps, eval_episodes=2)


def _short_run(config: ml_collections.ConfigDict, num_steps: int, log_every_steps: int,
               checkpoint_every_steps: int, eval_every_steps: int,
               eval_episodes: int) -> None:
  config.optim.name = 'adam'
  config.optim.learning_rate = 1e-3
  train = config.train
  train.num_steps = num_steps
  train.log_every_steps = log_every_steps
  train.checkpoint_every_steps = checkpoint_every_steps
  train.eval_every_steps = eval_every_steps
  train.eval_episodes = eval_episodes
