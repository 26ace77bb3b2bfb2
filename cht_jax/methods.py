"""What produces the CNN weights theta_t: CHT, or the ConstPN and Merged HT baselines.

`config.method` picks one, here and only here (`build`); training (`train.py`)
and the evaluation protocol (`evaluate.py`) call through the object it returns.
Every method fills the same network, `models.cnn.CNN` (`method.cnn`), and
answers the same two questions:

* `thetas_and_prototypes(params, support_images [T, K*N, ...], support_labels)`:
  theta_0..theta_{T-1} (leaves with a leading T axis) and the frozen
  prototypes [T, K, D] of every task. The evaluation protocol then embeds the
  queries of task tau with theta_t and scores them, whatever the method.
* `episode_loss(params, episode, loss, remat, vectorize)`: the training objective on one
  episode, with the metrics of `continual.episode_loss`.

Methods (DESIGN.md 1.5; paper section 5.2):
  cht        theta_t = HT(S(t), theta_{t-1}); Algorithm 1 (`continual.py`).
  constpn    ConstPN: one CNN with *trained* parameters, theta_t = params for
             every t; a prototypical network trained on single tasks with
             `constpn_ways_multiplier` x K ways (100-way for 20-way Omniglot),
             evaluated on K-way tasks. Its parameters have exactly the
             structure of a generated theta (`zeros_theta(cnn, ...)`).
  merged_ht  Merged HT: one plain HT (theta_{-1} = 0) with K*T ways, given the
             support sets of all T tasks of the episode at once as one K*T-way
             task (task tau's class k is merged label tau*K + k). Its theta
             serves every t and its prototypes are computed from the merged
             support batch; trained with the class-incremental cross-entropy
             of every task's queries over all K*T classes. Only the
             class-incremental accuracy of theta_{T-1} on tasks 0..T-1 is the
             Merged HT baseline of the paper (its stars in Figure 4); the
             entries for t < T-1 use a theta that has seen the later tasks'
             support sets. It cannot be evaluated on more tasks than trained.

A bare `HyperTransformer` passed where a method is expected means CHT
(`as_method`), so code and tests that hand `train`/`evaluate` a
HyperTransformer keep working unchanged.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cht_jax import continual
from cht_jax import losses
from cht_jax import models
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import hypertransformer as ht_lib

METHODS = ('cht', 'constpn', 'merged_ht')
DISPLAY_NAMES = {'cht': 'CHT', 'constpn': 'ConstPN', 'merged_ht': 'Merged HT'}


def _broadcast(tree: Any, num_tasks: int) -> Any:
  """The same theta for every t: leaves get a leading T axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_tasks, *x.shape)), tree)


def _loss_over_pairs(method, params, episode, loss: str, remat: bool,
                     pairs: continual.TaskPairs, vectorize: bool | None = None):
  """`continual.episode_loss` with the thetas of `method` and the given pairs."""
  thetas, prototypes = method.thetas_and_prototypes(
      params, episode['support_images'], episode['support_labels'], remat=remat)
  return continual.pairs_loss(method, thetas, prototypes, episode, loss, pairs, remat,
                              vectorize)


@dataclasses.dataclass(frozen=True)
class CHT:
  """The Continual HyperTransformer (T=1: plain HT)."""
  ht: ht_lib.HyperTransformer
  # loss='cross_entropy': score the task-incremental setting with the head's K
  # logits (HT's own prediction, appendix A.1) instead of prototypes.
  head_logits: bool = False
  name = 'cht'
  max_eval_tasks = None  # Any number (beyond the trained T extrapolates).

  @property
  def cnn(self) -> cnn_lib.CNN:
    return self.ht.cnn

  @property
  def task_incremental_score(self) -> str:
    return 'cross_entropy' if self.head_logits else 'task_incremental'

  def init(self, key, image_shape, shots: int) -> Any:
    num_ways = self.ht.num_ways
    support_images = jnp.zeros((num_ways * shots, *image_shape))
    support_labels = jnp.zeros((num_ways * shots,), jnp.int32)
    theta = ht_lib.zeros_theta(self.ht.cnn, image_shape)
    return self.ht.init(key, support_images, support_labels, theta)['params']

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False):
    return continual.generate_thetas(self.ht, params, support_images, support_labels,
                                     remat=remat)

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    return continual.episode_loss(self.ht, params, episode, loss, remat, vectorize)


