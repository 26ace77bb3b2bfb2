"""The 'smoke' and 'tiny' variants of the experiment configs.

Not a config file itself. A config file's argument may end in a variant
(`--config=configs/omniglot_t2.py:tiny`); the experiment's base config
(`omniglot_base`, `tiered_imagenet_base`, `multidomain_t2`) builds the
full-size config, then applies the variant with the function here, passing
what differs per dataset (model width, run length) and setting its episode
sizes itself. What every dataset's variant shares is written once here:
  smoke  minutes on CPU with the real data and the full model: Adam 1e-3 (the
         paper's SGD diverges or crawls from the large initial distances; see
         README), checkpoints and validation every third of the run, 8
         validation episodes.
  tiny   seconds, for tests and debugging: a very small model on 16x16 images,
         Adam 1e-3, a handful of steps, validation once at the end on 2
         episodes.
  fast   the recipe that learns fast (not the paper's; README, docs/recipe.md):
         the generated head scaled so the first logits are O(1)
         (model.head_scale), each layer's sample features normalised over the
         support set (model.feature_norm), Adam with linear warmup over the
         first 5% of the steps then cosine decay to 0 over the rest, a batch of
         episodes per step, no rotation augmentation (short runs underfit:
         rotated copies of the training classes cost validation accuracy;
         docs/results.md, section 5), finite collapses rolled back (train.loss_spike_factor),
         the first two conv blocks trained rather than written
         (model.trained_layers), and each written layer a learned base plus the
         transformer's output (model.learned_base; without it a 16-channel CNN
         does not start to learn). The schedule follows train.num_steps:
         override that to fit a budget and warmup and decay follow.
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
  config.model.head_scale = head_scale
  # The image-dependent part of the tokens starts orders of magnitude smaller than
  # the label embeddings; normalised, it raised test and validation accuracy in
  # every seed pair (docs/results.md, section 8).
  config.model.feature_norm = True
  # No rematerialisation: faster than 'auto' at T=5, 64 episodes, on an H200, and the
  # memory fits (docs/performance.md).
  config.model.remat = False
  # The paper's per-class rotations quadruple the training classes; within a
  # budget of minutes the model underfits, and they cost validation accuracy
  # (docs/results.md, section 5).
  config.data.rotate = False
  # Rolls back finite collapses (docs/reliability.md). The factor sits above what a
  # healthy run's loss windows ever rose and below the first jump of a collapse;
  # rolled back, a collapsing screen ended far above the same run without
  # (docs/results.md, section 11).
  config.train.loss_spike_factor = 1.1
  # The first two conv blocks as ordinary trained parameters (the original HT's
  # number_of_trained_cnn_layers); the transformers write blocks 2-3 and the head.
  # More steps/s and higher test accuracy at 8 and 16 channels (docs/results.md,
  # sections 12-13).
  config.model.trained_layers = 2
  # Each written layer is a learned task-independent base plus its transformer's
  # output times a learned scale that starts at this value. At 16 channels the
  # written CNN does not start to learn without it; at 8 channels it costs less
  # than the spread of seeds (docs/results.md, section 13).
  config.model.learned_base = 0.1
  optim = config.optim
  optim.name = 'adam'
  optim.learning_rate = learning_rate
  optim.schedule = 'cosine'
  steps = config.train.get_ref('num_steps')  # Warmup and decay follow an override.
  # `* 1`: a value computed from num_steps, not num_steps itself, so that setting
  # optim.decay_steps does not set train.num_steps too.
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
