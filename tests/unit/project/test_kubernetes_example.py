"""The Kubernetes example (examples/kubernetes/checkpointless.yaml) against this version's CLI.

No cluster runs here, so this checks what can go wrong without one: every `checkpointless`
command in the manifests parses with the real argument parser (a renamed or required flag fails
it), and the pieces agree with each other, as the job needs them to: the agents reach the
coordinator's Service on its control port, read the secret from the coordinator's run directory
on a volume every pod mounts at the same path, are as many as nodes plus spare nodes, each with
an in-memory /dev/shm and as many GPUs as ranks per node, and bind their pod's own address.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpointless.cli import build_parser
from tests.helpers.paths import ROOT

MANIFEST = ROOT / "examples" / "kubernetes" / "checkpointless.yaml"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for d in yaml.safe_load_all(MANIFEST.read_text()):
        if d is not None:
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


# what the kubelet fills in for each downward-API field the containers read
POD_IP = "10.8.0.17"
INDEX = "2"


def _value(e: dict[str, Any]) -> str:
    path = e["valueFrom"]["fieldRef"]["fieldPath"]
    return POD_IP if path == "status.podIP" else INDEX if "job-completion-index" in path else "?"


def _argv(c: dict[str, Any]) -> list[str]:
    """The container's command line as the kubelet would run it, $(VAR) expanded from its env
    (only variables the container defines expand; Kubernetes leaves the others as written)."""
    env = {e["name"]: _value(e) for e in c.get("env", [])}

    def expand(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    return [expand(a) for a in [*c["command"], *c["args"]]]


def _parsed(c: dict[str, Any]) -> Any:
    argv = _argv(c)
    assert argv[0] == "checkpointless", argv
    return build_parser().parse_args(argv[1:])


def _env_field(c: dict[str, Any], name: str) -> str:
    (e,) = [e for e in c["env"] if e["name"] == name]
    return str(e["valueFrom"]["fieldRef"]["fieldPath"])


def _mounts(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mount path -> the volume mounted there."""
    spec = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in _container(job)["volumeMounts"]}


@pytest.mark.timeout(60)
def test_every_command_parses_and_the_pieces_agree() -> None:
    docs = _docs()
    coord_job, agents_job = docs[("Job", "ckl-coord")], docs[("Job", "ckl-agents")]
    service = docs[("Service", "ckl-coord")]
    coord, agent = _parsed(_container(coord_job)), _parsed(_container(agents_job))
    assert coord.command == "coordinator" and agent.command == "agent"

    # the agents reach the coordinator through its headless Service, on its control port
    host, port = agent.coordinator.rsplit(":", 1)
    assert host == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= coord_job["spec"]["template"]["metadata"]["labels"].items()
    assert int(port) == coord.control_port == service["spec"]["ports"][0]["port"]

    # each binds its own pod's address (what the Service name resolves to, for the coordinator)
    for job, args in ((coord_job, coord), (agents_job, agent)):
        assert args.host == POD_IP
        assert _env_field(_container(job), "POD_IP") == "status.podIP"

    # the secret is the coordinator's <run dir>/secret, on the volume both mount at the same path
    assert Path(agent.secret_file) == Path(coord.run_dir) / "secret"
    coord_mounts, agent_mounts = _mounts(coord_job), _mounts(agents_job)
    (shared,) = [p for p in coord_mounts if Path(coord.run_dir).is_relative_to(p)]
    claim = coord_mounts[shared]["persistentVolumeClaim"]["claimName"]
    assert agent_mounts[shared]["persistentVolumeClaim"]["claimName"] == claim
    pvc = docs[("PersistentVolumeClaim", claim)]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # mounted by pods on several nodes

    # one agent per node: nodes plus spare nodes, indexed (the node order), never two on a node
    spec = agents_job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == coord.nnodes + coord.spare_nodes
    assert agent.node_order == int(INDEX)
    assert "job-completion-index" in _env_field(_container(agents_job), "NODE_ORDER")
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()

    # a GPU per rank, and a /dev/shm in memory large enough for the batch cache and copies
    limits = _container(agents_job)["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == coord.nproc_per_node
    assert agent_mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"

    # every pod the same user (the run directory is 0700), agents patient with a late coordinator
    users = {j["spec"]["template"]["spec"]["securityContext"]["runAsUser"] for j in (coord_job, agents_job)}
    assert len(users) == 1, users
    assert agent.connect_timeout >= 300

    # Kubernetes must not restart either by itself: the job handles its own faults
    for job in (coord_job, agents_job):
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert coord_job["spec"]["backoffLimit"] == 0


@pytest.mark.timeout(60)
def test_the_operations_page_points_at_the_example() -> None:
    page = (MANIFEST.parents[2] / "docs" / "operations.md").read_text()
    assert "examples/kubernetes/checkpointless.yaml" in page