@dataclasses.dataclass(frozen=True)
class ConstPN:
  """A prototypical network: the CNN with trained parameters, the same for every task."""
  cnn: cnn_lib.CNN
  shots: int  # N; the ways of an episode are its support size / N.
  name = 'constpn'
  max_eval_tasks = None
  task_incremental_score = 'task_incremental'

  def init(self, key, image_shape, shots: int) -> Any:
    del shots
    return self.cnn.init(key, jnp.zeros((1, *image_shape)))['params']

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False):
    del remat
    num_tasks, support_size = support_labels.shape
    num_ways = support_size // self.shots

    def task_prototypes(images, labels):  # Each support set is a batch of its own.
      embeddings = self.cnn.apply({'params': params}, images)
      return losses.class_prototypes(embeddings, labels, num_ways)

    prototypes = jax.vmap(task_prototypes)(support_images, support_labels)
    return _broadcast(params, num_tasks), prototypes

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    """Sum over (t, tau <= t) as CHT's; training episodes have T=1 (a plain ProtoNet)."""
    pairs = continual.TaskPairs.lower_triangle(episode['support_images'].shape[0])
    return _loss_over_pairs(self, params, episode, loss, remat, pairs, vectorize)


def merge_tasks(support_images, support_labels, num_ways: int):
  """T K-way tasks -> one K*T-way task: [T, S, ...] -> [T*S, ...], label tau*K + k."""
  num_tasks, support_size = support_labels.shape
  offsets = (jnp.arange(num_tasks, dtype=support_labels.dtype) * num_ways)[:, None]
  return (support_images.reshape(num_tasks * support_size, *support_images.shape[2:]),
          (support_labels + offsets).reshape(-1))


@dataclasses.dataclass(frozen=True)
class MergedHT:
  """One plain HT over the T tasks of an episode merged into one K*T-way task."""
  ht: ht_lib.HyperTransformer  # num_ways = K * T.
  shots: int
  num_tasks: int  # T it was trained for; episodes may have fewer tasks, not more.
  name = 'merged_ht'
  task_incremental_score = 'task_incremental'

  @property
  def cnn(self) -> cnn_lib.CNN:
    return self.ht.cnn

  @property
  def max_eval_tasks(self) -> int:
    return self.num_tasks

  def init(self, key, image_shape, shots: int) -> Any:
    return CHT(self.ht).init(key, image_shape, shots)

  def thetas_and_prototypes(self, params, support_images, support_labels, remat=False):
    del remat
    num_tasks, support_size = support_labels.shape
    if num_tasks > self.num_tasks:
      raise ValueError(f'Merged HT was built for {self.num_tasks} tasks (K*T = '
                       f'{self.ht.num_ways} ways); an episode of {num_tasks} has more classes.')
    num_ways = support_size // self.shots
    images, labels = merge_tasks(support_images, support_labels, num_ways)
    theta, embeddings = self.ht.apply({'params': params}, images, labels,
                                      ht_lib.zeros_theta(self.cnn, images.shape[1:]),
                                      with_support_embeddings=True)
    prototypes = losses.class_prototypes(embeddings, labels, num_tasks * num_ways)
    return _broadcast(theta, num_tasks), prototypes.reshape(num_tasks, num_ways, -1)

  def episode_loss(self, params, episode, loss, remat=True, vectorize=None):
    """Queries of every task tau scored over all K*T classes: pairs (T-1, tau)."""
    num_tasks = episode['support_images'].shape[0]
    pairs = continual.TaskPairs(t=np.full(num_tasks, num_tasks - 1, np.int32),
                                tau=np.arange(num_tasks, dtype=np.int32))
    return _loss_over_pairs(self, params, episode, loss, remat, pairs, vectorize)


Method = CHT | ConstPN | MergedHT


def method_name(config: ml_collections.ConfigDict) -> str:
  """`config.method`; 'cht' for configs saved before the field existed (config.json)."""
  return config.get('method', 'cht')


def build(config: ml_collections.ConfigDict) -> Method:
  """The method of `config.method`, with the model of `config.model`."""
  ht = models.build_hypertransformer(config)
  name = method_name(config)
  if name == 'cht':
    return CHT(ht, head_logits=config.loss == 'cross_entropy')
  if name == 'constpn':
    return ConstPN(ht.cnn, shots=config.episode.shots)
  if name == 'merged_ht':
    num_tasks = config.episode.num_tasks
    return MergedHT(ht.clone(num_ways=config.episode.ways * num_tasks),
                    shots=config.episode.shots, num_tasks=num_tasks)
  raise ValueError(f'Unknown config.method {name!r}; expected one of {METHODS}.')


def as_method(model: Any) -> Method:
  """A method, or a bare HyperTransformer taken as CHT."""
  if isinstance(model, ht_lib.HyperTransformer):
    return CHT(model)
  return model


def display_name(config: ml_collections.ConfigDict) -> str:
  return DISPLAY_NAMES[method_name(config)]


def training_spec(config: ml_collections.ConfigDict,
                  domain_sizes: tuple[int, ...] = ()) -> episodes_lib.EpisodeSpec:
  """Training episodes: the config's, except ConstPN's single tasks of multiplier*K ways."""
  ep = config.episode
  spec = datasets.episode_spec(config, domain_sizes)
  if method_name(config) == 'constpn':
    spec = spec._replace(num_tasks=1, ways=ep.ways * config.constpn_ways_multiplier)
  return spec
