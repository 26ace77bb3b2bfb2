"""Table 1 baselines on Omniglot: pretraining + fine-tuning, EWC, MAML++ (issue 4).

  --config=configs/baselines_table1.py:METHOD,T[,VARIANT]
  METHOD: finetune | ewc | maml;  T: tasks per episode;  VARIANT: smoke | tiny.

train.num_steps counts pretraining batches or MAML++ meta-steps. The paper gives
no hyper-parameters for the baselines: MAML++'s Omniglot ones where it has one.
"""

from configs import omniglot_base

METHODS = ('finetune', 'ewc', 'maml')


def get_config(arg: str = 'finetune,5'):
  parts = [p.strip() for p in (arg or 'finetune,5').split(',')]
  if len(parts) not in (2, 3) or parts[0] not in METHODS or not parts[1].isdigit():
    raise ValueError(f'Expected METHOD,T[,VARIANT] with METHOD one of {METHODS}, '
                     f'e.g. "maml,5" or "ewc,2,tiny"; got {arg!r}.')
  method, num_tasks = parts[0], int(parts[1])
  variant = parts[2] if len(parts) == 3 else None
  config = omniglot_base.get_config(num_tasks=num_tasks, learning_rate=1e-3, variant=variant)
  config.method = method
  config.optim.name = 'adam'
  config.optim.learning_rate = 1e-3
  b, tc = config.baseline, config.train
  if variant is None:
    tc.num_steps = 20_000 if method != 'maml' else 50_000
    tc.episodes_per_step = 8 if method == 'maml' else 1
    tc.log_every_steps = 100
    tc.checkpoint_every_steps = 5_000
    tc.eval_every_steps = 5_000
    b.maml_first_order_steps = tc.num_steps // 4
    b.maml_msl_anneal_steps = tc.num_steps * 15 // 100
  elif variant == 'smoke':
    tc.num_steps = 300
    b.pretrain_batch_size = 64
    b.maml_first_order_steps = 100
    b.maml_msl_anneal_steps = 50
  elif variant == 'tiny':
    b.inner_steps = 2
    b.pretrain_batch_size = 8
    b.maml_first_order_steps = 1  # Steps 1 first order, 2.. second order: both compiled.
    b.maml_msl_anneal_steps = 2
  return config
