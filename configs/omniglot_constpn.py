"""ConstPN baseline on Omniglot (paper section 5.2).

  --config=configs/omniglot_constpn.py:T[,variant]    e.g. :5 or :2,smoke

The CHT configs' CNN trained as a prototypical network on single tasks of
constpn_ways_multiplier x 20 ways; T sets the evaluation episodes only.
"""

from configs import omniglot_base


def get_config(arg=None):
  num_tasks, variant = omniglot_base.parse_arguments(arg, ('num_tasks',), (5,))
  config = omniglot_base.get_config(num_tasks=num_tasks, learning_rate=1e-4,
                                    variant=variant)
  config.method = 'constpn'
  return config
