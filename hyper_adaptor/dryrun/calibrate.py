"""What this machine computes and moves per second: the constants of the dry-run's step-time model.

``measure(device)`` runs short micro-benchmarks: matmul throughput at several sizes (small matmuls run far
below the peak, and a small model's step is made of them, so the model interpolates by size instead of using
one peak figure), elementwise memory bandwidth, latency and bandwidth of each collective on a 2-rank world of
the device's backend (gloo on a CPU), and on a CPU megatron-core's own fixed costs per layer, micro-batch and
step (a small model's step is mostly those) and the wait of a collective on a world of more ranks than cores.
The benchmarks themselves take seconds; starting the worlds and importing megatron in them most of the rest
(about half a minute on a 2-core machine). A CPU is measured with one thread, as every rank launched here uses.

``get(device)`` returns the cached calibration of this machine, measuring it once (``recalibrate=True`` measures
again). The JSON cache names the host, the machine and torch's version; a cache written by another machine or
another torch is measured again, not reused.

``python -m hyper_adaptor.dryrun.calibrate [--device cpu|cuda|npu] [--recalibrate]`` prints the figures.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import platform as _platform
import socket
import sys
import time
from pathlib import Path

from hyper_adaptor.environment import CACHE_ENV

DEVICES = ("cpu", "cuda", "npu")
FORMAT = 2  # 2: real steps' scales (framework's matmul / elementwise / comm_scale, moe_layer_s), elementwise_speed
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# where a device cannot measure its collectives (one accelerator, no second rank): a link of this latency and
# bandwidth is assumed, and the calibration says so (``collective_source``)
ASSUMED_LINK = {"cpu": (2e-4, 2e9), "cuda": (2e-5, 1e11), "npu": (2e-5, 1e11)}
# an accelerator's copy rate to and from pinned host memory, one direction, as assumed where it is not measured:
# a PCIe Gen5 x16 link moves about 25 GB/s in practice (H100), Gen4 about half (Ascend 910B attaches by Gen4 or
# Gen5 by model; the lower figure is assumed). On a CPU "host" is the same memory: a copy runs at memory speed.
HOST_LINK = {"cuda": 2.5e10, "npu": 1.5e10}


class CalibrationError(ValueError):
    """A device name that is not one of cpu / cuda / npu, or a device this machine does not have."""


@dataclasses.dataclass
class Calibration:
    """Measured constants of one machine. Rates are per second; ``matmul`` maps a dtype name to sorted
    [size, flop/s] pairs of an n x n x n matmul; ``collectives`` maps each of COLLECTIVES to
    {"latency_s", "bytes_per_s"} in the "sent" convention (bytes one rank sends; see ``collective_time``)."""

    device: str
    host: str
    machine: str
    torch_version: str
    threads: int
    cores: int
    matmul: dict[str, list[list[float]]]
    memory_bytes_per_s: float
    layer_overhead_s: float
    collectives: dict[str, dict[str, float]]
    collective_source: str = "measured"
    # megatron's own fixed costs on this machine (seconds, keys ending in _s): a layer's forward and backward per
    # micro-batch, an MoE layer's beyond it, a micro-batch's (embedding, loss, the schedule), a step's (zeroing,
    # optimizer, bookkeeping); and the scales real steps showed against the micro-benchmarks (keys ending in
    # _scale: step_fit.fit_compute_scales, fit_comm_scale); empty when not measured (the small torch layer above
    # stands in for a layer then, and nothing is scaled)
    framework: dict[str, float] = dataclasses.field(default_factory=dict)
    # elementwise work in a 16-bit dtype: how many times faster than the same elements in fp32 (softmax, GELU,
    # a transposing copy, an add); empty: twice (bandwidth-bound: half the bytes), as on an accelerator
    elementwise_speed: dict[str, float] = dataclasses.field(default_factory=dict)
    # the GPT steps the scales in ``framework`` were fitted on (shape, TP when > 1, measured seconds)
    compute_steps: list[dict] = dataclasses.field(default_factory=list)
    # the device <-> host copy rate of one direction (swap and offload traffic); 0: not measured, the
    # device's assumed link (HOST_LINK) stands in
    host_link_bytes_per_s: float = 0.0
    created: str = ""
    seconds: float = 0.0
    format: int = FORMAT

    def host_link(self) -> float:
        """Bytes per second one way between the device and host memory: measured, or HOST_LINK's assumption."""
        return self.host_link_bytes_per_s or HOST_LINK.get(self.device, self.memory_bytes_per_s)

    # ---------------------------------------------------------------------------------------------- lookups
    def flops_per_s(self, size: float, dtype: str = "float32") -> float:
        """Matmul throughput at effective size ``size`` ((m k n)^(1/3)), interpolated in log(size) between
        the measured sizes, held flat beyond them; a dtype not measured falls back to float32."""
        table = self.matmul.get(dtype) or self.matmul["float32"]
        sizes = [s for s, _ in table]
        x = max(size, 1.0)
        if x <= sizes[0]:
            # below the smallest size the time per call stops shrinking: the rate falls with the work
            return table[0][1] * (x / sizes[0]) ** 3
        if x >= sizes[-1]:
            return table[-1][1]
        i = bisect.bisect_right(sizes, x)
        (s0, r0), (s1, r1) = table[i - 1], table[i]
        t = (math.log(x) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))

    def matmul_time(self, m: float, k: float, n: float, dtype: str = "float32", count: float = 1) -> float:
        """Seconds for ``count`` matmuls of [m, k] x [k, n]."""
        if m <= 0 or k <= 0 or n <= 0 or count <= 0:
            return 0.0
        flops = 2.0 * m * k * n
        return count * flops / self.flops_per_s((m * k * n) ** (1 / 3), dtype)

    def collective_time(self, op: str, group: int, sent_bytes: float, calls: float = 1) -> float:
        """Seconds of ``calls`` collectives ``op`` over ``group`` ranks that send ``sent_bytes`` per rank in
        all: each call pays the latency once per ring step (group - 1), the bytes at the measured rate."""
        if group <= 1 and op != "send_recv":
            return 0.0
        c = self.collectives[op]
        steps = max(group - 1, 1)
        return calls * c["latency_s"] * steps + sent_bytes / c["bytes_per_s"]

    # ----------------------------------------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"device", "host", "machine", "torch_version", "matmul", "memory_bytes_per_s",
                   "layer_overhead_s", "collectives"} - set(data)
        if missing:
            raise ValueError(f"calibration JSON lacks {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


# -------------------------------------------------------------------------------------------- identity
def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise CalibrationError(f"--device: invalid choice: {device!r} (choose from {', '.join(DEVICES)})")
    return device


def machine_id(device: str) -> str:
    """The hardware the figures belong to: CPU model and core count, and the accelerator's name."""
    cpu = _platform.processor() or _platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{_platform.machine()} {cpu} x{os.cpu_count()}"
    if device != "cpu":
        import torch

        module = getattr(torch, device, None)
        if module is not None and hasattr(module, "get_device_name"):
            try:
                text += f"; {module.get_device_name(0)}"
            except Exception:  # no device: the name is then not part of what is compared
                pass
    return text


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cache_path(device: str) -> Path:
    """``$HYPER_ADAPTOR_CACHE`` (a directory) or ``~/.cache/hyper_adaptor``, file
    ``calibration-<device>-<host>.json``."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hyper_adaptor")
    return root / f"calibration-{_check_device(device)}-{socket.gethostname()}.json"


def matches_here(cal: Calibration) -> bool:
    """True when ``cal`` was measured on this host, this machine and this torch."""
    import torch

    return (cal.host == socket.gethostname() and cal.machine == machine_id(cal.device)
            and cal.torch_version == torch.__version__ and cal.format == FORMAT)


def save(cal: Calibration, path: Path | None = None) -> Path:
    path = Path(path or cache_path(cal.device))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=1))
    os.replace(tmp, path)
    return path


def load(device: str, path: Path | None = None) -> Calibration | None:
    """The cached calibration of ``device`` when it exists, parses and belongs to this machine and torch."""
    path = Path(path or cache_path(device))
    try:
        cal = Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return cal if cal.device == device and matches_here(cal) else None


# Figures of one current accelerator of each kind, for planning a cluster from a machine without one (the
# planner's tables at cluster scale): matmul rate by size, HBM bandwidth, a layer's fixed launch cost and one
# link, an intra-node one, for every collective. Assumed, not measured: a calibration on the device replaces them.
NOMINAL = {
    "cuda": {"matmul": {"bfloat16": [[64, 1e12], [256, 4e13], [1024, 3e14], [4096, 6e14], [8192, 6.5e14]],
                        "float32": [[64, 5e11], [256, 1e13], [1024, 4e13], [4096, 5e13], [8192, 5e13]]},
             "memory": 2.5e12, "layer": 6e-4, "link": (1e-5, 2e11)},
    "npu": {"matmul": {"bfloat16": [[64, 5e11], [256, 2e13], [1024, 1.5e14], [4096, 2.8e14], [8192, 3e14]],
                       "float32": [[64, 2.5e11], [256, 5e12], [1024, 2e13], [4096, 4e13], [8192, 4e13]]},
            "memory": 1.5e12, "layer": 1e-3, "link": (2e-5, 1e11)},
}


def nominal(device: str) -> Calibration:
    """Assumed figures of a ``device`` (cuda / npu) this machine does not have (``collective_source`` says so)."""
    if _check_device(device) not in NOMINAL:
        raise CalibrationError(f"--device {device}: no nominal figures; calibrate on the machine")
    import torch

    spec = NOMINAL[device]
    latency, rate = spec["link"]
    return Calibration(
        device=device, host=socket.gethostname(), machine=f"nominal {device} (not measured)",
        torch_version=torch.__version__, threads=1, cores=_cores(),
        matmul={k: [list(map(float, row)) for row in v] for k, v in spec["matmul"].items()},
        memory_bytes_per_s=spec["memory"], layer_overhead_s=spec["layer"],
        collectives={op: {"latency_s": latency, "bytes_per_s": rate} for op in COLLECTIVES},
        collective_source="assumed (nominal figures: no such device on this machine)")


def get(device: str = "cpu", recalibrate: bool = False, path: Path | None = None,
        allow_nominal: bool = False) -> Calibration:
    """This machine's calibration of ``device``: the cache, or a measurement written to the cache.
    ``allow_nominal``: where this machine has no such device, :func:`nominal`'s assumed figures (not cached)."""
    _check_device(device)
    cal = None if recalibrate else load(device, path)
    if cal is None:
        try:
            cal = measure(device)
        except CalibrationError:
            if allow_nominal and device in NOMINAL:
                return nominal(device)
            raise
        save(cal, path)
    return cal


# ---------------------------------------------------------------------------------------- measurements
def _timer(device: str):
    import torch

    if device == "cpu":
        return time.perf_counter
    module = getattr(torch, device)

    def clock():
        module.synchronize()
        return time.perf_counter()

    return clock


def _best(fn, clock, budget: float, min_reps: int = 2, max_reps: int = 50) -> float:
    """Fastest of repeated runs of ``fn`` (after one warm-up), within about ``budget`` seconds."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget and reps < max_reps):
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return max(best, 1e-9)


def _matmul_table(device: str, dtype, sizes, budget: float) -> list[list[float]]:
    import torch

    clock = _timer(device)
    rows = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _best(lambda a=a, b=b: torch.mm(a, b), clock, budget)
        rows.append([float(n), 2.0 * n ** 3 / seconds])
    return rows


def _elementwise_speed(device: str, dtype, budget: float) -> float:
    """fp32's time / ``dtype``'s for the same elements of a layer's elementwise kinds. On a CPU these kernels
    convert 16-bit elements to fp32 and are bound by that arithmetic, not by the bytes: bf16 runs them about
    as fast as fp32 (a bytes-based count would halve them); on an accelerator they are bound by memory."""
    import torch

    clock = _timer(device)

    def mix(x):
        torch.softmax(x, -1)
        torch.nn.functional.gelu(x)
        x.t().contiguous()
        torch.add(x, x)

    base = torch.randn(256, 4096, device=device)
    low = base.to(dtype)
    return _best(lambda: mix(base), clock, budget) / _best(lambda: mix(low), clock, budget)


def _memory_bandwidth(device: str, budget: float) -> float:
    import torch

    clock = _timer(device)
    n = (16 if device == "cpu" else 256) * 2 ** 20 // 4
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    out = torch.empty_like(a)
    seconds = _best(lambda: torch.add(a, b, out=out), clock, budget)
    return 3 * 4 * n / seconds  # two reads and one write


def _layer_overhead(device: str, budget: float) -> float:
    """Forward and backward of a transformer layer so small that its arithmetic is negligible: what every
    layer pays per micro-batch in operator dispatch and autograd bookkeeping."""
    import torch
    import torch.nn.functional as F

    h, s, heads = 16, 8, 2
    w = {name: torch.randn(*shape, device=device, requires_grad=True) * 0.1 for name, shape in
         (("qkv", (3 * h, h)), ("proj", (h, h)), ("fc1", (4 * h, h)), ("fc2", (h, 4 * h)))}
    w = {k: v.detach().requires_grad_() for k, v in w.items()}
    norm = torch.ones(h, device=device, requires_grad=True)
    x0 = torch.randn(s, 1, h, device=device, requires_grad=True)

    def layer():
        x = F.layer_norm(x0, (h,), norm)
        q, k, v = F.linear(x, w["qkv"]).view(s, heads, 3 * h // heads).transpose(0, 1).chunk(3, dim=-1)
        p = F.dropout(torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1), 0.1)
        a = F.linear((p @ v).transpose(0, 1).reshape(s, 1, h), w["proj"])
        x = x0 + F.dropout(a, 0.1)
        y = F.layer_norm(x, (h,), norm)
        x = x + F.dropout(F.linear(F.gelu(F.linear(y, w["fc1"])), w["fc2"]), 0.1)
        x.sum().backward()

    return _best(layer, _timer(device), budget, min_reps=5, max_reps=200)



def available(device: str) -> bool:
    """Whether this machine has a usable ``device`` to measure (a CPU always has)."""
    if _check_device(device) == "cpu":
        return True
    if device == "npu":
        from hyper_adaptor import platform

        return platform.npu_available()
    import torch

    module = getattr(torch, device, None)
    return module is not None and module.is_available()


def measure(device: str = "cpu", quick: bool = False) -> Calibration:
    """Measure this machine's ``device`` (cpu / cuda / npu). ``quick``: the compute figures only, a shorter
    budget, and an assumed link (for tests)."""
    _check_device(device)
    import torch

    if not available(device):
        raise CalibrationError(f"--device {device}: this machine has no usable {device} device to calibrate "
                               "(run on one, or copy its calibration JSON into the cache)")
    start = time.perf_counter()
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        budget = 0.05 if quick else 0.25
        if device == "cpu":
            sizes = (16, 64, 256) if quick else (16, 32, 64, 128, 256, 512)
            dtypes = {"float32": torch.float32} if quick else {"float32": torch.float32, "bfloat16": torch.bfloat16}
        else:
            sizes = (64, 256, 1024, 4096) if quick else (64, 128, 256, 512, 1024, 2048, 4096, 8192)
            dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        matmul = {}
        for name, dtype in dtypes.items():
            # bf16 matmuls on a CPU can be slow: their table stops where one call passes the budget
            matmul[name] = _matmul_table(device, dtype, sizes if name == "float32" or device != "cpu"
                                         else [s for s in sizes if s <= 256], budget / len(sizes))
        memory = _memory_bandwidth(device, budget)
        speed = {name: _elementwise_speed(device, dtype, budget / 2) for name, dtype in dtypes.items()
                 if name != "float32"}
        overhead = _layer_overhead(device, budget)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    framework = {}
    if quick:
        latency, rate = ASSUMED_LINK[device]
        collectives = {op: {"latency_s": latency, "bytes_per_s": rate} for op in COLLECTIVES}
        source = "assumed (quick calibration)"
    else:
        from hyper_adaptor.dryrun import calibrate_worlds as worlds

        collectives, source = worlds.collectives(device)
        if device == "cpu":
            framework = worlds.framework()
    steps = framework.pop("compute_steps", [])
    comm_step = framework.pop("comm_step", None)
    cal = Calibration(
        device=device, host=socket.gethostname(), machine=machine_id(device), torch_version=torch.__version__,
        threads=used_threads, cores=_cores(), matmul=matmul, memory_bytes_per_s=memory, elementwise_speed=speed,
        layer_overhead_s=overhead, collectives=collectives, collective_source=source, framework=framework,
        compute_steps=steps,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if steps:
        from hyper_adaptor.dryrun.step_fit import fit_compute_scales

        cal.framework.update(fit_compute_scales(cal, steps))
    if comm_step:
        from hyper_adaptor.dryrun.step_fit import fit_comm_scale

        cal.compute_steps.append(comm_step)
        cal.framework.update(fit_comm_scale(cal, comm_step))
    cal.seconds = time.perf_counter() - start
    return cal


def describe(cal: Calibration) -> str:
    lines = [f"calibration of {cal.device} on {cal.host} ({cal.machine}), torch {cal.torch_version}, "
             f"{cal.threads} thread(s), {cal.cores} core(s), measured {cal.created} in {cal.seconds:.1f} s"]
    for dtype, table in cal.matmul.items():
        lines.append(f"  matmul {dtype}: " + ", ".join(f"n={int(s)} {r / 1e9:.1f} GFLOP/s" for s, r in table))
    if cal.elementwise_speed:
        lines.append("  elementwise work against fp32: " + ", ".join(
            f"{k} x {v:.2f}" for k, v in cal.elementwise_speed.items()))
    lines.append(f"  memory bandwidth {cal.memory_bytes_per_s / 1e9:.2f} GB/s; "
                 f"small layer forward+backward {cal.layer_overhead_s * 1e3:.2f} ms")
    if cal.framework:
        lines.append("  megatron-core fixed costs: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in cal.framework.items() if k.endswith("_s")))
    scales = {k: v for k, v in cal.framework.items() if k.endswith("_scale")}
    if scales:
        lines.append("  a training step's compute against the micro-benchmarks: matmuls x "
                     f"{scales.get('matmul_scale', 1.0):.2f}, elementwise x {scales.get('elementwise_scale', 1.0):.2f} "
                     f"(fitted on one-rank GPT steps); collectives inside a step x "
                     f"{scales.get('comm_scale', 1.0):.2f} (a 2-rank TP step)")
    lines.append(f"  collectives ({cal.collective_source}): " + "; ".join(
        f"{op} {c['latency_s'] * 1e6:.0f} us + {c['bytes_per_s'] / 1e9:.2f} GB/s"
        for op, c in cal.collectives.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_adaptor.dryrun.calibrate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    parser.add_argument("--recalibrate", action="store_true", help="measure again, replacing the cache")
    args = parser.parse_args(argv)
    try:
        cal = get(args.device, recalibrate=args.recalibrate)
    except CalibrationError as err:
        parser.error(str(err))
    print(describe(cal))
    print(f"cache: {cache_path(args.device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
