"""What a compiled multi-chip program's text says of its ops, and a bandwidth MODEL of its
collectives (``sharded_step.py``).

libtpu's static profile (``--xla_jf_dump_static_llo_profile_to``) annotates every op of a
deviceless compile with ``bundle_analysis_data.estimated_cycles``; on libtpu 0.0.50.1 every
collective (all-reduce, all-gather, reduce-scatter, their async forms) is annotated with 0: the
profile simulates one chip's bundles, and a collective's time is the ICI's, not the core's. So
each collective is modelled here from its bytes and the topology's ICI bandwidth, and labelled
a MODEL, never an estimate.

The model (bandwidth term only, no latency, nothing overlapped with compute): a bidirectional
ring over the group's chips (a 2x4 v6e slice has a Hamiltonian cycle), each chip sending to
both ring neighbours at one port's one-way bandwidth each. v6e: 800 GB/s bidirectional ICI per
chip over 4 ports (https://cloud.google.com/tpu/docs/v6e), so 100 GB/s a port each way and
200 GB/s a chip over the ring. For B bytes (the full, gathered or reduced, array) and n chips:
all-gather and reduce-scatter move (n-1)/n B a chip, an all-reduce twice that.
"""

from __future__ import annotations

import math
import re
from typing import Any

ICI_BIDIR_PER_CHIP = 800e9  # Bytes/s, v6e, Cloud TPU's v6e page.
ICI_PORTS = 4
RING_BYTES_PER_S = 2 * ICI_BIDIR_PER_CHIP / ICI_PORTS / 2  # Two ports, one way each: 200 GB/s.

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
                "s8": 1, "u8": 1, "pred": 1, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")
CYCLES = re.compile(r'bundle_analysis_data":\{"estimated_cycles":"(\d+)"')
_ALGORITHM = re.compile(r'"emitter":"(\w+)","strategy":"(\w+)"')
_CALLS = re.compile(r"calls=%([\w.-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) \(.*\{\s*$")


def _split_shape(rest: str) -> tuple[str, str]:
    """(the result shape, what follows it) of an instruction's text after ``= ``."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def array_bytes(shape: str) -> list[int]:
    """The byte size of every array in a shape's text (a tuple's elements each)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


def group_size(line: str, default: int) -> int:
    """The chips in one replica group of a collective's text."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        named = re.findall(r"'(\w+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in named if a in sizes) if named else default
    return default


def _fused_scatters(text: str) -> dict[str, str]:
    """XLA:TPU's reduce-scatter fusions: computation name -> the emitter/strategy of the
    fusion that calls it. Such a computation (``%all-reduce-scatter...``) holds an all-reduce
    of the padded full array and a dynamic-slice of this chip's part; the
    ``SingleInputAllReduceScatterFusion`` emitter runs it as a reduce-scatter."""
    out = {}
    for line in text.splitlines():
        called = _CALLS.search(line)
        if called and called.group(1).startswith("all-reduce-scatter"):
            algo = _ALGORITHM.search(line)
            out[called.group(1)] = "/".join(algo.groups()) if algo else ""
    return out


def ops(text: str) -> list[dict[str, Any]]:
    """Every instruction of the compiled program's text that libtpu's profile annotated (or
    that is a collective): name, opcode, its estimated cycles, and for collectives the bytes
    of its largest array and its group's chip count. An all-reduce inside one of XLA's
    reduce-scatter fusions (:func:`_fused_scatters`) is that reduce-scatter (its bytes: the
    padded full array), with the fusion's algorithm."""
    out = []
    scatters = _fused_scatters(text)
    computation = ""
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        shape, tail = _split_shape(line[m.end():])
        opcode = tail.split("(", 1)[0]
        cycles = CYCLES.search(line)
        kind = next((c for c in COLLECTIVES if opcode.startswith(c)), None)
        if kind is None and "reduce-scatter" in opcode:
            kind = "reduce-scatter"
        if kind == "all-reduce" and computation in scatters:
            op = {"name": m.group(1), "opcode": "all-reduce-scatter fusion",
                  "cycles": int(cycles.group(1)) if cycles else None,
                  "collective": "reduce-scatter", "bytes": sum(array_bytes(shape)),
                  "group": group_size(line, 8), "algorithm": scatters[computation]}
            out.append(op)
            continue
        kernel = opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in line
        if cycles is None and kind is None and not kernel:
            continue
        unread = 0 if kernel else None  # A kernel libtpu did not read: 0 cycles.
        op: dict[str, Any] = {"name": m.group(1), "opcode": opcode,
                              "cycles": int(cycles.group(1)) if cycles else unread}
        if kind and not opcode.endswith("-done"):
            sizes = array_bytes(shape)
            if opcode.endswith("-start"):  # (operands..., results...): the larger half.
                half = len(sizes) // 2
                sizes = max(sizes[:half], sizes[half:], key=sum) if half else sizes
            algo = _ALGORITHM.search(line)
            op.update(collective=kind, bytes=sum(sizes), group=group_size(line, 8),
                      algorithm="/".join(algo.groups()) if algo else "")
            if kind == "reduce-scatter":  # B is the full (input) array: n times the output.
                op["bytes"] *= op["group"]
        if kernel:
            op["kernel"] = re.sub(r"\.\d+$", "", m.group(1))  # Named after the kernel.
        out.append(op)
    return out


