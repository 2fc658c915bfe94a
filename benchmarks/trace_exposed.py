"""Where a traced step's exposed communication is: NCCL kernel time with no compute kernel beside it.

    python benchmarks/trace_exposed.py TRACE.json [--min-ms 0.05]

Reads a Chrome trace written by ``bench_gpu.py --trace-dir`` (torch.profiler) and prints:

* two measures of exposed communication:
  - ``comm_alone_ms``: NCCL kernel time with no compute kernel running beside it;
  - ``comm_wait_ms``: the part of that time in which the compute stream had its next kernel
    already launched by the host, so the kernel was held back by a wait on communication. The
    rest of ``comm_alone_ms`` fell in gaps where the GPU waited for the host to launch work: a
    collective that runs there costs the step nothing, and removing it would not shorten the step;
* exposed NCCL time by collective kind (all-gather, reduce-scatter, ...) and by step phase (the
  ``record_function`` labels of ``Trainer.train_step``);
* each exposed stretch of at least ``--min-ms``, in step order, with the CPU op that launched the
  collective (found through the launch's correlation id), so a stretch can be traced to the
  weight gather, bucket reduction or attention exchange behind it.

``bench_gpu.py`` gives one number, exposed milliseconds; this says which collective to move.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from typing import Any

PHASES = ("zero_grad+batch", "forward", "backward", "optimizer")


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


Span = tuple[float, float]


def _subtract(a: Span, cover: list[Span], starts: list[float]) -> list[Span]:
    """The parts of interval ``a`` outside the sorted, disjoint ``cover``."""
    s, e = a
    out = []
    i = max(0, bisect.bisect_right(starts, s) - 1)
    cur = s
    while i < len(cover) and cover[i][0] < e:
        cs, ce = cover[i]
        if ce > cur:
            if cs > cur:
                out.append((cur, min(cs, e)))
            cur = max(cur, ce)
        i += 1
    if cur < e:
        out.append((cur, e))
    return out


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_wait(kernels: list[dict[str, Any]], launches: dict[Any, dict[str, Any]],
              comm: list[tuple[float, float]]) -> float:
    """Microseconds in which no compute kernel ran, the next one was already launched, and NCCL ran.

    For each gap between compute kernels (all streams together) the next compute kernel's host
    launch time says from when the GPU could have run it; from then to its start the compute
    stream was held by a dependency, which in this runtime is a wait on a collective.
    """
    def launched(k: dict[str, Any]) -> float | None:
        launch = launches.get(k.get("args", {}).get("correlation"))
        return None if launch is None else launch["ts"] + launch.get("dur", 0.0)

    comp = sorted(kernels, key=lambda k: k["ts"])
    blocked: list[tuple[float, float]] = []
    end = None
    for i, k in enumerate(comp):
        s = k["ts"]
        if end is not None and s > end:
            # the earliest launch among the kernels that start when the gap ends
            j = i
            while j < len(comp) and comp[j]["ts"] == s:
                j += 1
            times = [t for t in map(launched, comp[i:j]) if t is not None]
            if times and max(end, min(times)) < s:
                blocked.append((max(end, min(times)), s))
        end = s + k["dur"] if end is None else max(end, s + k["dur"])
    return intersect(union(blocked), union(comm))


def collective_kind(name: str) -> str:
    low = name.lower()
    for key in ("allgather", "reducescatter", "allreduce", "alltoall", "sendrecv", "broadcast"):
        if key in low.replace("_", ""):
            return key
    return "other nccl"


def analyse(events: list[dict[str, Any]], min_ms: float) -> dict[str, Any]:
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    compute_kernels = [e for e in kernels if "nccl" not in e["name"].lower()]
    comp = union([(e["ts"], e["ts"] + e["dur"]) for e in compute_kernels])
    cu = union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    starts = [s for s, _ in comp]
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name") in PHASES)
    # launch (cuda_runtime) by correlation id, and the CPU ops that enclose a launch
    launches = {e.get("args", {}).get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    cpu_ops = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                      if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e), key=lambda t: (t[0], -t[1]))
    t0 = min((e["ts"] for e in kernels), default=0.0)

    def phase_at(t: float) -> str:
        return next((n for s, e, n in phases if s <= t < e), "between phases")

    def launcher(k: dict[str, Any]) -> str:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        t = launch["ts"]
        inside = [n for s, e, n in cpu_ops if s <= t <= e and n not in PHASES]
        # the outermost autograd/python-level op names say most: skip the c10d/nccl plumbing
        useful = [n for n in inside if not n.startswith(("c10d", "nccl:", "record_param_comms", "aten::"))]
        return " > ".join(useful[-2:]) if useful else (inside[0] if inside else "?")

    wait_us = comm_wait(compute_kernels, launches, cu)
    by_kind: dict[str, float] = {}
    by_phase: dict[str, float] = {}
    stretches = []
    total = 0.0
    for k in comm:
        # a launch's phase is the CPU phase that issued it; the kernel runs later on its stream
        launch = launches.get(k.get("args", {}).get("correlation"))
        phase = phase_at(launch["ts"]) if launch else phase_at(k["ts"])
        for s, e in _subtract((k["ts"], k["ts"] + k["dur"]), comp, starts):
            ms = (e - s) / 1e3
            total += ms
            kind = collective_kind(k["name"])
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
            by_phase[phase] = by_phase.get(phase, 0.0) + ms
            if ms >= min_ms:
                stretches.append({"at_ms": round((s - t0) / 1e3, 3), "ms": round(ms, 3), "kind": kind,
                                  "issued_in": phase, "by": launcher(k), "kernel_ms": round(k["dur"] / 1e3, 3)})
    stretches.sort(key=lambda r: r["at_ms"])
    alone = (sum(e - s for s, e in cu) - intersect(cu, comp)) / 1e3
    return {"comm_alone_ms": round(alone, 3), "comm_wait_ms": round(wait_us / 1e3, 3),
            "exposed_ms_by_kernel": round(total, 3), "by_kind": {k: round(v, 3) for k, v in by_kind.items()},
            "by_issuing_phase": {k: round(v, 3) for k, v in by_phase.items()}, "stretches": stretches,
            "step_span_ms": round((max((e["ts"] + e["dur"] for e in kernels), default=t0) - t0) / 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=0.05)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"trace_exposed: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    out = analyse(data.get("traceEvents", data) if isinstance(data, dict) else data, args.min_ms)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"NCCL with no compute beside it: {out['comm_alone_ms']} ms; compute stream held by it: "
          f"{out['comm_wait_ms']} ms; traced span {out['step_span_ms']} ms")
    print("by collective (per kernel, concurrent collectives each counted):", out["by_kind"])
    print("by phase that issued it:", out["by_issuing_phase"])
    for r in out["stretches"]:
        print(f"  {r['at_ms']:9.3f} ms  {r['ms']:7.3f} ms exposed ({r['kernel_ms']:.3f} kernel)  {r['kind']:14s} "
              f"[{r['issued_in']}] {r['by']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
