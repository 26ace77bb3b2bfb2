"""The interface every method offers the trainer (train.py) and the protocol (evaluate.py).

A method is a frozen dataclass built from a config by `methods.build`:

  name, display_name   config.method, and how result tables print it
  max_eval_tasks       None, or the most tasks an evaluation episode may have
  validation           'loss': the loss metrics of validation episodes;
                       'protocol': the evaluation protocol, one query draw
  batch_size           what one training step's batch is split over devices by
  init(key)            the trained parameters at step 0
  learning_rate(optim) an optax schedule, or None for the paper's decay
  step_variant(step)   (static, inputs): what changes along training (MAML++'s
                       phases): `static` picks the compiled step, `inputs` are
                       arrays it takes
  grads(params, data, key, ...)  one training step's mean gradient and metrics
  episode_accuracies(params, episode, pairs, vectorize)
                       (task-incremental [P], class-incremental [P]) of every
                       pair (theta_t, task tau <= t) of one evaluation episode
  trained_tasks(T_eval) the T beyond which theta_t extrapolates

Two families share most of it, one class each below: `EpisodicMethod` (CHT,
ConstPN, Merged HT: theta_t and frozen prototypes from the support sets, an
episode loss) and `SequentialMethod` (fine-tuning, EWC, MAML++: theta_t
learnt by gradient steps on S(t), scored by a K*T head).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from cht_jax import continual
from cht_jax.methods import sequential
from cht_jax.data import augment as augment_lib
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import pipeline
from cht_jax.runtime import devices


@dataclasses.dataclass(frozen=True)
class Method:
  """What every method shares; `config` is the (frozen) experiment config."""
  config: ml_collections.FrozenConfigDict
  max_eval_tasks = None
  name = ''
  display_name = ''

  @classmethod
  def from_config(cls, config: ml_collections.FrozenConfigDict,
                  num_train_classes: int | None = None) -> 'Method':
    del num_train_classes  # Only where parameters depend on it (finetune.py).
    return cls(config)

  @property
  def batch_size(self) -> int:
    return self.config.train.episodes_per_step

  def learning_rate(self, optim):
    del optim
    return None  # The paper's schedule (`optim.learning_rate_schedule`).

  def step_variant(self, step: int) -> tuple[Any, Any]:
    del step
    return (), ()

  def trained_tasks(self, num_eval_tasks: int) -> int:
    del num_eval_tasks
    return self.config.episode.num_tasks


@dataclasses.dataclass(frozen=True)
class EpisodicMethod(Method):
  """theta_0..theta_{T-1} and prototypes from the support sets; Algorithm 1's loss.

  Subclasses give `init`, `thetas_and_prototypes`, `episode_loss` and `cnn`.
  """
  validation = 'loss'
  task_incremental_score = 'task_incremental'

  def training_spec(self, domain_sizes=()) -> episodes_lib.EpisodeSpec:
    return datasets.episode_spec(self.config, domain_sizes)

  def grads(self, params, data, key, *, mesh, variant=(), inputs=(), domain_sizes=(),
            host=False):
    """Samples (or takes, with `host`) the step's episodes, augments them, and
    averages the episode loss's gradient over them, split over `mesh`."""
    del variant, inputs  # One compiled step throughout (`Method.step_variant`).
    config = self.config
    spec = self.training_spec(domain_sizes)
    if host:  # `data` is the step's episode batch.
      episodes = pipeline.device_episodes(data)
    else:
      episodes = episodes_lib.sample_episodes(
          key, data, spec, config.train.episodes_per_step, rotate=config.data.rotate)
      # Sampled whole on every device (a few ms per step), then split: with the
      # batch's sharding propagated into it, XLA gathered the sampler's scores
      # around its top-k, and two all-gathers in flight at once can hang
      # XLA:CPU (each blocks one of the pool's threads, here 2, that the other
      # device needs to reach them).
      episodes = jax.lax.with_sharding_constraint(episodes, jax.NamedSharding(mesh, jax.P()))
    episodes = augment_lib.augment_episodes(jax.random.fold_in(key, 1), episodes,
                                            datasets.augment_spec(config))
    episodes = jax.lax.with_sharding_constraint(episodes, jax.NamedSharding(mesh, jax.P('data')))
    vectorize = continual.vectorize_option(config.model.vectorize)
    remat = continual.remat_option(config.model.remat, vectorize, spec.num_tasks)
    loss_fn = lambda p, episode: self.episode_loss(p, episode, config.loss, remat,
                                                   vectorize=vectorize)
    return devices.batch_grads(loss_fn, params, episodes, mesh, vectorize)

  def episode_accuracies(self, params, episode, pairs: continual.TaskPairs,
                         vectorize: bool = False):
    """Accuracies of every (theta_t, tau <= t) pair on one evaluation episode.

    Args:
      params: the method's parameters.
      episode: from `episodes.sample_evaluation_episode`: support [T, K*N, ...],
        query_images [R, T, K*Q, H, W, C], query_labels [T, K*Q], and for
        semi-supervised episodes unlabeled_images [T, K*U, H, W, C] (the
        same for every draw).
      pairs: `TaskPairs.lower_triangle(T)`.
      vectorize: see `embed_query_draws`.

    Returns:
      (task_incremental [P], class_incremental [P]): mean over the R draws of
      the accuracy on the K*Q queries of tau under theta_t, pair p = (t, tau).
      With `task_incremental_score` 'cross_entropy' (CHT with loss=
      'cross_entropy') the task-incremental accuracy is that of the head's K logits.
    """
    thetas, prototypes = self.thetas_and_prototypes(
        params, episode['support_images'], episode['support_labels'], remat=False,
        **unlabeled_support(episode))
    embeddings = embed_query_draws(self, thetas, episode['query_images'], pairs, vectorize)

    def score(loss):  # Mean over draws of the accuracy of each pair: [P].
      accuracy = jax.vmap(
          lambda e: continual.pair_losses(loss, e, episode['query_labels'], prototypes,
                                          pairs)[1], in_axes=1)(embeddings)
      return accuracy.mean(axis=0)

    return score(self.task_incremental_score), score('class_incremental')


