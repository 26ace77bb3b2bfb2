"""The continual step: theta_t = HT(S(t), theta_{t-1}), prototypes, and the loss of Algorithm 1.

One `jax.lax.scan` over the T tasks threads theta_t through the HyperTransformer and returns
every theta_t with its task's prototypes, computed once with theta_t and frozen (eq. 4). The loss
embeds the queries of every task tau <= t with theta_t: T(T+1)/2 passes, one vmapped pass over
the (t, tau) pairs rather than inside the scan (where fixed shapes would force T^2).
Unlabeled support images (`unlabeled_images` [T, U, H, W, C], optional) reach the
HyperTransformer of their task, never the prototypes or the loss. All for one episode.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cht_jax import losses
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import hypertransformer as ht_lib

VECTORIZE_OPTIONS = ('auto', 'vmap', 'loop')
REMAT_OPTIONS = ('auto', True, False)
# Up to this many tasks, 'auto' does not rematerialise looped episodes (CPU).
REMAT_AUTO_MAX_TASKS_WITHOUT = 2
Episode = dict[str, jax.Array]  # support_images [T, S, H, W, C], support_labels [T, S],
                                # query_images [T, Q, H, W, C], query_labels [T, Q],
                                # optional unlabeled_images [T, U, H, W, C]


class TaskPairs(NamedTuple):
  """All (t, tau) with tau <= t, t-major: t = [0, 1, 1, 2, 2, 2, ...]."""
  t: np.ndarray
  tau: np.ndarray

  @classmethod
  def lower_triangle(cls, num_tasks: int) -> 'TaskPairs':
    t, tau = np.tril_indices(num_tasks)
    return cls(t.astype(np.int32), tau.astype(np.int32))


def generate_task(ht: ht_lib.HyperTransformer, ht_params: Any, support_images: jax.Array,
                  support_labels: jax.Array, theta_prev: Any,
                  unlabeled_images: jax.Array | None = None):
  """theta_t = HT(S(t), theta_{t-1}) and task t's prototypes [K, D] (eq. 4), from support
  images [S, H, W, C], labels [S] and optional unlabeled images [U, H, W, C]."""
  theta, embeddings = ht.apply({'params': ht_params}, support_images, support_labels,
                               theta_prev, with_support_embeddings=True,
                               unlabeled_images=unlabeled_images)
  return theta, losses.class_prototypes(embeddings, support_labels, ht.num_ways)


def generate_thetas(ht: ht_lib.HyperTransformer, ht_params: Any,
                    support_images: jax.Array, support_labels: jax.Array,
                    theta_init: Any = None, remat: bool = True, unroll: bool = False,
                    unlabeled_images: jax.Array | None = None):
  """(thetas, leaves stacked on a leading T axis; prototypes [T, K, D], row t from theta_t) of
  one episode's support_images [T, S, H, W, C], support_labels [T, S], unlabeled_images
  [T, U, H, W, C] or None. `theta_init`: theta_{-1} (None: zeros, plain HT); `remat`
  recomputes each task in the backward pass; `unroll` for XLA's cost analysis."""
  if theta_init is None:
    theta_init = ht_lib.zeros_theta(ht.cnn, support_images.shape[2:])

  def task_step(theta_prev, task):
    images, labels, *unlabeled = task
    theta, prototypes = generate_task(ht, ht_params, images, labels, theta_prev, *unlabeled)
    return theta, (theta, prototypes)

  if remat:
    task_step = jax.checkpoint(task_step)
  tasks = (support_images, support_labels)
  if unlabeled_images is not None:
    tasks += (unlabeled_images,)
  _, (thetas, prototypes) = jax.lax.scan(task_step, theta_init, tasks, unroll=unroll)
  return thetas, prototypes


def default_vectorize() -> bool:
  """Whether to vmap pairs and episodes: not on CPU, where loops win (docs/performance.md)."""
  return jax.default_backend() != 'cpu'


def vectorize_option(option: str) -> bool:
  """`model.vectorize` ('auto' | 'vmap' | 'loop') -> whether to vmap."""
  if option not in VECTORIZE_OPTIONS:
    raise ValueError(f'model.vectorize = {option!r}; expected one of {VECTORIZE_OPTIONS}.')
  return default_vectorize() if option == 'auto' else option == 'vmap'


