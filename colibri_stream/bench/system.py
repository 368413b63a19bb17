"""The machine side of `colibri-stream bench`: a RAM limit that counts page cache, cold page cache,
and the facts about the machine that belong next to every number.

Every contender runs as its own process inside a fresh cgroup-v1 memory group
(``/sys/fs/cgroup/memory/<name>/memory.limit_in_bytes``). The kernel charges both anonymous memory
and the page cache the process fills to that group, so a contender cannot "win" by keeping the
model in page cache beyond its budget. Where no such group can be made (not root, cgroup v2 only)
the contenders run unconfined and the result says so in ``warnings``.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from colibri_stream.errors import ColibriError
from engine.kernels.isa import kernel_isa

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
ASSERTION = re.compile(r"assert", re.IGNORECASE)  # an abort's own message (llama.cpp: GGML_ASSERT(...) failed)
CAUSE = re.compile(r"error|exception|fatal|failed", re.IGNORECASE)  # Python's last traceback line, and others


class ContenderFailed(ColibriError):
    """A measured process exited badly or printed no result; the message quotes its last stderr line."""


@dataclass
class ProcessRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_bytes: int | None  # the group's max usage (RSS + page cache); None when unconfined
    hit_limit: bool  # the kernel had to reclaim or kill at the limit at least once

    def last_json_line(self) -> str:
        lines = [line for line in self.stdout.splitlines() if line.startswith("{")]
        if self.returncode != 0 or not lines:
            raise ContenderFailed(
                f"{' '.join(self.argv[:4])} ... exited {self.returncode}{self._why()}: {self._cause()}"
            )
        return lines[-1]

    def _why(self) -> str:
        """A kill (SIGKILL: the kernel's OOM killer at a limit) is the limit's doing; any other exit only
        happened in a group that also had pages reclaimed, which a memory-mapped file always does."""
        if self.hit_limit and self.returncode == -signal.SIGKILL:
            return " (killed at its memory limit)"
        return " (it had pages reclaimed at its memory limit)" if self.hit_limit else ""

    def _cause(self) -> str:
        """The stderr line that says what went wrong (an assertion or error) rather than the last one, which
        after an abort is often the end of a debugger's backtrace."""
        lines = self.stderr.strip().splitlines() or ["(no stderr)"]
        asserts = [line for line in lines if ASSERTION.search(line)]
        if asserts:
            return asserts[0].strip()
        return ([line for line in lines if CAUSE.search(line)] or lines)[-1].strip()


def cgroup_available() -> bool:
    return (CGROUP_ROOT / "memory.limit_in_bytes").exists() and os.access(CGROUP_ROOT, os.W_OK)


class MemoryLimit:
    """Runs commands, one at a time, each in a fresh memory group of ``limit_bytes``."""

    def __init__(self, limit_bytes: int, name: str = "colibri-bench"):
        self.limit_bytes = limit_bytes
        self.name = f"{name}-{os.getpid()}"
        self.enforced = cgroup_available()

    def run(
        self, argv: list[str], timeout_s: float, env: dict[str, str] | None = None, keep: bool = False
    ) -> ProcessRun:
        """``keep``: leave the group (and the page cache charged to it) for the next run, a warm run of
        the same contender: removing a group hands its cached pages to the parent, uncharged, and a warm
        run in a new group would then read them for free beyond its limit."""
        if not self.enforced:
            return self._run(argv, timeout_s, env, None)
        group = CGROUP_ROOT / self.name
        group.mkdir(exist_ok=True)
        try:
            (group / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            for counter in ("memory.max_usage_in_bytes", "memory.failcnt"):  # this run's own peak and hits
                (group / counter).write_text("0")
            # The shell joins the group, then becomes the contender: everything it maps or reads is charged.
            wrapped = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv]
            return self._run(wrapped, timeout_s, env, group)
        finally:
            if not keep:
                _remove_group(group)

    def _run(self, argv: list[str], timeout_s: float, env: dict[str, str] | None, group: Path | None) -> ProcessRun:
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise ContenderFailed(f"{' '.join(argv[-12:])[:200]} ... ran past {timeout_s:.0f} s") from None
        wall = time.perf_counter() - start
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if group else None
        failcnt = int((group / "memory.failcnt").read_text()) if group else 0
        shown = argv[4:] if group else argv
        return ProcessRun(shown, done.returncode, done.stdout, done.stderr, wall, peak, failcnt > 0)


def _remove_group(group: Path) -> None:
    # The page cache charged to the group moves to the parent when the group goes; retry while the
    # last process is still being reaped.
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only). False when it could not: numbers are then warm."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cli_argv(*args: str) -> list[str]:
    """`colibri-stream ARGS` run with this interpreter, so the bench measures the installed code."""
    return [sys.executable, "-m", "colibri_stream", *args]


