"""--numa-node: each of a server's processes on one NUMA node's CPUs and memory.

SGLang binds its i-th scheduler process to the i-th node of the list (libnuma's "run on
node" and "allocate locally"). kiln does the same without libnuma: every thread of the
process, and every one it starts later, runs on the node's CPUs (sched_setaffinity), and
the process's memory policy prefers the node (set_mempolicy MPOL_PREFERRED: pages come from
the node while it has free ones, from another rather than failing). The i-th element is
for this machine's i-th process: tensor-parallel rank i of this node; with --dp-size,
replica r's ranks take elements r*T .. r*T+T-1.

Without --threads, each process runs one kernel thread per physical core of its node,
shared out between the processes given the same node; a machine with one process per
socket so runs each on its own socket's cores against its own memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from kiln.args import ArgError
from kiln.runtime.threads import physical_cores

log = logging.getLogger("kiln.runtime")

SYSFS = Path("/sys/devices/system/node")
MPOL_PREFERRED = 1
# (set_mempolicy, get_mempolicy): glibc has no wrapper for them (libnuma does)
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}
_WORDS = 16  # node masks of 1024 bits, as the kernel's largest MAX_NUMNODES
_MAXNODE = ctypes.c_ulong(_WORDS * 64 + 1)  # the kernel reads maxnode - 1 bits


def cpulist(text: str) -> set[int]:
    """The CPUs of a sysfs list such as "0-3,8-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def nodes(root: Path = SYSFS) -> dict[int, set[int]]:
    """This machine's NUMA nodes that have CPUs, each with its CPUs (memory-only nodes,
    such as CXL expanders, run nothing and are left out)."""
    found: dict[int, set[int]] = {}
    for folder in root.glob("node[0-9]*"):
        try:
            cpus = cpulist((folder / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            found[int(folder.name[4:])] = cpus
    return found


def node_memory_mib(root: Path = SYSFS) -> list[int]:
    """MemTotal of each NUMA node with CPUs, MiB (sysfs's "Node 0 MemTotal: N kB" line);
    empty where sysfs has no nodes."""
    sizes = []
    for node in sorted(nodes(root)):
        try:
            parts = (root / f"node{node}" / "meminfo").read_text().split("\n", 1)[0].split()
        except OSError:
            continue
        if len(parts) >= 4 and parts[2] == "MemTotal:" and parts[3].isdigit():
            sizes.append(int(parts[3]) // 1024)
    return sizes


def check(numa_node: Sequence[int], processes: int, what: str, root: Path = SYSFS) -> list[int]:
    """The nodes of this machine's `processes` processes (`what` says which they are), or
    an ArgError naming --numa-node."""
    given = " ".join(map(str, numa_node))
    if len(numa_node) < processes:
        raise ArgError(
            f"--numa-node {given}: {len(numa_node)} node(s) for {processes} processes "
            f"({what}); give one node per process"
        )
    have = nodes(root)
    missing = sorted(set(numa_node[:processes]) - have.keys())
    if missing:
        known = ", ".join(map(str, sorted(have))) or "none (no " + str(root) + ")"
        raise ArgError(
            f"--numa-node {given}: no node {', '.join(map(str, missing))} with CPUs on this "
            f"machine; its nodes: {known}"
        )
    return list(numa_node[:processes])


def shares(numa_node: Sequence[int], root: Path = SYSFS) -> list[int]:
    """Each process's kernel threads: its node's physical cores, shared out evenly between
    the processes on that node (at least one each)."""
    have = nodes(root)
    return [max(1, physical_cores(cpus=have[n]) // numa_node.count(n)) for n in numa_node]


def bind(node: int, root: Path = SYSFS) -> set[int]:
    """Run this process (each of its threads now, and those they start) on `node`'s CPUs and
    prefer its memory; return the CPUs it now runs on (the node's within its cpuset)."""
    cpus = nodes(root)[node]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:  # none of the node's CPUs in this process's cpuset
            raise ArgError(f"--numa-node {node}: cannot run on its CPUs here: {e}") from None
    where = os.sched_getaffinity(0)
    if _prefer(node):
        log.info("NUMA node %d: CPUs %s, memory preferred there", node, _short(where))
    return where


def _prefer(node: int) -> bool:
    """The calling thread's memory policy (inherited by the threads it starts): prefer
    `node`. False, with a warning, where the kernel refuses it (a container's seccomp
    filter without CAP_SYS_NICE, say): the CPUs are bound all the same."""
    calls = _SYSCALLS.get(platform.machine())
    why = f"no set_mempolicy number for {platform.machine()}"
    if calls is not None:
        mask = (ctypes.c_ulong * _WORDS)()
        mask[node // 64] = 1 << (node % 64)
        libc = ctypes.CDLL(None, use_errno=True)
        # every argument as the full register the kernel reads (syscall takes longs)
        args = (ctypes.c_long(calls[0]), ctypes.c_long(MPOL_PREFERRED), mask, _MAXNODE)
        if libc.syscall(*args) == 0:
            return True
        why = os.strerror(ctypes.get_errno())
    log.warning("NUMA node %d: CPUs bound, memory not (set_mempolicy: %s)", node, why)
    return False


def mempolicy() -> tuple[int, set[int]]:
    """The calling thread's memory policy: its mode (0 default, 1 preferred, 2 bind, ...) and
    its nodes."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        raise OSError(f"no get_mempolicy number for {platform.machine()}")
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * _WORDS)()
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_long(calls[1]), ctypes.byref(mode), mask, _MAXNODE, None, ctypes.c_ulong(0))
    if libc.syscall(*args) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return mode.value, {w * 64 + b for w in range(_WORDS) for b in range(64) if mask[w] >> b & 1}


def _short(cpus: set[int]) -> str:
    """CPUs as a sysfs list: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[str] = []
    for c in sorted(cpus):
        if runs and c - 1 in cpus:
            runs[-1] = runs[-1].split("-")[0] + f"-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)
