"""Merged HT: one plain HT given the T tasks of an episode at once as one K*T-way task.

Task tau's class k is merged label tau*K + k (theta_{-1} = 0); the one theta
serves every t. Only the class-incremental accuracy of theta_{T-1} on tasks
0..T-1 is the paper's Merged HT baseline (the stars of Figure 4).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from cht_jax import continual
from cht_jax import losses
from cht_jax import models
from cht_jax.methods import base
from cht_jax.methods import cht
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import hypertransformer as ht_lib


def merge_tasks(support_images, support_labels, num_ways: int):
  """T K-way tasks -> one K*T-way task: [T, S, ...] -> [T*S, ...], label tau*K + k."""
  num_tasks, support_size = support_labels.shape
  offsets = (jnp.arange(num_tasks, dtype=support_labels.dtype) * num_ways)[:, None]
  return (support_images.reshape(num_tasks * support_size, *support_images.shape[2:]),
          (support_labels + offsets).reshape(-1))


@dataclasses.dataclass(frozen=True)
class MergedHT(base.EpisodicMethod):
  """One plain HT over the T tasks of an episode merged into one K*T-way task."""
  ht: ht_lib.HyperTransformer = None  # num_ways = K * T.
  name = 'merged_ht'
  display_name = 'Merged HT'
  note = ('Merged HT: one HT given all tasks at once; only the class-incremental '
          'accuracy of theta_{T-1} on tasks 0..T-1 is the baseline (theta_t for '
          't < T-1 has seen the support sets of later tasks).')

  @classmethod
  def from_config(cls, config, num_train_classes=None) -> 'MergedHT':
    del num_train_classes
    ht = models.build_hypertransformer(config)
    return cls(config, ht=ht.clone(num_ways=config.episode.ways * config.episode.num_tasks))

  @property
  def cnn(self) -> cnn_lib.CNN:
    return self.ht.cnn

  @property
  def max_eval_tasks(self) -> int:
    return self.config.episode.num_tasks  # Episodes may have fewer tasks, not more.

  def init(self, key) -> Any:
    return cht.init_hypertransformer(self.ht, key, self.config)

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False):
    del remat
    num_tasks, support_size = support_labels.shape
    if num_tasks > self.max_eval_tasks:
      raise ValueError(f'Merged HT was built for {self.max_eval_tasks} tasks (K*T = '
                       f'{self.ht.num_ways} ways); an episode of {num_tasks} has more classes.')
    num_ways = support_size // self.config.episode.shots
    images, labels = merge_tasks(support_images, support_labels, num_ways)
    theta, embeddings = self.ht.apply({'params': params}, images, labels,
                                      ht_lib.zeros_theta(self.cnn, images.shape[1:]),
                                      with_support_embeddings=True)
    prototypes = losses.class_prototypes(embeddings, labels, num_tasks * num_ways)
    return base.broadcast(theta, num_tasks), prototypes.reshape(num_tasks, num_ways, -1)

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    """Queries of every task tau scored over all K*T classes: pairs (T-1, tau)."""
    num_tasks = episode['support_images'].shape[0]
    pairs = continual.TaskPairs(t=np.full(num_tasks, num_tasks - 1, np.int32),
                                tau=np.arange(num_tasks, dtype=np.int32))
    return base.loss_over_pairs(self, params, episode, loss, remat, pairs, vectorize)
