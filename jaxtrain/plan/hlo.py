"""Collective traffic of a compiled step, read from its optimized HLO text.

Each collective's result shape gives its bytes; ops inside while loops (the scan over layers,
gradient accumulation, the pipeline schedule) count once per iteration, using the trip count
XLA records on the loop (`known_trip_count`).
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_OP = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.+?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_WHILE = re.compile(r" while\(.*?body=%([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition|branch_computations)=\{?%([\w.\-]+)")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size * _BYTES[dtype]
    return total


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes moved per step (per device, by result size) for each kind of collective."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            bodies[current].append(line)
    # How often each computation runs per step: loops multiply by their trip counts.
    times = collections.defaultdict(int)
    times[entry] = 1
    order = [entry]
    for name in order:
        for line in bodies.get(name, []):
            loop = _WHILE.search(line)
            loop_body = loop.group(1) if loop else None
            for callee in _CALLS.findall(line):
                if callee not in bodies:
                    continue
                factor = int(loop.group(2)) if callee == loop_body else 1
                if callee not in times:
                    order.append(callee)
                times[callee] += times[name] * factor
    result = dict.fromkeys(KINDS, 0)
    for name, count in times.items():
        for line in bodies[name]:
            op = _OP.match(line)
            if op:
                result[op.group(2)] += count * _shape_bytes(op.group(1))
    return result
