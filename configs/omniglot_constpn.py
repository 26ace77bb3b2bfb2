"""ConstPN baseline on Omniglot (paper section 5.2).

  --config=configs/omniglot_constpn.py:T[,variant]    e.g. :5 or :2,smoke

The CNN of the CHT configs (one network definition, cht_jax/models/cnn.py) with
trained parameters, trained as a prototypical network on single tasks of
constpn_ways_multiplier x 20 = 100 ways; evaluated like CHT on episodes of T
20-way tasks (T only sets the evaluation episodes: ConstPN has no memory of
tasks). The paper gives no learning rate for it; this uses CHT's T <= 4 rate.
"""

from configs import omniglot_base


def get_config(arg=None):
  num_tasks, variant = omniglot_base.parse_arguments(arg, ('num_tasks',), (5,))
  config = omniglot_base.get_config(num_tasks=num_tasks, learning_rate=1e-4,
                                    variant=variant)
  config.method = 'constpn'
  return config
