"""On-device sampling of continual few-shot episodes, in pure JAX.

An episode is T tasks, each a K-way N-shot support set and Q queries per class,
drawn from the class images [C, M, H, W, D] of one split kept on device. U > 0
adds 'unlabeled_images': U more images of each class, never a support or query
image. Samples are class-major: index k * N + n of a task is shot n of label k.

Independent draws (spec.independent_draws) are the original HT's convention
(hypertransformer/tf/core/datasets.py, `TaskGenerator._make_semisupervised_samples`):
support (with unlabeled) and queries each drawn without replacement, apart,
so a query may be a support image. Off, the N + Q + U images are distinct.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

TASK_CLASSES = ('disjoint', 'same', 'domain')


class EpisodeSpec(NamedTuple):
  """What one episode looks like: T tasks, K ways, N shots, Q queries and U unlabeled per class.

  Attributes:
    task_classes: 'disjoint': the T*K classes are distinct ("lifelong");
      'same': every task has the same K classes, new images each task
      ("mini-batch"); 'domain': each task's K classes from its own domain, the
      T domains distinct ("multi-domain").
    domain_sizes: for 'domain': the class count of each domain, whose classes
      come in domain order in the class images.
    independent_draws: the original HT's draws (module docstring); with 'same',
      each task draws anew, so images may repeat across tasks.
  """
  num_tasks: int
  ways: int
  shots: int
  queries_per_class: int
  task_classes: str = 'disjoint'
  domain_sizes: tuple[int, ...] = ()
  unlabeled_per_class: int = 0
  independent_draws: bool = False


def validate_spec(spec: EpisodeSpec, class_images_shape: tuple[int, ...],
                  rotate: bool = False) -> None:
  """Raises ValueError if `spec` cannot be sampled from class images (C, M, H, W, D)."""
  if len(class_images_shape) != 5:
    raise ValueError('class_images must be [classes, images, H, W, channels],'
                     f' got shape {tuple(class_images_shape)}.')
  num_classes, num_images, height, width, _ = class_images_shape
  found = spec_problems(spec, num_classes, num_images)
  if rotate and height != width:
    found.append(f'Rotation augmentation needs square images, got {height}x{width}.')
  if found:
    raise ValueError(' '.join(found))


def spec_problems(spec: EpisodeSpec, num_classes: int | None = None,
                  images_per_class: int | None = None, split: str = 'the split',
                  images: str | None = None, remedy: str = '') -> list[str]:
  """What keeps episodes of `spec` from being drawn from a split; [] if nothing.

  The one statement of these rules, for `validate_spec` and config validation;
  counts passed as None are not checked. `split` names the split in the
  messages, `images` what it has instead (default: `split` has only M), and
  `remedy` follows each problem after a colon. Returns one sentence per problem.
  """
  found = _field_problems(spec)
  if not found:  # The counts need valid fields.
    if num_classes is not None:
      found += (_domain_problems(spec, num_classes, split) if spec.task_classes == 'domain'
                else _class_problems(spec, num_classes, split))
    if images_per_class is not None:
      found += _image_problems(spec, images or f'{split} has only {images_per_class}',
                               images_per_class)
  return [f'{problem}: {remedy}.' if remedy else f'{problem}.' for problem in found]


def _field_problems(spec: EpisodeSpec) -> list[str]:
  """Fields out of range (in a config, config_validation.SCHEMA rejects them first)."""
  found = [f'episode.{field} must be >= 1, got {getattr(spec, field)}'
           for field in ('num_tasks', 'ways', 'shots') if getattr(spec, field) < 1]
  for field in ('queries_per_class', 'unlabeled_per_class'):
    if getattr(spec, field) < 0:
      found.append(f'episode.{field} must be >= 0, got {getattr(spec, field)}')
  if spec.task_classes not in TASK_CLASSES:
    found.append(f'episode.task_classes must be one of {TASK_CLASSES}, '
                 f'got {spec.task_classes!r}')
  return found


def _class_problems(spec: EpisodeSpec, num_classes: int, split: str) -> list[str]:
  """'disjoint' needs K * T classes, 'same' K (_draw_classes)."""
  if spec.task_classes == 'disjoint' and spec.num_tasks > 1:
    needed = spec.ways * spec.num_tasks
    what = (f'episode.ways * episode.num_tasks = {spec.ways} * {spec.num_tasks} = '
            f"{needed} distinct classes per episode (episode.task_classes='disjoint')")
  else:
    needed, what = spec.ways, f'episode.ways = {spec.ways} classes per task'
  if needed <= num_classes:
    return []
  return [f'{what} but {split} has only {num_classes} classes']


def _domain_problems(spec: EpisodeSpec, num_classes: int, split: str) -> list[str]:
  """'domain' needs T domains, each of at least K classes (`_draw_domain_classes`)."""
  sizes = tuple(spec.domain_sizes)
  if sum(sizes) != num_classes or min(sizes, default=1) < 1:
    return [f"episode.task_classes='domain' needs domain_sizes, the positive class count "
            f'of each domain, adding up to the {num_classes} classes of {split}; got '
            f'{sizes}, which add up to {sum(sizes)}']
  found = []
  if spec.num_tasks > len(sizes):
    domains = f'{len(sizes)} domain' + ('' if len(sizes) == 1 else 's')
    found.append(
        f"episode.task_classes='domain' needs episode.num_tasks = {spec.num_tasks} "
        f'domains but {split} has only {domains}' +
        (f' (of {list(sizes)} classes)' if sizes else ''))
  if sizes and spec.ways > min(sizes):
    found.append(
        f'episode.ways = {spec.ways} classes per task, each from one domain, but domain '
        f'{sizes.index(min(sizes))} has only {min(sizes)} classes in {split} '
        f'(of {list(sizes)})')
  return found


def _image_problems(spec: EpisodeSpec, images: str, images_per_class: int) -> list[str]:
  """Each class gives images_per_class_needed(spec) distinct images."""
  needed = images_per_class_needed(spec)
  if needed <= images_per_class:
    return []
  fields = ['shots', 'queries_per_class'] + (['unlabeled_per_class']
                                             if spec.unlabeled_per_class else [])
  names = ' + '.join(f'episode.{f}' for f in fields)
  values = ' + '.join(str(getattr(spec, f)) for f in fields)
  what = f'{names} = {values} = {needed} images per class'
  if spec.independent_draws:
    support = ' + '.join(f'episode.{f}' for f in fields if f != 'queries_per_class')
    what = (f'max({support}, episode.queries_per_class) = {needed} distinct images per '
            'class (episode.independent_draws: support and queries each drawn without '
            'replacement)')
  elif spec.task_classes == 'same':
    what = (f'episode.num_tasks * ({names}) = {spec.num_tasks} tasks * ({values}) = '
            f"{needed} distinct images per class (episode.task_classes='same': no image "
            'in two tasks)')
  return [f'{what}, but {images}']


def images_per_task(spec: EpisodeSpec) -> int:
  """N + Q + U: the images one task draws from each of its classes."""
  return spec.shots + spec.queries_per_class + spec.unlabeled_per_class


def images_per_class_needed(spec: EpisodeSpec) -> int:
  """Images each class of an episode must have.

  N + Q + U; T * (N + Q + U) with task_classes='same' (no image in two tasks);
  max(N + U, Q) with independent draws.
  """
  if spec.independent_draws:
    return max(spec.shots + spec.unlabeled_per_class, spec.queries_per_class)
  return images_per_task(spec) * (spec.num_tasks if spec.task_classes == 'same' else 1)


def normalize(images_uint8: jax.Array) -> jax.Array:
  """Maps uint8 0..255 to float32 x / 128 - 1 (in [-1, 0.9921875])."""
  return images_uint8.astype(jnp.float32) / 128.0 - 1.0


def rotate90(images: jax.Array, k: jax.Array) -> jax.Array:
  """Rotates images [..., S, H, W, D] (H == W) by k [...] ccw quarter turns, shared along S."""
  k = (k % 4)[..., None, None, None, None]
  out = images
  for i in range(1, 4):
    out = jnp.where(k == i, jnp.rot90(images, i, axes=(-3, -2)), out)
  return out


def _random_subset(key: jax.Array, shape: tuple[int, ...], population: int, size: int) -> jax.Array:
  """int32 [*shape, size]: distinct indices in [0, population), random order.

  The top-`size` of uniform scores: faster on CPU than `jax.random.permutation`.
  """
  scores = jax.random.uniform(key, (*shape, population))
  return jax.lax.top_k(scores, size)[1].astype(jnp.int32)


def _draw_classes(key: jax.Array, num_classes: int, spec: EpisodeSpec) -> jax.Array:
  """Class ids int32 [T, K] of one episode."""
  if spec.task_classes == 'disjoint':
    ids = _random_subset(key, (), num_classes, spec.num_tasks * spec.ways)
    return ids.reshape(spec.num_tasks, spec.ways)
  if spec.task_classes == 'domain':
    return _draw_domain_classes(key, spec)
  ids = _random_subset(key, (), num_classes, spec.ways)
  return jnp.tile(ids[None], (spec.num_tasks, 1))


def domain_offsets(domain_sizes: tuple[int, ...]) -> np.ndarray:
  """int32 [len(domain_sizes) + 1]: first class row of each domain, then C."""
  return np.concatenate([[0], np.cumsum(domain_sizes)]).astype(np.int32)


def _draw_domain_classes(key: jax.Array, spec: EpisodeSpec) -> jax.Array:
  """Class ids int32 [T, K]: task t's K classes from domain d_t, d distinct."""
  sizes = np.asarray(spec.domain_sizes, np.int32)
  offsets = jnp.asarray(domain_offsets(spec.domain_sizes)[:-1])
  domain_key, class_key = jax.random.split(key)
  domains = _random_subset(domain_key, (), len(sizes), spec.num_tasks)  # [T]
  # Top-K of uniform scores, classes past the domain's size scored -1 (never drawn).
  scores = jax.random.uniform(class_key, (spec.num_tasks, int(sizes.max())))
  valid = jnp.arange(int(sizes.max())) < jnp.asarray(sizes)[domains][:, None]
  ids = jax.lax.top_k(jnp.where(valid, scores, -1.0), spec.ways)[1]
  return (ids + offsets[domains][:, None]).astype(jnp.int32)


