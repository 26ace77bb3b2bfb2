"""The interface every method offers the trainer (train.py) and the protocol (evaluate.py).

A method is a frozen dataclass built from a config by `methods.build`:

  name, display_name   config.method, and its name in result tables
  max_eval_tasks       None, or the most tasks an evaluation episode may have
  validation           'loss' (validation episodes' loss) or 'protocol' (one query draw)
  batch_size           what a step's batch is split over devices by
  init(key)            the parameters at step 0
  learning_rate(optim) an optax schedule, or None for the paper's decay
  step_variant(step)   (static, inputs): the compiled step and its arrays (MAML++'s phases)
  grads(params, data, key, ...)  a step's mean gradient and metrics
  episode_accuracies   accuracies of every (theta_t, tau <= t) of an evaluation episode
  task_specificity     own against swapped accuracy of two tasks' CNNs (episodic methods)
  trained_tasks(T_eval) the T beyond which theta_t extrapolates

Two families: `EpisodicMethod` (CHT, ConstPN, Merged HT: theta_t and prototypes
from the support sets, an episode loss) and `SequentialMethod` (fine-tuning,
EWC, MAML++: theta_t learnt by gradient steps on S(t), scored by a K*T head).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from cht_jax import continual
from cht_jax import losses
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
  """theta_t and prototypes from the support sets; Algorithm 1's loss. Subclasses give
  `init`, `thetas_and_prototypes`, `episode_loss` and `cnn`."""
  validation = 'loss'
  task_incremental_score = 'task_incremental'

  def training_spec(self, domain_sizes=()) -> episodes_lib.EpisodeSpec:
    return datasets.episode_spec(self.config, domain_sizes)

  def grads(self, params, data, key, *, mesh, variant=(), inputs=(), domain_sizes=(),
            host=False):
    """The mean episode-loss gradient of the step's episodes (sampled, or `data` with
    `host`), augmented, split over `mesh`."""
    del variant, inputs  # One compiled step throughout (`Method.step_variant`).
    config = self.config
    spec = self.training_spec(domain_sizes)
    if host:  # `data` is the step's episode batch.
      episodes = pipeline.device_episodes(data)
    else:
      episodes = episodes_lib.sample_episodes(
          key, data, spec, config.train.episodes_per_step, rotate=config.data.rotate)
      # Sampled whole on every device, then split: sharded, its all-gathers can hang XLA:CPU.
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
    """(task_incremental [P], class_incremental [P]) of every (theta_t, tau <= t) pair,
    means over the R query draws of an `episodes.sample_evaluation_episode` episode
    (query_images [R, T, K*Q, H, W, C]); 'cross_entropy' scoring uses the head's logits."""
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

  def task_specificity(self, params, episode, vectorize: bool = False):
    """(own, swapped, theta_a): does the CNN written for a task depend on that task?

    Tasks A and B are the two (disjoint) tasks of an evaluation episode; theta_a and
    theta_b are written from each support set alone, as the first task of an episode.
    A's queries are scored (task-incremental, over A's K classes, mean over the query
    draws) with theta_a ('own') and with theta_b ('swapped'), the prototypes always of
    A's support images under the CNN scored. Under 'cross_entropy' scoring the head's
    logits are the prediction, so the swap keeps A's own head and asks whether the layers
    below it are task-specific. own == swapped for a CNN that is the same for every task.
    """
    def first_task_theta(support_images, support_labels, unlabeled):  # An episode of T=1.
      thetas, _ = self.thetas_and_prototypes(
          params, support_images[None], support_labels[None], remat=False,
          **jax.tree.map(lambda x: x[None], unlabeled))
      return jax.tree.map(lambda leaf: leaf[0], thetas)

    # Both tasks through one traced generator and one traced CNN (vmap): half the program.
    two = lambda x: x[:2]
    thetas = jax.vmap(first_task_theta)(two(episode['support_images']),
                                        two(episode['support_labels']),
                                        jax.tree.map(two, unlabeled_support(episode)))
    theta_a = jax.tree.map(lambda leaf: leaf[0], thetas)
    score = self.task_incremental_score
    if score == 'cross_entropy':
      thetas = {**thetas, 'head': jax.tree.map(lambda head: jnp.stack([head[0], head[0]]),
                                               thetas['head'])}
    support_images, support_labels = episode['support_images'][0], episode['support_labels'][0]
    query_images, query_labels = episode['query_images'][:, 0], episode['query_labels'][0]
    num_ways = support_labels.shape[0] // self.config.episode.shots

    def accuracy(theta):  # Mean over the draws [R, K*Q, H, W, C], each a BatchNorm batch.
      embed = lambda images: self.cnn.apply({'params': theta}, images)
      prototypes = losses.class_prototypes(embed(support_images), support_labels, num_ways)
      embeddings = jax.lax.map(embed, query_images,
                               batch_size=query_images.shape[0] if vectorize else None)

      def draw_accuracy(draw_embeddings):
        logits, offset = losses.pair_logits(score, draw_embeddings, prototypes[None], 0, 0)
        return losses.cross_entropy_and_accuracy(logits, query_labels + offset)[1]
      return jnp.mean(jax.vmap(draw_accuracy)(embeddings))

    own, swapped = jax.vmap(accuracy)(thetas)
    return own, swapped, theta_a


def embed_query_draws(method, thetas, query_images: jax.Array, pairs: continual.TaskPairs,
                      vectorize: bool) -> jax.Array:
  """Every query draw [R, T, K*Q, H, W, C] of every tau embedded with every theta_t, t >= tau:
  [P, R, K*Q, D], each draw a BatchNorm batch; `vectorize` vmaps, else loops (CPU)."""
  embed_draw = lambda images: continual.embed_queries(
      method.cnn, thetas, images, pairs, remat=False, vectorize=vectorize)
  embeddings = jax.lax.map(embed_draw, query_images,
                           batch_size=query_images.shape[0] if vectorize else None)
  return jnp.swapaxes(embeddings, 0, 1)


def unlabeled_support(episode) -> dict[str, jax.Array]:
  """{'unlabeled_images': [T, K*U, H, W, C]} of a semi-supervised episode, else {}:
  keyword arguments of `thetas_and_prototypes` (only CHT takes them)."""
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
  """theta_t = update(theta_{t-1}, S(t)) by gradient steps, scored by a K*T head.
  Subclasses give `init`, `grads` and `sequence_learner`."""
  validation = 'protocol'

  def episode_accuracies(self, params, episode, pairs: continual.TaskPairs,
                         vectorize: bool = False):
    """As `EpisodicMethod.episode_accuracies`, from the head's logits."""
    cnn, learn = self.sequence_learner(params, len(episode['support_labels']))
    thetas = learn(episode['support_images'], episode['support_labels'])
    return sequential.episode_accuracies(cnn, thetas, episode['query_images'],
                                         episode['query_labels'], self.config.episode.ways,
                                         pairs, vectorize)