def remat_option(option: str | bool, vectorize: bool, num_tasks: int) -> bool:
  """`model.remat` ('auto' | True | False, or 'True'/'False') -> whether to rematerialise:
  'auto' where episodes are vmapped (memory), or looped for enough tasks (docs/performance.md)."""
  option = {'true': True, 'false': False}.get(str(option).lower(), option)
  if option not in REMAT_OPTIONS or (option != 'auto' and not isinstance(option, bool)):
    raise ValueError(f'model.remat = {option!r}; expected one of {REMAT_OPTIONS}.')
  if option == 'auto':
    return vectorize or num_tasks > REMAT_AUTO_MAX_TASKS_WITHOUT
  return option


def embed_queries(cnn: cnn_lib.CNN, thetas: Any, query_images: jax.Array,
                  pairs: TaskPairs, remat: bool = True,
                  vectorize: bool | None = None) -> jax.Array:
  """Embeds Q(tau) with theta_t for every pair, [T, Q, H, W, C] -> [P, Q, D], each query set
  its own BatchNorm batch. `vectorize` (None: `default_vectorize`) vmaps the pairs."""
  apply = lambda theta, images: cnn.apply({'params': theta}, images)
  if remat:
    apply = jax.checkpoint(apply)
  if vectorize is None:
    vectorize = default_vectorize()
  pair_thetas = jax.tree.map(lambda leaf: leaf[pairs.t], thetas)
  return jax.lax.map(lambda pair: apply(*pair), (pair_thetas, query_images[pairs.tau]),
                     batch_size=len(pairs.t) if vectorize else None)


def pair_losses(loss: str, query_embeddings: jax.Array, query_labels: jax.Array,
                prototypes: jax.Array, pairs: TaskPairs):
  """(cross_entropy [P], accuracy [P]) of every (t, tau) pair, means over the Q queries, from
  query_embeddings [P, Q, D], query_labels [T, Q] and prototypes [T, K, D]."""
  def one_pair(embeddings, t, tau):
    logits, offset = losses.pair_logits(loss, embeddings, prototypes, t, tau)
    return losses.cross_entropy_and_accuracy(logits, query_labels[tau] + offset)

  return jax.vmap(one_pair)(query_embeddings, pairs.t, pairs.tau)


def episode_loss(ht: ht_lib.HyperTransformer, ht_params: Any, episode: Episode,
                 loss: str = 'class_incremental', remat: bool = True,
                 vectorize: bool | None = None, unroll: bool = False):
  """Algorithm 1 for one episode: sum over t, tau <= t of L(Q(tau); theta_t), each term the mean
  over Q(tau) (as the original HT's cross-entropy), the sum as in eq. 2-3. (loss, metrics:
  'accuracy' over pairs, 'final_accuracy' of theta_{T-1}, 'theta_norm' watched for divergence)."""
  thetas, prototypes = generate_thetas(
      ht, ht_params, episode['support_images'], episode['support_labels'], remat=remat,
      unroll=unroll, unlabeled_images=episode.get('unlabeled_images'))
  pairs = TaskPairs.lower_triangle(episode['support_images'].shape[0])
  return pairs_loss(ht.cnn, thetas, prototypes, episode, loss, pairs, remat, vectorize)


def pairs_loss(cnn: cnn_lib.CNN, thetas: Any, prototypes: jax.Array, episode: Episode,
               loss: str, pairs: TaskPairs, remat: bool = True,
               vectorize: bool | None = None):
  """`episode_loss` over `pairs`, given the thetas (of `cnn`) and prototypes."""
  embeddings = embed_queries(cnn, thetas, episode['query_images'], pairs, remat=remat,
                             vectorize=vectorize)
  cross_entropy, accuracy = pair_losses(
      loss, embeddings, episode['query_labels'], prototypes, pairs)
  final = pairs.t == episode['support_images'].shape[0] - 1
  metrics = {
      'loss': jnp.sum(cross_entropy),
      'accuracy': jnp.mean(accuracy),
      'final_accuracy': jnp.mean(accuracy[final]),
      'theta_norm': optax.tree.norm(thetas),
  }
  return metrics['loss'], metrics