def _draw_images(key: jax.Array, num_images: int, spec: EpisodeSpec) -> jax.Array:
  """Image ids int32 [T, K, N+Q+U], distinct per class (across tasks for 'same')."""
  t, k, per_task = spec.num_tasks, spec.ways, images_per_task(spec)
  if spec.independent_draws:
    # The original HT draws support and query batches with one np.random.choice
    # each (hypertransformer/tf/core/datasets.py, TaskGenerator._images_labels):
    # here the first N + U and the first Q of two random orders.
    n, u, q = spec.shots, spec.unlabeled_per_class, spec.queries_per_class
    orders = _random_subset(key, (t, k, 2), num_images, max(n + u, q))
    support, queries = orders[..., 0, :n + u], orders[..., 1, :q]
    return jnp.concatenate([support[..., :n], queries, support[..., n:]], axis=-1)
  if spec.task_classes == 'same':
    ids = _random_subset(key, (k,), num_images, t * per_task)  # [K, T*(N+Q+U)]
    return ids.reshape(k, t, per_task).transpose(1, 0, 2)
  return _random_subset(key, (t, k), num_images, per_task)


def _rotations(key: jax.Array, spec: EpisodeSpec) -> jax.Array:
  """Quarter turns int32 [T, K], one per class (the same in every task that has it)."""
  if spec.task_classes == 'same':
    return jnp.tile(jax.random.randint(key, (1, spec.ways), 0, 4), (spec.num_tasks, 1))
  return jax.random.randint(key, (spec.num_tasks, spec.ways), 0, 4)


