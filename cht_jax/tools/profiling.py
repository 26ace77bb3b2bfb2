"""Where a compiled step's time goes: per-operation times from a JAX profiler trace.

`profile_calls` traces a few calls (`jax.profiler.trace`), reads them back with
`jax.profiler.ProfileData` (a GPU's kernels, or the CPU host's XLA threads) and sums the
times per kernel and per the JAX op behind it: the optimised HLO's `op_name` (kernels are
named after their fusion, '.' written '_'), else the event's `tf_op` stat.
"""

import collections
import glob
import os
import re
import tempfile
import time

import jax

# Lines of a device plane that summarise rather than list operations.
_SUMMARY_LINES = ('XLA Modules', 'Steps', 'XLA TraceMe', 'Source code')


def _stats(event) -> dict:
  try:
    return {name: value for name, value in event.stats}
  except Exception:  # pylint: disable=broad-except
    return {}


def hlo_sources(hlo_text: str) -> dict[str, str]:
  """Kernel name -> the JAX `op_name` of the HLO instruction it runs."""
  pattern = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', re.M)
  return {m.group(1).replace('.', '_').replace('-', '_'): m.group(2)
          for m in pattern.finditer(hlo_text)}


def op_times(xplane_path: str, sources: dict[str, str] | None = None) -> dict:
  """{'device_ns', 'ops': [(name, ns, count, source)], 'sources': [(source, ns, count)]};
  `sources`: kernel name -> JAX op name (`hlo_sources`)."""
  sources = sources or {}
  data = jax.profiler.ProfileData.from_file(xplane_path)
  planes = [p for p in data.planes if p.name.startswith('/device:')]
  if not planes:  # CPU: the host plane's XLA threads.
    planes = [p for p in data.planes if p.name == '/host:CPU']
  by_op = collections.defaultdict(lambda: [0, 0, ''])
  by_source = collections.defaultdict(lambda: [0, 0])
  total = 0
  for plane in planes:
    lines = list(plane.lines)
    if plane.name == '/host:CPU':  # XLA:CPU's threads, not Python's trace events.
      op_lines = [l for l in lines if l.name.startswith('tf_XLA')]
    else:
      op_lines = [l for l in lines if l.name == 'XLA Ops'] or [
          l for l in lines if l.name not in _SUMMARY_LINES]
    for line in op_lines:
      for event in line.events:
        ns = int(event.duration_ns)
        stats = _stats(event)
        source = (sources.get(event.name)
                  or str(stats.get('tf_op', '') or stats.get('long_name', '')))[:160]
        entry = by_op[event.name]
        entry[0] += ns
        entry[1] += 1
        entry[2] = entry[2] or source
        # The model code behind the op: its module path, without the transformations.
        short = '/'.join(p for p in source.split('/')[1:] if '(' not in p)[:100] or source
        by_source[short][0] += ns
        by_source[short][1] += 1
        total += ns
  ops = sorted(((n, v[0], v[1], v[2]) for n, v in by_op.items()), key=lambda r: -r[1])
  sources = sorted(((n, v[0], v[1]) for n, v in by_source.items()), key=lambda r: -r[1])
  return {'device_ns': total, 'ops': ops, 'sources': sources}


def profile_calls(fn, num_calls: int, trace_dir: str | None = None,
                  hlo_text: str | None = None) -> dict:
  """Traces `num_calls` back-to-back calls of `fn` (compiled); returns `op_times` and the
  wall time per call, whose gap shows launch overhead and idle device time."""
  trace_dir = trace_dir or tempfile.mkdtemp(prefix='cht_jax_profile_')
  jax.block_until_ready(fn())
  with jax.profiler.trace(trace_dir):
    start = time.perf_counter()
    for _ in range(num_calls):
      out = fn()
    jax.block_until_ready(out)
    wall = (time.perf_counter() - start) / num_calls
  paths = sorted(glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise RuntimeError(f'The profiler wrote no trace under {trace_dir}.')
  times = op_times(paths[-1], hlo_sources(hlo_text) if hlo_text else None)
  per_call = lambda rows, i: [(*r[:i], r[i] / num_calls / 1e6, r[i + 1] / num_calls, *r[i + 2:])
                              for r in rows]
  return {'wall_ms_per_call': wall * 1e3,
          'device_ms_per_call': times['device_ns'] / num_calls / 1e6,
          'ops_per_call': sum(r[2] for r in times['ops']) / num_calls,
          # (name, ms per call, launches per call, source)
          'top_ops': per_call(times['ops'][:40], 1),
          # (source, ms per call, launches per call)
          'top_sources': per_call(times['sources'][:40], 1),
          'trace_dir': trace_dir}


def format_table(profile: dict, rows: int = 20) -> str:
  lines = [f"wall {profile['wall_ms_per_call']:.2f} ms/call, device ops "
           f"{profile['device_ms_per_call']:.2f} ms/call in {profile['ops_per_call']:.0f} ops"]
  lines.append(f"{'ms/call':>8} {'share':>6} {'n':>5}  op  [source]")
  total = max(profile['device_ms_per_call'], 1e-9)
  for name, ms, count, source in profile['top_ops'][:rows]:
    lines.append(f'{ms:>8.3f} {ms / total:>6.1%} {count:>5.0f}  {name[:50]}  [{source[-90:]}]')
  lines.append(f"{'ms/call':>8} {'share':>6} {'n':>5}  source")
  for source, ms, count in profile['top_sources'][:rows]:
    lines.append(f'{ms:>8.3f} {ms / total:>6.1%} {count:>5.0f}  {source[:120]}')
  return '\n'.join(lines)
