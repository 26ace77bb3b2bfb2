"""Shared settings of the Omniglot experiments (paper, "Experiments").

Not a config file itself: `omniglot_t{1..5}.py` call `get_config` with their
number of tasks and learning rate. Variants (`--config=configs/omniglot_t5.py:smoke`;
see `variants.py`): none (the paper's settings), smoke, tiny, fast.
"""

import ml_collections

from configs import variants

VARIANTS = variants.NAMES
# Steps of the 'smoke' variant by number of tasks (300 from T = 5 on).
SMOKE_STEPS = {1: 1500, 2: 800, 3: 500, 4: 400, 5: 300}
# Steps of the 'fast' variant by number of tasks: minutes of one GPU (docs/results.md).
FAST_STEPS = {1: 6000, 2: 5000, 3: 4500, 4: 4000, 5: 4000}
FAST_EPISODES_PER_STEP = 64


def get_config(num_tasks: int, learning_rate: float, variant: str | None = None):
  """Builds the config of the Omniglot T=`num_tasks` experiment."""
  variant = variants.check(variant, VARIANTS)
  config = ml_collections.ConfigDict()
  config.seed = 0  # Init, episodes, augmentation (the class split has split_seed).

  config.data = ml_collections.ConfigDict()
  config.data.dataset = 'omniglot'
  config.data.pipeline = 'device'  # Episodes sampled on device from images in memory.
  config.data.data_dir = ''  # TFDS data dir; '' = TFDS default (~/tensorflow_datasets).
  config.data.manual_dir = ''  # The Omniglot archives ('' = <data_dir>/downloads/manual).
  config.data.split_scheme = 'ht'  # 'ht' (1150/50/423 shuffled classes) or 'alphabet'.
  config.data.split_seed = 2022
  config.data.image_size = 28
  config.data.rotate = True  # Per-class rotation by multiples of 90 degrees in training.
  config.data.images_per_class = 20  # Omniglot has 20.
  # Omniglot's pixels binarised, as the original HT's NumPy cache held them
  # (hypertransformer/tf/core/train_lib.py, `_load_cache`); the paper does not say.
  config.data.binarize = True
  config.data.check_class_counts = True  # Only for tiered_imagenet.
  config.data.domains = ('omniglot',)  # Only for multidomain.
  config.data.domain_split = (0.7, 0.15, 0.15)  # Only for multidomain.
  # Per-image training augmentation (data/augment.py); all off for Omniglot.
  config.data.augment = ml_collections.ConfigDict()
  config.data.augment.flip = False
  config.data.augment.hue = 0.0
  config.data.augment.brightness = 0.0
  config.data.augment.contrast = 0.0
  config.data.augment.crop_min_scale = 1.0

  config.episode = ml_collections.ConfigDict()
  config.episode.num_tasks = num_tasks
  config.episode.ways = 20
  config.episode.shots = 1
  config.episode.queries_per_class = 3  # 60 queries per 20-way task, as the original HT.
  config.episode.task_classes = 'disjoint'  # or 'same' (mini-batch), 'domain' (multidomain).
  config.episode.unlabeled_per_class = 0  # Semi-supervised (CHT only); 0 = the paper's.
  # Support and queries drawn independently, so a query may be the support image, as the
  # original HT's training episodes (tf/core/datasets.py, `_make_semisupervised_samples`);
  # the paper does not say. Evaluation's default sampler is the stricter one (--eval_sampler).
  config.episode.independent_draws = True

  config.model = ml_collections.ConfigDict()
  config.model.channels = 8
  config.model.num_blocks = 4
  config.model.cnn_embedding_dim = 20
  config.model.embedding_dim = 32
  config.model.image_features = 32
  config.model.activation_features = config.model.get_ref('channels')
  config.model.num_layers = 3
  config.model.num_heads = 2
  config.model.query_key_fraction = 1.0
  config.model.value_fraction = 1.0
  config.model.inner_fraction = 1.0
  config.model.activation = 'relu'
  config.model.generate_bn = False  # Generate BatchNorm scale/offset instead of training them.
  # Not the paper's, these four:
  config.model.head_scale = 0.0  # > 0: the generated head times a learned scale from this.
  config.model.learned_base = 0.0  # > 0: layer = learned base + output * learned scale from this.
  config.model.trained_layers = 0  # N > 0: the first N layers trained, N < 0: the last |N|.
  config.model.feature_norm = False  # Normalise sample features over the support set.
  # 'auto': fused C++ blocks on CPU (cht_jax/kernels/cpu), else 'patches'; or 'lax', 'fused_cpu'.
  config.model.conv_impl = 'auto'
  config.model.compute_dtype = 'float32'  # or 'bfloat16' operands, float32 accumulation.
  config.model.encoder_impl = 'auto'  # 'auto': forward passes one C++ call on CPU, else 'xla'.
  # Rematerialise each task's generation: 'auto' or a bool (continual.remat_option).
  config.model.remat = ml_collections.FieldReference('auto', field_type=object)
  config.model.vectorize = 'auto'  # vmap or loop pairs and episodes; 'auto' loops on CPU.

  config.loss = 'class_incremental'  # or 'task_incremental', 'cross_entropy'.
  # cht_jax/methods/: 'cht', 'constpn', 'merged_ht', or Table 1's 'finetune', 'ewc', 'maml'.
  config.method = 'cht'
  config.constpn_ways_multiplier = 5  # ConstPN trains on this many times the ways.

  config.optim = ml_collections.ConfigDict()
  config.optim.name = 'sgd'  # or 'adam', 'momentum'.
  config.optim.learning_rate = learning_rate
  config.optim.schedule = 'exponential'  # The paper's; or 'cosine' (the ':fast' recipe).
  config.optim.decay_rate = 0.97  # Exponential decay (continuous, as the original HT) ...
  config.optim.decay_steps = 100_000  # ... per this many steps; 'cosine': its length.
  config.optim.end_fraction = 0.0  # 'cosine' ends at learning_rate * end_fraction.
  config.optim.warmup_steps = 0  # Linear warmup from 0 before the schedule.
  config.optim.weight_decay = 0.0  # Only for 'adamw'.
  config.optim.momentum = 0.9  # Only for 'momentum'.
  config.optim.grad_clip_norm = 0.0  # 0 = no clipping.

  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 4_000_000
  config.train.episodes_per_step = 1
  config.train.log_every_steps = 1000
  config.train.checkpoint_every_steps = 10_000
  config.train.keep_checkpoints = 3
  config.train.eval_every_steps = 20_000  # Validation; 0 = never.
  config.train.eval_episodes = 32
  config.train.on_divergence = 'stop'  # Non-finite step: 'stop' the run or 'skip' the batch.
  config.train.loss_spike_factor = 0.0  # > 1: roll back loss windows this times the best.

  # The Table 1 baselines' settings (configs/baselines_table1.py), read only by those.
  config.baseline = ml_collections.ConfigDict()
  config.baseline.inner_steps = 5  # SGD steps per task (fine-tuning, EWC; MAML++'s inner loop).
  config.baseline.inner_learning_rate = 0.1  # Their rate (MAML++: the initial LSLR).
  config.baseline.head_init = 'zeros'  # Fresh K*T head of the pretrained CNN: or 'glorot'.
  config.baseline.pretrain_batch_size = 128  # Images per pretraining step.
  config.baseline.ewc_lambda = 10.0  # SGD is stable while rate * lambda * max(Fisher) < 2.
  config.baseline.ewc_fisher = 'empirical'  # or 'true' (expectation under the model).
  config.baseline.maml_learn_inner_lr = True  # LSLR: learned per-layer per-step rates.
  config.baseline.maml_first_order_steps = 0  # First-order for this many meta-steps.
  config.baseline.maml_multi_step_loss = True
  config.baseline.maml_msl_anneal_steps = 7_500  # Multi-step loss for this many meta-steps.
  config.baseline.maml_cosine_annealing = True  # Meta learning rate, cosine to the minimum.
  config.baseline.maml_min_learning_rate = 1e-5

  if variant == 'smoke':
    variants.smoke(config, num_steps=SMOKE_STEPS.get(num_tasks, 300))
  elif variant == 'fast':
    variants.fast(config, num_steps=FAST_STEPS.get(num_tasks, 4000),
                  episodes_per_step=FAST_EPISODES_PER_STEP)
  elif variant == 'tiny':
    # 8 channels: the fused CPU kernel's narrowest width (conv_impl='auto').
    variants.tiny(config, channels=8, num_steps=4, log_every_steps=2, checkpoint_every_steps=2)
    config.episode.ways = 3
    config.episode.queries_per_class = 2
  return config


def paper_learning_rate(num_tasks: int) -> float:
  """The paper's SGD rate for Omniglot: 1e-4 for T <= 4, 5e-5 for T = 5 (and more)."""
  return 1e-4 if num_tasks <= 4 else 5e-5


def parse_arguments(arg: str | None, names: tuple[str, ...], defaults: tuple = ()):
  """'16,5,tiny' -> (16, 5, 'tiny') for names ('channels', 'num_tasks'): `arg` follows the colon
  of `--config=configs/FILE.py:ARG`, variant last; missing integers come from `defaults`."""
  parts = [p.strip() for p in (arg or '').split(',') if p.strip()]
  variant = parts.pop() if parts and not parts[-1].lstrip('-').isdigit() else ''
  variants.check(variant, VARIANTS)
  if len(parts) > len(names):
    raise ValueError(f'Expected at most {len(names)} numbers ({", ".join(names)}) then '
                     f'a variant, got {arg!r}.')
  values = [int(p) for p in parts] + list(defaults[len(parts):])
  if len(values) < len(names):
    raise ValueError(f'Expected {", ".join(names)} (then a variant), got {arg!r}.')
  return (*values, variant)
