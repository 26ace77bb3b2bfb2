"""MAML++: a meta-learned initialisation and inner learning rates (baselines/maml.py).

Meta-trained on episodes of the training classes for config.train.num_steps
steps: first order for the first baseline.maml_first_order_steps, with the
multi-step loss for the first baseline.maml_msl_anneal_steps, the meta rate
annealed by cosine to baseline.maml_min_learning_rate. Evaluation runs its
inner loop task after task on a K*T head.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from cht_jax.baselines import maml
from cht_jax.baselines import pretrain
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.methods import base
from cht_jax.runtime import devices


@dataclasses.dataclass(frozen=True)
class MAML(base.SequentialMethod):
  """MAML++ with per-layer per-step inner rates (LSLR) and a K*T head."""
  name = 'maml'
  display_name = 'MAML++'

  @property
  def max_eval_tasks(self) -> int:
    return self.config.episode.num_tasks  # The head has K*T outputs.

  @property
  def cnn(self):
    return pretrain.build_cnn(self.config, self.config.episode.ways * self.config.episode.num_tasks)

  def init(self, key) -> Any:
    b = self.config.baseline
    theta = pretrain.init_theta(self.cnn, key, datasets.image_shape(self.config))
    return maml.init_params(theta, b.inner_steps, b.inner_learning_rate)

  def learning_rate(self, optim):
    """Cosine annealing from optim.learning_rate to baseline.maml_min_learning_rate."""
    b = self.config.baseline
    if not b.maml_cosine_annealing:
      return None
    return optax.cosine_decay_schedule(
        optim.learning_rate, self.config.train.num_steps,
        alpha=min(b.maml_min_learning_rate / optim.learning_rate, 1.0))

  def step_variant(self, step: int):
    """((first_order, multi_step), step_weights [k]) of training step `step` (1-based)."""
    b = self.config.baseline
    first_order = step <= b.maml_first_order_steps
    multi_step = bool(b.maml_multi_step_loss) and step - 1 < b.maml_msl_anneal_steps
    weights = maml.multi_step_weights(step - 1, b.inner_steps, b.maml_msl_anneal_steps)
    return (first_order, multi_step), jnp.asarray(weights)

  def grads(self, params, data, key, *, mesh, variant=(False, False), inputs=None, **unused):
    """The mean meta-loss of train.episodes_per_step episodes, split over `mesh`."""
    del unused
    first_order, multi_step = variant
    config, b = self.config, self.config.baseline
    episodes = episodes_lib.sample_episodes(key, data, datasets.episode_spec(config),
                                            config.train.episodes_per_step, config.data.rotate)
    episodes = jax.lax.with_sharding_constraint(episodes, jax.NamedSharding(mesh, jax.P('data')))
    loss_fn = lambda p, episode: maml.episode_loss(
        self.cnn, p, episode, config.episode.ways, b.inner_steps,
        inputs if multi_step else None, first_order, b.maml_learn_inner_lr)
    return devices.batch_grads(loss_fn, params, episodes, mesh, vectorize=True)

  def sequence_learner(self, params, num_tasks: int):
    """(cnn with a K*num_tasks head, learn(support_images, support_labels) -> thetas)."""
    ways, trained = self.config.episode.ways, self.config.episode.num_tasks
    if num_tasks > trained:
      raise ValueError(  # evaluate.evaluate checks max_eval_tasks first.
          f'MAML++ was meta-trained with a head for T={trained} tasks of {ways} classes; '
          f'it cannot be evaluated on {num_tasks} tasks. Use --eval_tasks <= {trained}.')
    num_outputs = ways * num_tasks
    cnn = pretrain.build_cnn(self.config, num_outputs)
    head = params['theta']['head']
    theta = {**params['theta'], 'head': {'kernel': head['kernel'][:, :num_outputs],
                                         'bias': head['bias'][:num_outputs]}}
    learn = lambda images, labels: maml.learn(
        cnn, {'theta': theta, 'lslr': params['lslr']}, images, labels, ways,
        self.config.baseline.inner_steps)
    return cnn, learn