def convert(src: Path, dst: Path, experts: str = "int4", progress: bool = False, dense: str = "bf16") -> Path:
    """`colibri-stream convert SRC DST --experts EXPERTS --dense DENSE` in a child process; returns ``dst``.

    Its stderr (the progress bar, any error) passes through; its stdout (one JSON report) is kept out
    of the bench's own output. A finished container is left as it is (the converter says "already
    converted"), an interrupted one is resumed."""
    argv = cli_argv("convert", str(src), str(dst), "--experts", experts, "--dense", dense)
    if not progress:
        argv.append("--no-progress")
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ContenderFailed(f"{' '.join(argv)} exited {done.returncode}")
    return dst


def cpu_times() -> list[int]:
    """The machine's aggregate CPU time counters (/proc/stat "cpu" line: user nice system idle iowait irq
    softirq steal ...), in clock ticks; [] where there is no /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return []
    return [int(v) for v in first[1:]] if first and first[0] == "cpu" else []


STEAL = 7  # /proc/stat field: time the hypervisor ran something else while this VM wanted the CPU


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Share of CPU time stolen by the hypervisor between two cpu_times() samples (None: not counted)."""
    if len(before) <= STEAL or len(after) <= STEAL:
        return None
    total = sum(after[:8]) - sum(before[:8])  # guest times (fields 9-10) are already inside user/nice
    return round((after[STEAL] - before[STEAL]) / total, 4) if total > 0 else 0.0


IDLE, IOWAIT = 3, 4


def other_cpu_share(before: list[int], after: list[int], own_cpu_s: float, wall_s: float) -> float | None:
    """Share of the machine's CPU that processes other than the measured one used while it ran: the busy
    time of /proc/stat minus the contender's own CPU time, over wall time x cores (None: not counted)."""
    if len(before) <= IOWAIT or len(after) <= IOWAIT or wall_s <= 0:
        return None
    busy = sum(after[:8]) - sum(before[:8]) - (after[IDLE] - before[IDLE]) - (after[IOWAIT] - before[IOWAIT])
    others = busy / os.sysconf("SC_CLK_TCK") - own_cpu_s
    return round(max(0.0, others) / (wall_s * (os.cpu_count() or 1)), 3)


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (the contenders), user + system."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# The CPU features a 4/8-bit kernel's speed depends on (ours and llama.cpp's pick paths by them): a
# table from two hosts differs first by these.
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve", "i8mm",
)  # fmt: skip


def isa_of(cpuinfo: str) -> list[str]:
    """The ISA_FLAGS present in /proc/cpuinfo's text (its first "flags"/"Features" line), in ISA_FLAGS order."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return [flag for flag in ISA_FLAGS if flag in present]
    return []


def machine_facts(path: Path) -> dict:
    """What the reader of a benchmark table needs to compare it with another machine: the CPU, the
    memory bandwidth measured now with the contenders' thread count, how loaded the machine was at
    the start (load average) and, added at the end of the run, how much CPU the hypervisor stole."""
    cpu = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    import torch  # only for its version and thread count; the bench process itself computes nothing

    from colibri_stream.bench.limit_line import memory_bandwidth

    threads = torch.get_num_threads()
    return {
        "cpu": cpu,
        "isa": isa_of(cpuinfo),
        "kernels": kernel_isa(),  # the loops ours takes: the CPU's best, or COLIBRI_STREAM_ISA's cap
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "disk_free_bytes": shutil.disk_usage(path).free,
        "filesystem": _filesystem_of(path),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "memory_bandwidth_Bps": round(memory_bandwidth(threads)),
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
    }


def _filesystem_of(path: Path) -> str:
    path = path.resolve()
    best = None
    for part in psutil.disk_partitions(all=True):
        if str(path).startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    return f"{best.device} ({best.fstype})" if best else "unknown"