def model_s(op: dict[str, Any]) -> float:
    """The MODEL's seconds for one collective (see the module docstring)."""
    n, b = op["group"], op["bytes"]
    if n <= 1:
        return 0.0
    factor = 2.0 if op["collective"] == "all-reduce" else 1.0
    if op["collective"] in ("all-to-all", "collective-permute"):
        factor = 1.0  # Each chip sends (n-1)/n of its array (all-to-all) or all of it.
    return factor * (n - 1) / n * b / RING_BYTES_PER_S


def summary(text: str, clock_hz: float) -> dict[str, Any]:
    """The program's ops summed: estimated ms of the compute ops (XLA and Pallas, and of
    splash's kernels apart), the ops with no estimate, and every collective with its profile
    cycles and its modelled ms."""
    rows = ops(text)
    colls = [o for o in rows if "collective" in o]
    compute = [o for o in rows if "collective" not in o and not o["opcode"].endswith("-done")
               and o["cycles"] is not None]
    kernels = [o for o in compute if "kernel" in o]
    by_kind: dict[str, dict[str, Any]] = {}
    for o in colls:
        k = by_kind.setdefault(o["collective"], {"count": 0, "bytes": 0, "profile_cycles": 0,
                                                 "model_ms": 0.0})
        k["count"] += 1
        k["bytes"] += o["bytes"]
        k["profile_cycles"] += o["cycles"] or 0
        k["model_ms"] += model_s(o) * 1e3
    splash = sum(o["cycles"] for o in kernels if "splash" in o["kernel"])
    return {"compute_ms": sum(o["cycles"] for o in compute) / clock_hz * 1e3,
            "splash_kernels_ms": splash / clock_hz * 1e3,
            "pallas_ms": sum(o["cycles"] for o in kernels) / clock_hz * 1e3,
            "ops": len(compute), "ops_without_estimate": sum(o["cycles"] == 0 for o in compute),
            "kernels_without_estimate": sorted({o["kernel"] for o in kernels if not o["cycles"]}),
            "ops_without_estimate_names": [o["name"] for o in compute if not o["cycles"]][:40],
            "kernels": sorted({o["kernel"] for o in kernels}),
            "collectives": by_kind,
            "top_ops": [(o["name"], o["cycles"] / clock_hz * 1e3) for o in sorted(
                compute, key=lambda o: -o["cycles"])[:12]],
            "collective_profile_cycles": sum(o["cycles"] or 0 for o in colls),
            "collectives_model_ms": sum(model_s(o) for o in colls) * 1e3,
            "collective_ops": [{k: o[k] for k in ("name", "opcode", "cycles", "bytes", "group",
                                                  "algorithm")}
                               for o in colls]}


__all__ = ["COLLECTIVES", "ICI_BIDIR_PER_CHIP", "RING_BYTES_PER_S", "array_bytes",
           "group_size", "model_s", "ops", "summary"]
