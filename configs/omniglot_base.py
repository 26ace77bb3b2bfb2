"""Shared settings of the Omniglot experiments (paper, "Experiments").

Not a config file itself: `omniglot_t{1..5}.py` call `get_config` with their
number of tasks and learning rate. Variants, chosen with the config file's
argument (`--config=configs/omniglot_t5.py:smoke`; shared settings in
`variants.py`):
  (none)  the paper's settings: 20-way 1-shot, 8 channels, 20-dim embedding,
          3-layer 2-head transformers, embedding_dim 32, SGD with exponential
          decay, 4M steps.
  smoke   the same model on real Omniglot for a few CPU minutes: Adam 1e-3
          (the paper's SGD diverges or crawls from the large initial
          distances; see README), a few hundred steps, frequent checkpoints.
  tiny    a very small model and episodes for tests and debugging.
  fast    the recipe that learns fast on one GPU (not the paper's): scaled
          generated head, Adam with warmup and cosine decay, 64 episodes a step.
"""

import ml_collections

from configs import variants

VARIANTS = variants.NAMES
# Steps of the 'smoke' variant by number of tasks (300 from T = 5 on).
SMOKE_STEPS = {1: 1500, 2: 800, 3: 500, 4: 400, 5: 300}
# Steps of the 'fast' variant by number of tasks, at FAST_EPISODES_PER_STEP
# episodes a step: sized for minutes of one H100/H200 (docs/results.md, section 1).
# On a CPU: --config.train.episodes_per_step=1 --config.train.num_steps=<budget>.
FAST_STEPS = {1: 6000, 2: 5000, 3: 4500, 4: 4000, 5: 4000}
FAST_EPISODES_PER_STEP = 64


