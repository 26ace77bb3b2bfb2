"""The methods that produce the CNN weights theta_t, one file each (interface: base.py).

  cht.py        the Continual HyperTransformer (Algorithm 1; T=1 is plain HT)
  constpn.py    ConstPN: one trained CNN for every task
  merged_ht.py  Merged HT: one HT over all tasks merged into one
  finetune.py   pretraining + fine-tuning
  ewc.py        EWC: fine-tuning plus its penalty on earlier tasks
  maml.py       MAML++
  sequential.py the task-by-task scan of the three above, theta_t = update(theta_{t-1}, S(t))

Adding a method: a file here, its class in REGISTRY, its name in
`config_validation.METHODS`, and a config.
"""

import ml_collections
import numpy as np

from cht_jax import config_validation
from cht_jax.data import episodes as episodes_lib
from cht_jax.methods import base
from cht_jax.methods import cht
from cht_jax.methods import constpn
from cht_jax.methods import ewc
from cht_jax.methods import finetune
from cht_jax.methods import maml
from cht_jax.methods import merged_ht

Method = base.Method
REGISTRY = {
    'cht': cht.CHT,
    'constpn': constpn.ConstPN,
    'merged_ht': merged_ht.MergedHT,
    'finetune': finetune.Finetune,
    'ewc': ewc.EWC,
    'maml': maml.MAML,
}


def method_name(config: ml_collections.ConfigDict) -> str:
  """`config.method`; 'cht' for configs saved before the field existed (config.json)."""
  return config.get('method', 'cht')


def method_class(config: ml_collections.ConfigDict) -> type[Method]:
  name = method_name(config)
  if name not in REGISTRY:
    raise config_validation.ConfigError(
        f'Unknown config.method {name!r}; expected one of {tuple(REGISTRY)}.')
  return REGISTRY[name]


def build(config: ml_collections.ConfigDict, num_train_classes: int | None = None) -> Method:
  """The method of `config.method` (with a frozen copy of `config`); `num_train_classes`
  sizes a pretraining head (None: from the split scheme)."""
  return method_class(config).from_config(ml_collections.FrozenConfigDict(config),
                                          num_train_classes)


def display_name(config: ml_collections.ConfigDict) -> str:
  return method_class(config).display_name


def check_training_episodes(method: Method, dataset: dict) -> None:
  """The sampler's rules against the loaded training split, before compiling: the
  loaded data may hold fewer classes than the config's nominal counts."""
  if method.config.data.pipeline == 'host' or not hasattr(method, 'training_spec'):
    return  # The host pipeline checks its own split; sequential methods sample theirs.
  sizes = dataset.get('domain_sizes', {}).get('train', ())
  num_classes, images_per_class = np.shape(dataset['train'])[:2]
  problems = episodes_lib.spec_problems(
      method.training_spec(sizes), num_classes, images_per_class,
      split="the loaded 'train' split", remedy='fewer ways or tasks per episode, or more data')
  if problems:
    raise config_validation.ConfigError(
        f'{method.display_name} cannot draw its training episodes: ' + ' '.join(problems))
