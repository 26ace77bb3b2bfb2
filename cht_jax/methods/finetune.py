"""Pretraining + fine-tuning, and EWC: the Table 1 baselines that fine-tune a pretrained CNN.

Training pretrains `models.cnn.CNN` with a head over all C training classes
(config.train.num_steps batches of baseline.pretrain_batch_size images,
baselines/pretrain.py). Evaluation fine-tunes it task after task with a fresh
K*T head: baseline.inner_steps SGD steps of baseline.inner_learning_rate on
each S(t) (baselines/rules.py), plus, for EWC, the penalty of the earlier
tasks (baseline.ewc_lambda, baseline.ewc_fisher; baselines/ewc.py).
"""

import dataclasses
from typing import Any

import jax

from cht_jax import config_validation
from cht_jax.baselines import ewc
from cht_jax.baselines import pretrain
from cht_jax.baselines import rules
from cht_jax.baselines import sequential
from cht_jax.data import datasets
from cht_jax.methods import base


@dataclasses.dataclass(frozen=True)
class Finetune(base.SequentialMethod):
  """Pretraining on the training classes, then fine-tuning on each task."""
  num_train_classes: int = 0  # C, the pretraining head's width.
  name = 'finetune'
  display_name = 'Pretraining + fine-tuning'
  batch_size = 1  # One batch of images: split over devices, BatchNorm would see less.

  @classmethod
  def from_config(cls, config, num_train_classes=None) -> 'Finetune':
    """`num_train_classes`: C of the dataset trained on; None takes the training
    split's of `data.dataset` from the config (no data is read)."""
    if num_train_classes is None:
      num_train_classes = config_validation.nominal_split_classes(config)['train'][0]
    return cls(config, num_train_classes=num_train_classes)

  def pretraining_cnn(self):
    return pretrain.build_cnn(self.config, self.num_train_classes)

  def init(self, key) -> Any:
    return pretrain.init_theta(self.pretraining_cnn(), key, datasets.image_shape(self.config))

  def grads(self, params, data, key, **unused):
    """The cross-entropy over all C classes of one random batch of training images."""
    del unused
    cnn, b = self.pretraining_cnn(), self.config.baseline

    def loss_fn(params):
      images, labels = pretrain.sample_batch(key, data, b.pretrain_batch_size,
                                             self.config.data.rotate)
      loss, accuracy = pretrain.batch_loss(cnn, params, images, labels)
      return loss, {'loss': loss, 'accuracy': accuracy}

    return jax.grad(loss_fn, has_aux=True)(params)

  def trained_tasks(self, num_eval_tasks: int) -> int:
    return num_eval_tasks  # Pretraining never sees a task sequence: nothing extrapolates.

  def update_rule(self, cnn, num_tasks: int, theta):
    """(rule, its initial state) for `sequential.run_sequence`."""
    del num_tasks, theta
    b = self.config.baseline
    return rules.finetune_rule(cnn, self.config.episode.ways, b.inner_steps,
                               b.inner_learning_rate), ()

  def sequence_learner(self, params, num_tasks: int):
    """(cnn with a K*num_tasks head, learn(support_images [T, S, ...], support_labels
    [T, S]) -> theta_0..theta_{T-1}, leaves [T, ...]) of the pretrained `params`."""
    num_outputs = self.config.episode.ways * num_tasks
    cnn = pretrain.build_cnn(self.config, num_outputs)
    theta = pretrain.fresh_head(params, num_outputs, self.config.baseline.head_init,
                                jax.random.fold_in(jax.random.key(self.config.seed), 1))
    rule, state = self.update_rule(cnn, num_tasks, theta)
    return cnn, lambda images, labels: sequential.run_sequence(rule, theta, state, images,
                                                               labels)


@dataclasses.dataclass(frozen=True)
class EWC(Finetune):
  """Fine-tuning plus EWC's penalty on the earlier tasks' parameters."""
  name = 'ewc'
  display_name = 'EWC'

  def update_rule(self, cnn, num_tasks: int, theta):
    b = self.config.baseline
    rule = rules.ewc_rule(cnn, self.config.episode.ways, b.inner_steps,
                          b.inner_learning_rate, b.ewc_lambda, b.ewc_fisher)
    return rule, ewc.init_state(theta, num_tasks)
