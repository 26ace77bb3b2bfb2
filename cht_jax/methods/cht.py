"""The Continual HyperTransformer: theta_t = HT(S(t), theta_{t-1}), Algorithm 1 (T=1: plain HT)."""

import dataclasses
from typing import Any

import jax.numpy as jnp

from cht_jax import continual
from cht_jax import models
from cht_jax.data import datasets
from cht_jax.methods import base
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import hypertransformer as ht_lib


@dataclasses.dataclass(frozen=True)
class CHT(base.EpisodicMethod):
  """CHT; with loss='cross_entropy' the task-incremental setting is scored with the
  head's K logits (HT's own prediction, appendix A.1) instead of prototypes."""
  ht: ht_lib.HyperTransformer = None
  name = 'cht'
  display_name = 'CHT'

  @classmethod
  def from_config(cls, config, num_train_classes=None) -> 'CHT':
    del num_train_classes
    return cls(config, ht=models.build_hypertransformer(config))

  @property
  def cnn(self) -> cnn_lib.CNN:
    return self.ht.cnn

  @property
  def task_incremental_score(self) -> str:
    return 'cross_entropy' if self.config.loss == 'cross_entropy' else 'task_incremental'

  def init(self, key) -> Any:
    return init_hypertransformer(self.ht, key, self.config)

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False,
                            unlabeled_images=None):
    """theta_0..theta_{T-1} and prototypes [T, K, D]; `unlabeled_images` [T, K*U,
    H, W, C] (semi-supervised episodes) reach the HyperTransformer only."""
    return continual.generate_thetas(self.ht, params, support_images, support_labels,
                                     remat=remat, unlabeled_images=unlabeled_images)

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    return continual.episode_loss(self.ht, params, episode, loss, remat, vectorize)


def init_hypertransformer(ht: ht_lib.HyperTransformer, key, config) -> Any:
  """Parameters of `ht` from a support set of its K ways and theta_{-1} = 0."""
  image_shape = datasets.image_shape(config)
  support_images = jnp.zeros((ht.num_ways * config.episode.shots, *image_shape))
  support_labels = jnp.zeros((ht.num_ways * config.episode.shots,), jnp.int32)
  theta = ht_lib.zeros_theta(ht.cnn, image_shape)
  return ht.init(key, support_images, support_labels, theta)['params']
