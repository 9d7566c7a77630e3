"""--numa-node (runtime/numa.py): sysfs's node lists read, the list checked against the
processes, cores shared out, and a process bound: every thread's CPUs, the memory policy
of the threads it starts. The binding runs in a child process (it would bind pytest's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import Engine
from kiln.args import ArgError
from kiln.runtime import numa
from kiln.runtime.engine import chunked_prefill_for, device_memory_mib


def _sysfs(tmp_path: Path, **cpulists: str) -> Path:
    root = tmp_path / "node"
    for name, cpus in cpulists.items():
        (root / name).mkdir(parents=True)
        (root / name / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-3\n")
    return root


def test_cpulists_and_nodes(tmp_path) -> None:
    assert numa.cpulist("0-3,8-11\n") == {0, 1, 2, 3, 8, 9, 10, 11}
    assert numa.cpulist("5") == {5}
    assert numa.cpulist("\n") == set()
    root = _sysfs(tmp_path, node0="0-1", node1="2-3", node3="")  # node3: memory only
    assert numa.nodes(root) == {0: {0, 1}, 1: {2, 3}}
    assert numa._short({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_chunked_prefill_defaults_to_sglangs_size_for_the_smallest_nodes_memory(
    tmp_path, artefact
) -> None:
    root = _sysfs(tmp_path, node0="0-1", node1="2-3", node3="")
    for name, kb in (("node0", 64 * 2**20), ("node1", 30 * 2**20), ("node3", 2**20)):
        (root / name / "meminfo").write_text(f"Node {name[4:]} MemTotal: {kb} kB\nNode ...\n")
    assert numa.node_memory_mib(root) == [64 * 1024, 30 * 1024]  # node3 runs nothing
    # SGLang's table (server_args.py), in MiB of the device's memory
    sizes = {20 * 1024 - 1: 2048, 34 * 1024: 2048, 35 * 1024: 4096, 59 * 1024: 4096}
    sizes |= {60 * 1024: 8192, 159 * 1024: 8192, 160 * 1024: 16384, None: 4096}
    assert {mib: chunked_prefill_for(mib) for mib in sizes} == sizes
    engine = Engine(artefact("llama"), max_total_tokens=256)
    expect = chunked_prefill_for(device_memory_mib("cpu"))
    assert engine.scheduler.cfg.chunked_prefill_size == expect
    assert (
        Engine(
            artefact("llama"), max_total_tokens=256, chunked_prefill_size=-1
        ).scheduler.cfg.chunked_prefill_size
        is None
    )


def test_the_list_is_checked_against_the_processes(tmp_path) -> None:
    root = _sysfs(tmp_path, node0="0-1", node1="2-3", node3="")
    assert numa.check([1, 0, 1], 2, "2 ranks", root) == [1, 0]
    with pytest.raises(ArgError, match=r"--numa-node 0: 1 node\(s\) for 2 processes \(2 ranks\)"):
        numa.check([0], 2, "2 ranks", root)
    with pytest.raises(ArgError, match="no node 3, 4 with CPUs on this machine; its nodes: 0, 1"):
        numa.check([4, 3], 2, "2 ranks", root)
    with pytest.raises(ArgError, match="its nodes: none"):
        numa.check([0], 1, "1 rank", tmp_path / "absent")


def test_cores_are_shared_between_the_processes_of_a_node() -> None:
    [whole] = numa.shares([0])
    assert whole >= 1
    assert numa.shares([0, 0]) == [max(1, whole // 2)] * 2
    assert numa.shares([0] * 64) == [1] * 64


def test_an_engine_refuses_a_list_that_does_not_fit(artefact) -> None:
    with pytest.raises(ArgError, match="--numa-node 99: no node 99"):
        Engine(artefact("llama"), numa_node=[99])
    tp2 = artefact("llama", compile_args={"tp_size": 2})
    with pytest.raises(ArgError, match=r"1 node\(s\) for 2 processes \(2 tensor-parallel"):
        Engine(tp2, numa_node=[0])


_BIND = """
import json, os, sys, threading
from pathlib import Path
from kiln.runtime import numa
from kiln.runtime.engine import chunked_prefill_for, device_memory_mib
started, done = threading.Event(), threading.Event()
def before():
    started.set()
    done.wait()
t = threading.Thread(target=before)
t.start()
started.wait()
cpus = numa.bind(0, Path(sys.argv[1]))
out = {"cpus": sorted(cpus), "earlier": sorted(os.sched_getaffinity(t.native_id))}
done.set()
t.join()
later = []
t = threading.Thread(target=lambda: later.append(numa.mempolicy()))
t.start()
t.join()
mode, nodes = later[0]
out["later"] = [mode, sorted(nodes)]
print(json.dumps(out))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to narrow to one")
def test_bind_moves_every_thread_and_prefers_the_nodes_memory(tmp_path) -> None:
    one = max(os.sched_getaffinity(0))  # a node of one CPU: the binding shows
    root = _sysfs(tmp_path, node0=str(one))
    run = subprocess.run(
        [sys.executable, "-c", _BIND, str(root)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["cpus"] == [one]
    assert got["earlier"] == [one]  # a thread started before the binding moved too
    assert got["later"] == [numa.MPOL_PREFERRED, [0]]  # one started after: node 0's memory


def test_bind_to_cpus_outside_the_process_is_a_clear_error(tmp_path) -> None:
    root = _sysfs(tmp_path, node0="4000")
    code = (
        "import sys; from pathlib import Path; from kiln.runtime import numa; "
        "numa.bind(0, Path(sys.argv[1]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0
    assert "--numa-node 0: cannot run on its CPUs here" in run.stderr