def embed_query_draws(method, thetas, query_images: jax.Array, pairs: continual.TaskPairs,
                      vectorize: bool) -> jax.Array:
  """Embeds every query draw of every task with every theta_t, t >= tau.

  `continual.embed_queries` for each draw (each draw of Q(tau) is a batch of
  its own for BatchNorm): on CPU, one draw and one pair at a time
  (`vectorize=False`) keeps each batch in cache and runs faster than
  vmapping them (docs/evaluation.md); accelerators want everything vmapped.

  Args:
    method: its `.cnn` is applied.
    thetas: theta_0..theta_{T-1}, leaves with a leading T axis.
    query_images: [R, T, K*Q, H, W, C].
    pairs: `TaskPairs.lower_triangle(T)`.
    vectorize: vmap over pairs and draws instead of looping.

  Returns:
    [P, R, K*Q, D].
  """
  embed_draw = lambda images: continual.embed_queries(
      method.cnn, thetas, images, pairs, remat=False, vectorize=vectorize)
  embeddings = jax.lax.map(embed_draw, query_images,
                           batch_size=query_images.shape[0] if vectorize else None)
  return jnp.swapaxes(embeddings, 0, 1)


def unlabeled_support(episode) -> dict[str, jax.Array]:
  """{'unlabeled_images': [T, K*U, H, W, C]} of a semi-supervised episode, else {}:
  keyword arguments of `thetas_and_prototypes`, which only methods that take
  unlabeled images (CHT) are given (config validation rejects the others)."""
  if 'unlabeled_images' in episode:
    return {'unlabeled_images': episode['unlabeled_images']}
  return {}


def broadcast(tree: Any, num_tasks: int) -> Any:
  """The same theta for every t: leaves get a leading T axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_tasks, *x.shape)), tree)


def loss_over_pairs(method, params, episode, loss: str, remat: bool,
                    pairs: continual.TaskPairs, vectorize: bool | None = None):
  """`continual.episode_loss` with the thetas of `method` and the given pairs."""
  thetas, prototypes = method.thetas_and_prototypes(
      params, episode['support_images'], episode['support_labels'], remat=remat,
      **unlabeled_support(episode))
  return continual.pairs_loss(method.cnn, thetas, prototypes, episode, loss, pairs, remat,
                              vectorize)


@dataclasses.dataclass(frozen=True)
class SequentialMethod(Method):
  """theta_t = update(theta_{t-1}, S(t)) by gradient steps; a K*T head scores it.

  Subclasses give `init`, `grads` and `sequence_learner`.
  """
  validation = 'protocol'

  def episode_accuracies(self, params, episode, pairs: continual.TaskPairs,
                         vectorize: bool = False):
    """As `EpisodicMethod.episode_accuracies`, from the head's logits."""
    cnn, learn = self.sequence_learner(params, len(episode['support_labels']))
    thetas = learn(episode['support_images'], episode['support_labels'])
    return sequential.episode_accuracies(cnn, thetas, episode['query_images'],
                                         episode['query_labels'], self.config.episode.ways,
                                         pairs, vectorize)
