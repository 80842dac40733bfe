"""Loading the Alibaba trace CSV and the project's YAML; bad input names file, line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import alibaba, yamlformat
from simulator.inputs import load_inputs
from simulator.model import InputError, SimPod

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
node-a,96000,393216,8,G2
node-b,16000,122880,2,P100
"""

PODS_CSV = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
pod-0,12000,16384,1,1000,,LS,Running,0,100,0
pod-1,6000,12288,1,460,P100|G2,LS,Running,10,70,10
pod-2,8000,32768,0,0,,BE,Failed,20,20,
pod-3,88000,344064,8,1000,,LS,Running,30,1030,30
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_alibaba_trace_files_load(tmp_path: Path) -> None:
    cluster = alibaba.load_nodes(write(tmp_path, "nodes.csv", NODES_CSV))
    assert [(n.name, n.model, n.gpus, n.gpu_memory_mib, n.cpu_milli) for n in cluster.nodes] == [
        ("node-a", "G2", 8, 16384, 96000),
        ("node-b", "P100", 2, 16384, 16000),
    ]
    assert cluster.total_gpus == 10
    pods = alibaba.load_pods(write(tmp_path, "pods.csv", PODS_CSV)).pods
    assert pods[1] == SimPod("pod-1", 6000, 12288, 1, 460, ("G2", "P100"), None, 10.0, 60.0)
    assert pods[2].num_gpu == 0 and pods[2].duration == 0.0
    assert pods[3].total_gpu_milli == 8000 and not pods[3].fractional


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("sn,cpu_milli,memory_mib,gpu\nn,1,1,1\n", ":1:1:", "header has no column 'model'"),
        (
            "sn,cpu_milli,memory_mib,gpu,model\nn,abc,1,1,T4\n",
            ":2:3:",
            "column 'cpu_milli': 'abc' is not a number",
        ),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,0,T4\n", ":2:7:", "column 'gpu': '0' is below 1"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1,X9\n", ":2:9:", "GPU model 'X9' has no known memory"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1\n", ":2:8:", "4 fields where the header has 5"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1,T4\nn,1,1,1,T4\n", ":3:1:", "node 'n' appears twice"),
    ],
)
def test_bad_node_csv_names_file_line_and_column(tmp_path: Path, text: str, where: str, message: str) -> None:
    path = write(tmp_path, "nodes.csv", text)
    with pytest.raises(InputError) as caught:
        alibaba.load_nodes(path)
    assert str(caught.value).startswith(f"{path}{where}")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("row", "where", "message"),
    [
        ("p,1,1,2,500,,LS,Running,0,1,0", ":2:9:", "column 'gpu_milli': 500 with num_gpu 2"),
        ("p,1,1,1,0,,LS,Running,0,1,0", ":2:9:", "a GPU pod must ask some GPU"),
        (
            "p,1,1,1,100,,LS,Running,50,10,0",
            ":2:28:",
            "column 'deletion_time': 10 is before creation_time 50",
        ),
        ("p,1,1,1.5,100,,LS,Running,0,1,0", ":2:7:", "column 'num_gpu': '1.5' is not an integer"),
    ],
)
def test_bad_pod_csv_names_file_line_and_column(tmp_path: Path, row: str, where: str, message: str) -> None:
    path = write(tmp_path, "pods.csv", PODS_CSV.splitlines()[0] + "\n" + row + "\n")
    with pytest.raises(InputError) as caught:
        alibaba.load_pods(path)
    assert str(caught.value).startswith(f"{path}{where}")
    assert message in str(caught.value)


YAML = """gpu_models:
  MyGPU: {memory_mib: 20480}
nodes:
  - {name: big, count: 2, model: MyGPU, gpus: 4, cpu_milli: 64000, memory_mib: 262144}
  - {name: t4, model: T4, gpus: 1, cpu_milli: 8000, memory_mib: 32768}
pods:
  - {name: infer, count: 2, cpu_milli: 2000, memory_mib: 4096, gpus: 1, gpu_milli: 250,
     gpu_models: [T4], workload: inference, arrival: 5, duration: 60}
  - {name: cpu, cpu_milli: 1000, memory_mib: 1024}
"""


def test_yaml_loads_nodes_pods_and_models(tmp_path: Path) -> None:
    document = yamlformat.load(write(tmp_path, "sim.yaml", YAML))
    assert document.cluster is not None and document.workload is not None
    assert [n.name for n in document.cluster.nodes] == ["big-0", "big-1", "t4"]
    assert document.cluster.nodes[0].gpu_memory_mib == 20480
    assert [p.name for p in document.workload.pods] == ["infer-0", "infer-1", "cpu"]
    infer = document.workload.pods[0]
    assert (infer.gpu_milli, infer.gpu_models, infer.workload, infer.arrival, infer.duration) == (
        250,
        ("T4",),
        "inference",
        5.0,
        60.0,
    )
    assert document.workload.pods[2].num_gpu == 0 and not document.workload.timed


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("nodes: [\n", ":2:1:", "not valid YAML"),
        (
            "nodes:\n  - {name: a, model: T4, gpus: -1, cpu_milli: 1, memory_mib: 1}\n",
            ":2:32:",
            "nodes[0].gpus",
        ),
        ("nodes:\n  - {name: a, model: T4, gpus: 1, cpu_milli: 1}\n", ":2:5:", "missing key 'memory_mib'"),
        (
            "nodes:\n  - {name: a, model: Z1, gpus: 1, cpu_milli: 1, memory_mib: 1}\n",
            ":2:22:",
            "'Z1' has no known",
        ),
        (
            "pods:\n  - name: p\n    cpu_milli: 1\n    memory_mib: 1\n    colour: red\n",
            ":5:5:",
            "unknown key 'colour'",
        ),
        (
            "pods:\n  - {name: p, cpu_milli: 1, memory_mib: 1, gpus: 1, gpu_milli: 1200}\n",
            ":2:64:",
            "more than 1000",
        ),
        (
            "pods:\n  - {name: p, cpu_milli: 1, memory_mib: 1, duration: soon}\n",
            ":2:54:",
            "'soon' must be a number",
        ),
        ("pods: {}\n", ":1:7:", "pods must be a list"),
        ("hosts: []\n", ":1:1:", "unknown key 'hosts'"),
    ],
)
def test_bad_yaml_names_file_line_and_column(tmp_path: Path, text: str, where: str, message: str) -> None:
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(InputError) as caught:
        yamlformat.load(path)
    assert str(caught.value).startswith(f"{path}{where}")
    assert message in str(caught.value)


def test_inputs_mix_csv_yaml_and_the_default(tmp_path: Path) -> None:
    nodes = write(tmp_path, "nodes.csv", NODES_CSV)
    pods = write(tmp_path, "pods.csv", PODS_CSV)
    both = load_inputs(nodes, pods)
    assert len(both.cluster.nodes) == 2 and len(both.workload.pods) == 4
    only_nodes = load_inputs(nodes, None)
    assert "with the pods of the embedded default" in only_nodes.description
    with pytest.raises(InputError, match=r"unknown file type"):
        load_inputs(write(tmp_path, "nodes.txt", NODES_CSV), None)
    with pytest.raises(InputError, match=r"missing\.csv:0:0: cannot read"):
        load_inputs(tmp_path / "missing.csv", pods)
