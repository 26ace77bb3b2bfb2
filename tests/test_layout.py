"""The house's floors: no import loops, and no module imports one of a floor above it."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'cht_jax'

# Each group may import only groups listed before it (and itself).
FLOORS = (
    ('kernels', 'models', 'data', 'losses', 'metrics', 'optim'),  # The math and the data.
    # Infrastructure; below the core, as config validation asks devices how many
    # devices a batch is split over. It imports nothing else of the package.
    ('runtime',),
    ('continual', 'config_validation'),  # The core: Algorithm 1's scan; the config's rules.
    ('reports', 'plots'),  # Result files and figures.
    ('methods',),  # What produces theta_t.
    ('evaluate',),  # The protocol.
    ('train', 'api'),
    ('main', 'tools'),  # Entry points.
)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob('*.py')}


def imports(name: str) -> set[str]:
  """The cht_jax modules `name` imports, at module level or inside functions."""
  out = set()
  for node in ast.walk(ast.parse(MODULES[name].read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('cht_jax'):
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        out.add(full if full in MODULES else node.module)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith('cht_jax'))
  return out - {name}


def floor(name: str) -> int:
  top = name.split('.')[1] if '.' in name else ''
  for i, group in enumerate(FLOORS):
    if top in group:
      return i
  raise AssertionError(f'{name} is on no floor of FLOORS: add it where it belongs.')


def test_every_module_has_a_floor_and_imports_none_above_it():
  upward = [f'{name} (floor {floor(name)}) imports {dep} (floor {floor(dep)})'
            for name in MODULES if name != 'cht_jax' for dep in imports(name)
            if dep != 'cht_jax' and floor(dep) > floor(name)]
  assert not upward, '\n'.join(upward)


def test_no_import_loops():
  graph = {name: imports(name) & MODULES.keys() for name in MODULES}
  state = {}

  def visit(name, path):
    if state.get(name) == 'done':
      return
    if name in path:
      pytest.fail('import loop: ' + ' -> '.join(path[path.index(name):] + [name]))
    for dep in graph[name]:
      visit(dep, path + [name])
    state[name] = 'done'

  for name in graph:
    visit(name, [])