def get_config(num_tasks: int, learning_rate: float, variant: str | None = None):
  """Builds the config of the Omniglot T=`num_tasks` experiment."""
  variant = variants.check(variant, VARIANTS)
  config = ml_collections.ConfigDict()
  # One seed reaches every random choice: parameter init, episode sampling,
  # augmentation (the class split has its own, fixed by the protocol).
  config.seed = 0

  config.data = ml_collections.ConfigDict()
  config.data.dataset = 'omniglot'
  config.data.pipeline = 'device'  # Episodes sampled on device from images in memory.
  config.data.data_dir = ''  # TFDS data dir; '' = TFDS default (~/tensorflow_datasets).
  config.data.manual_dir = ''  # Folder with the four Omniglot archives ('' = <data_dir>/downloads/manual).
  config.data.split_scheme = 'ht'  # 'ht' (1150/50/423 shuffled classes) or 'alphabet'.
  config.data.split_seed = 2022
  config.data.image_size = 28
  config.data.rotate = True  # Per-class rotation by multiples of 90 degrees in training.
  config.data.images_per_class = 20  # Omniglot has 20.
  # Omniglot only: True binarises the resized pixels (0 or 255) as the original HT's
  # NumPy cache holds them (hypertransformer/tf/core/train_lib.py, _load_cache);
  # False keeps the grey values of the bilinear resize.
  config.data.binarize = False
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
  # Unlabeled support images per class (semi-supervised, CHT only; 0 = the paper's setting).
  config.episode.unlabeled_per_class = 0
  # True: each task's support images and its queries drawn apart, each without
  # replacement, so a query may be a support image, as the original HT draws
  # (hypertransformer/tf/core/datasets.py, _make_semisupervised_samples);
  # False: the N + Q (+ U) images of a class in a task are distinct.
  config.episode.independent_draws = False

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
  config.model.generate_bn = False
  # Not in the paper: > 0 multiplies the generated head (kernel and bias) by a
  # learned scalar starting at this value, so the first prototypical logits are
  # O(1) rather than O(100) (the ':fast' recipe). 0 = the paper's head.
  config.model.head_scale = 0.0
  # Not in the paper: > 0 makes each generated layer a learned task-independent
  # base plus the transformer's output times a learned scalar starting at this
  # value, so the transformer only has to write what differs between tasks.
  config.model.learned_base = 0.0
  # Not in the paper (the original HT's number_of_trained_cnn_layers): N > 0 trains
  # the CNN's first N layers (conv blocks, then the head) as ordinary parameters,
  # the same for every task, and generates the rest; N < 0 the last |N|. 0 = all
  # generated.
  config.model.trained_layers = 0
  # Not in the paper: True normalises each layer's sample features over the
  # support set before they enter the tokens (see HyperTransformer.feature_norm).
  config.model.feature_norm = False
  # 'auto': the generated CNN's blocks as one C++ call each way on CPU
  # (cht_jax/kernels/cpu), else 'patches'; 'lax' and 'fused_cpu' on demand.
  # Same numbers up to float rounding (docs/performance.md).
  config.model.conv_impl = 'auto'
  # 'bfloat16': every convolution with bfloat16 operands and float32 accumulation
  # (mixed precision, for accelerators; not the paper's). The transformers, the
  # losses and the parameters stay float32. The fused CPU kernel is float32 only:
  # with 'bfloat16', 'auto' runs 'patches'.
  config.model.compute_dtype = 'float32'
  # 'auto': forward-only passes of the transformers (generating theta for
  # evaluation) as one C++ call per stack on CPU (cht_jax/kernels/cpu), else
  # 'xla'; training always differentiates the XLA form.
  config.model.encoder_impl = 'auto'
  # Rematerialise each task's generation in the backward pass: 'auto' does where the
  # episodes are vmapped (accelerators; memory), and where they are looped (CPU) from
  # T = 3 on, where it is faster (continual.remat_option).
  # Any type: 'auto' or a bool (a plain str field would refuse `config.model.remat = False`).
  config.model.remat = ml_collections.FieldReference('auto', field_type=object)
  # Pairs of (theta_t, Q(tau)) and the episodes of a batch: vmapped or looped.
  # 'auto' loops on CPU (cache-friendly there) and vmaps on GPU/TPU.
  config.model.vectorize = 'auto'

  config.loss = 'class_incremental'  # or 'task_incremental', 'cross_entropy'.
  # What makes the CNN's weights (cht_jax/methods/): 'cht', or the baselines
  # 'constpn' (trained CNN, prototypical network) and 'merged_ht' (one HT over
  # the T tasks merged into one K*T-way task), or the Table 1 baselines trained
  # by gradient descent, 'finetune', 'ewc', 'maml' (cht_jax/methods).
  config.method = 'cht'
  config.constpn_ways_multiplier = 5  # ConstPN trains on 5x the ways (100-way for 20-way).

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
  # Validation classes (as many of the T tasks as their 50 classes allow); 0 = never.
  config.train.eval_every_steps = 20_000
  config.train.eval_episodes = 32
  # A step whose loss, gradient or generated weights are not finite never
  # changes the parameters. 'stop': end the run there, keeping the last good
  # checkpoint; 'skip': go on with the next batch (up to 20 such steps in a row).
  config.train.on_divergence = 'stop'
  # Not the paper's: > 1 rolls back finite collapses. A log window whose mean
  # training loss exceeds this times the lowest of the windows before goes back
  # to the state of two windows earlier, at half the learning rate from there
  # (cht_jax/runtime/divergence.py, train.py; docs/reliability.md). 0 = off.
  config.train.loss_spike_factor = 0.0

  # The Table 1 baselines' settings (method 'finetune', 'ewc', 'maml';
  # configs/baselines_table1.py), read only by those.
  config.baseline = ml_collections.ConfigDict()
  config.baseline.inner_steps = 5  # SGD steps per task (fine-tuning, EWC; MAML++'s inner loop).
  config.baseline.inner_learning_rate = 0.1  # Their rate (MAML++: the initial LSLR).
  config.baseline.head_init = 'zeros'  # Fresh K*T head of the pretrained CNN: or 'glorot'.
  config.baseline.pretrain_batch_size = 128  # Images per pretraining step.
  # Best of 0, 1, 3, 10 on validation (docs/results.md, section 15); SGD on the
  # penalty is stable only while inner_learning_rate * ewc_lambda * max(Fisher) < 2.
  config.baseline.ewc_lambda = 10.0
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
  """'16,5,tiny' -> (16, 5, 'tiny') for names ('channels', 'num_tasks'); variant last.

  Integers first, in the order of `names` (missing ones from `defaults`), then an
  optional variant ('', 'smoke' or 'tiny'). `arg` is what follows the colon of
  `--config=configs/FILE.py:ARG`.
  """
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