def _labels(spec: EpisodeSpec, per_class: int) -> jax.Array:
  """int32 [T, K * per_class]: 0..K-1, class-major."""
  labels = jnp.repeat(jnp.arange(spec.ways, dtype=jnp.int32), per_class)
  return jnp.tile(labels[None], (spec.num_tasks, 1))


def sample_episode(key: jax.Array, class_images: jax.Array, spec: EpisodeSpec,
                   rotate: bool) -> dict[str, jax.Array]:
  """Samples one continual few-shot episode from uint8 class_images [C, M, H, W, D].

  With `rotate` (training), each class of each task gets its own random quarter turns.

  Returns:
    'support_images': float32 [T, K*N, H, W, D], normalized (x / 128 - 1);
    'support_labels': int32 [T, K*N], 0..K-1;
    'query_images': float32 [T, K*Q, H, W, D];
    'query_labels': int32 [T, K*Q];
    'class_ids': int32 [T, K], the split's class index of each label;
    with U > 0, 'unlabeled_images': float32 [T, K*U, H, W, D].
  """
  validate_spec(spec, class_images.shape, rotate)
  if class_images.dtype != jnp.uint8:
    raise ValueError(f'class_images must be uint8, got {class_images.dtype}.')
  num_classes, num_images, height, width, depth = class_images.shape
  t, k, n, q = (spec.num_tasks, spec.ways, spec.shots, spec.queries_per_class)
  class_key, image_key, rotate_key = jax.random.split(key, 3)
  class_ids = _draw_classes(class_key, num_classes, spec)
  image_ids = _draw_images(image_key, num_images, spec)
  images = jnp.asarray(class_images)[class_ids[..., None], image_ids]
  if rotate:  # images: [T, K, N+Q+U, H, W, D].
    images = rotate90(images, _rotations(rotate_key, spec))
  images = normalize(images)
  flat = lambda x: x.reshape(t, -1, height, width, depth)
  episode = {
      'support_images': flat(images[:, :, :n]),
      'support_labels': _labels(spec, n),
      'query_images': flat(images[:, :, n:n + q]),
      'query_labels': _labels(spec, q),
      'class_ids': class_ids,
  }
  if spec.unlabeled_per_class:
    episode['unlabeled_images'] = flat(images[:, :, n + q:])
  return episode


