"""ConstPN: one CNN with trained parameters, theta_t = params for every t (paper section 5.2).

A prototypical network trained on tasks of `constpn_ways_multiplier` x K ways.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cht_jax import continual
from cht_jax import losses
from cht_jax import models
from cht_jax.data import datasets
from cht_jax.methods import base
from cht_jax.models import cnn as cnn_lib


@dataclasses.dataclass(frozen=True)
class ConstPN(base.EpisodicMethod):
  """A prototypical network: the CNN with trained parameters, the same for every task."""
  cnn: cnn_lib.CNN = None
  name = 'constpn'
  display_name = 'ConstPN'

  @classmethod
  def from_config(cls, config, num_train_classes=None) -> 'ConstPN':
    del num_train_classes
    return cls(config, cnn=models.build_hypertransformer(config).cnn)

  def training_spec(self, domain_sizes=()):
    """Single tasks of multiplier * K ways."""
    spec = super().training_spec(domain_sizes)
    return spec._replace(num_tasks=1,
                         ways=self.config.episode.ways * self.config.constpn_ways_multiplier)

  def init(self, key) -> Any:
    return self.cnn.init(key, jnp.zeros((1, *datasets.image_shape(self.config))))['params']

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False):
    del remat
    num_tasks, support_size = support_labels.shape
    num_ways = support_size // self.config.episode.shots

    def task_prototypes(images, labels):  # Each support set is a batch of its own.
      embeddings = self.cnn.apply({'params': params}, images)
      return losses.class_prototypes(embeddings, labels, num_ways)

    prototypes = jax.vmap(task_prototypes)(support_images, support_labels)
    return base.broadcast(params, num_tasks), prototypes

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    """Sum over (t, tau <= t) as CHT's; training episodes have T=1 (a plain ProtoNet)."""
    pairs = continual.TaskPairs.lower_triangle(episode['support_images'].shape[0])
    return base.loss_over_pairs(self, params, episode, loss, remat, pairs, vectorize)