def sample_episodes(key: jax.Array, class_images: jax.Array, spec: EpisodeSpec,
                    num_episodes: int, rotate: bool) -> dict[str, jax.Array]:
  """`sample_episode`'s dict for B = num_episodes episodes, with a leading axis B.

  Jit as `jax.jit(sample_episodes, static_argnums=(2, 3, 4))`.
  """
  validate_spec(spec, np.shape(class_images), rotate)
  keys = jax.random.split(key, num_episodes)
  return jax.vmap(lambda k: sample_episode(k, class_images, spec, rotate))(keys)


def sample_evaluation_episode(key: jax.Array, class_images: jax.Array, spec: EpisodeSpec,
                              num_query_draws: int) -> dict[str, jax.Array]:
  """One evaluation episode: a fixed support set and R query draws (no augmentation).

  The paper's protocol (section 5) runs every episode R times with different
  query samples on the same support set. Each draw takes Q distinct images per
  class from the M - N - U not in the support (or unlabeled) set; draws may
  overlap. With spec.independent_draws, the original HT's test sampler
  (hypertransformer/tf/core/evaluation_lib.py, `evaluate_dataset`): from all
  M. Both use the same random numbers, so they compare on paired episodes
  ('disjoint' and 'domain': the same support images).

  Returns:
    `sample_episode`'s dict for uint8 class_images [C, M, H, W, D], but with
    'query_images' float32 [R, T, K*Q, H, W, D], R = num_query_draws (static).
  """
  validate_spec(spec, class_images.shape)
  if num_query_draws < 1:
    raise ValueError(f'num_query_draws must be >= 1, got {num_query_draws}.')
  num_classes, num_images, height, width, depth = class_images.shape
  t, k, n, q = (spec.num_tasks, spec.ways, spec.shots, spec.queries_per_class)
  class_key, support_key, query_key = jax.random.split(key, 3)
  class_ids = _draw_classes(class_key, num_classes, spec)
  # [T, K, N+U]: the support images, then the unlabeled ones, drawn once.
  if spec.independent_draws:  # Every task anew, as _draw_images for 'disjoint'.
    support_ids = _random_subset(support_key, (t, k), num_images, n + spec.unlabeled_per_class)
  else:
    support_ids = _draw_images(support_key, num_images, spec._replace(queries_per_class=0))
  # Each draw: the top-Q of uniform scores, support (and unlabeled) images scored
  # -1 (of every task, for 'same'); with independent draws, of all M.
  scores = jax.random.uniform(query_key, (num_query_draws, t, k, num_images))
  if not spec.independent_draws:
    in_support = jnp.any(support_ids[..., None] == jnp.arange(num_images), axis=-2)  # [T, K, M]
    if spec.task_classes == 'same':
      in_support = jnp.broadcast_to(jnp.any(in_support, axis=0), in_support.shape)
    scores = jnp.where(in_support, -1.0, scores)
  query_ids = jax.lax.top_k(scores, q)[1].astype(jnp.int32)  # [R, T, K, Q]
  images = jnp.asarray(class_images)
  gather = lambda ids: normalize(images[class_ids[..., None], ids])
  queries = gather(query_ids)
  episode = {
      'support_images': gather(support_ids[..., :n]).reshape(t, k * n, height, width, depth),
      'support_labels': _labels(spec, n),
      'query_images': queries.reshape(num_query_draws, t, k * q, height, width, depth),
      'query_labels': _labels(spec, q),
      'class_ids': class_ids,
  }
  if spec.unlabeled_per_class:
    episode['unlabeled_images'] = gather(support_ids[..., n:]).reshape(t, -1, height, width, depth)
  return episode
