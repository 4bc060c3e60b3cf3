"""k8s/ tells the same story as serve_config.yaml, the code and docs/operations.md.

The RayService is validated against KubeRay's CRD schemas (their `openAPIV3Schema`, with
`jsonschema`), plus a strict pass that refuses fields the schema does not know, which is what
`kubectl apply --validate=strict` would refuse and what plain JSON Schema lets through.
"""

import functools
import gzip
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.cli.main import main as lmserve
from deployments.metrics import METRICS
from deployments.cluster.rayservice import embedded_serve_config, render_rayservice

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
# KubeRay's RayService and RayCluster CRDs (Apache-2.0), gzipped: tests/data/kuberay-crds/README.md
SCHEMAS = Path(__file__).parent / "data" / "kuberay-crds"
METRICS_PORT = 8080


def _rayservice() -> dict:
    return yaml.safe_load((K8S / "rayservice.yaml").read_text())


@functools.cache
def _crd_schema(filename: str, version: str = "v1") -> dict:
    text = gzip.decompress((SCHEMAS / f"{filename}.gz").read_bytes())
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def _unknown_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Paths of keys in `doc` that `schema` does not declare (strict validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(doc, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                found += _unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += _unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                found.append(f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            found += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def _pod_templates(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


# ---- serveConfigV2 = serve_config.yaml ---------------------------------------------------

def test_serve_config_v2_is_serve_config_yaml():
    serve_config = (ROOT / "serve_config.yaml").read_text()
    embedded = _rayservice()["spec"]["serveConfigV2"]
    assert embedded == serve_config
    assert yaml.safe_load(embedded) == yaml.safe_load(serve_config)
    assert lmserve(["render-k8s", "--check", "--config", str(ROOT / "serve_config.yaml"),
                    "--manifest", str(K8S / "rayservice.yaml")]) == 0


def test_render_k8s_replaces_only_the_embedded_config(tmp_path):
    manifest = (K8S / "rayservice.yaml").read_text()
    changed = "# changed\napplications:\n  - name: other\n\n    import_path: x:y\n"
    rendered = render_rayservice(manifest, changed)
    assert embedded_serve_config(rendered) == changed
    assert yaml.safe_load(rendered)["spec"]["serveConfigV2"] == changed
    assert render_rayservice(rendered, (ROOT / "serve_config.yaml").read_text()) == manifest
    # the command: --check reports the drift and changes nothing; without it, it writes
    (tmp_path / "rs.yaml").write_text(rendered)
    args = ["render-k8s", "--config", str(ROOT / "serve_config.yaml"), "--manifest", str(tmp_path / "rs.yaml")]
    assert lmserve(args + ["--check"]) == 1
    assert (tmp_path / "rs.yaml").read_text() == rendered
    assert lmserve(args) == 0
    assert (tmp_path / "rs.yaml").read_text() == manifest


# ---- the RayService against KubeRay's CRDs -----------------------------------------------

def test_rayservice_validates_against_the_rayservice_crd():
    rs, schema = _rayservice(), _crd_schema("ray.io_rayservices.yaml")
    jsonschema.validate(rs, schema)
    assert _unknown_fields(rs, schema) == []


def test_ray_cluster_config_validates_against_the_raycluster_crd():
    spec, schema = _rayservice()["spec"]["rayClusterConfig"], _crd_schema("ray.io_rayclusters.yaml")
    jsonschema.validate({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "lmserve"},
                         "spec": spec}, schema)
    assert _unknown_fields(spec, schema["properties"]["spec"]) == []


def test_strict_check_catches_a_misspelt_field():
    rs = _rayservice()
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert _unknown_fields(rs, _crd_schema("ray.io_rayservices.yaml")) == [
        ".spec.rayClusterConfig.workerGroupSpecs[0].maxReplica"]


def test_rayservice_shape_head_cpu_gpu_autoscaling_resources_probes():
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}

    def gpus(template: dict) -> list:
        return [c["resources"].get(kind, {}).get("nvidia.com/gpu") for c in template["spec"]["containers"]
                for kind in ("requests", "limits")]

    assert not any(gpus(head["template"])) and not any(gpus(groups["cpu"]["template"]))
    assert all(gpus(groups["gpu"]["template"]))
    assert head["rayStartParams"]["num-cpus"] == "0"
    for group in groups.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"] and group["maxReplicas"] > 1
    for template in _pod_templates(_rayservice()):
        for c in template["spec"]["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"]
            assert c["readinessProbe"] and c["livenessProbe"]
            assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in groups.values()]:
        assert params["metrics-export-port"] == str(METRICS_PORT)


def test_every_pod_runs_ray_serve_high_throughput_mode():
    """Ray reads these in every process (controller, HAProxy manager, replicas): every pod sets them,
    with the values `lmserve serve` uses (deployments.cluster.env.RAY_HIGH_THROUGHPUT_ENV)."""
    from deployments.cluster.env import RAY_HIGH_THROUGHPUT_ENV

    for template in _pod_templates(_rayservice()):
        for c in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert {k: env.get(k) for k in RAY_HIGH_THROUGHPUT_ENV} == RAY_HIGH_THROUGHPUT_ENV, c["name"]


def test_images_are_this_version_on_the_pinned_ray():
    import ray

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    images = {c["image"] for t in _pod_templates(_rayservice()) for c in t["spec"]["containers"]}
    assert images == {f"lmserve:{project['version']}", f"lmserve:{project['version']}-gpu"}


# ---- PodMonitor, dashboard, KEDA: metrics that exist ------------------------------------

def _keda_docs() -> list[dict]:
    return list(yaml.safe_load_all((K8S / "keda-scaledobject.yaml").read_text()))


def _queries() -> list[str]:
    dashboard = json.loads((K8S / "grafana" / "lmserve-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    queries += [t["metadata"]["query"] for d in _keda_docs() if d["kind"] == "ScaledObject"
                for t in d["spec"]["triggers"]]
    return queries


def queried_metric_names() -> set[str]:
    """Every metric name the dashboard and the KEDA example query (used by tests/test_metrics.py
    to check that they are really on Ray's endpoint)."""
    return {name for q in _queries() for name in re.findall(r"\bray_[a-z0-9_]+", q)}


def _defined_names() -> set[str]:
    """Every `ray_lmserve_*` series: the serving layer's and the adapters loaded at run time."""
    from engines.dynamic_adapters import ADAPTER_METRICS

    names = set()
    for spec in METRICS + ADAPTER_METRICS:
        names.add(spec.prometheus_name)
        if spec.kind == "histogram":
            names |= {spec.prometheus_name + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_dashboard_and_keda_query_only_defined_lmserve_metrics():
    lmserve_names = {n for n in queried_metric_names() if n.startswith("ray_lmserve_")}
    assert lmserve_names <= _defined_names()
    # every lmserve metric is on the dashboard
    assert {spec.prometheus_name for spec in METRICS} <= {re.sub(r"_(bucket|sum|count)$", "", n) for n in lmserve_names}


def test_dashboard_has_the_panels_operators_need():
    dashboard = json.loads((K8S / "grafana" / "lmserve-dashboard.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("request rate", "time to first token", "inter-token latency", "tokens per second",
                   "running and waiting", "replicas", "errors"):
        assert needed in titles
    for p in dashboard["panels"]:
        assert p["targets"] and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_podmonitor_scrapes_the_pods_metrics_port():
    pm = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = pm["spec"]["selector"]["matchLabels"]
    templates = _pod_templates(_rayservice()) + [d["spec"]["template"] for d in _keda_docs()
                                                 if d["kind"] == "Deployment"]
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert all(ports[e["port"]] == METRICS_PORT for e in pm["spec"]["podMetricsEndpoints"])


def test_keda_example_targets_its_deployment():
    docs = {d["kind"]: d for d in _keda_docs()}
    assert docs["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    args = " ".join(docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert f"--metrics-export-port={METRICS_PORT}" in args and "serve_config.yaml" in args


# ---- docs/operations.md and Dockerfile -----------------------------------------------------

def _readme() -> str:
    """docs/operations.md, where the metrics table and the image build are documented."""
    return (ROOT / "docs" / "operations.md").read_text()


def test_readme_documents_every_metric_and_no_other():
    readme = _readme()
    for spec in METRICS:
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{spec.prometheus_name}`")), None)
        assert row is not None, f"docs/operations.md has no row for {spec.prometheus_name}"
        assert spec.kind in row and spec.unit in row
        assert all(f"`{label}`" in row for label in spec.labels)
    mentioned = set(re.findall(r"\bray_lmserve_[a-z0-9_]+", readme))
    assert mentioned <= _defined_names(), mentioned - _defined_names()


def test_dockerfile_installs_what_the_readme_says():
    import ray

    dockerfile = (K8S / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M)[1]
    assert base == f"rayproject/ray:{ray.__version__}-py311"
    torch_pin = re.search(r'"torch==([\d.]+)"', pyproject)[1]
    assert f"torch=={torch_pin}" in dockerfile
    assert "pip install --no-cache-dir . " in dockerfile
    # a backend installs as users install it (deployments/cli/setup.py), with its device named
    assert 'lmserve setup ${LMSERVE_SETUP}' in dockerfile and 'ARG LMSERVE_SETUP=""' in dockerfile
    assert "lmserve download smollm2" in dockerfile
    # Ray's HAProxy through lmserve-haproxy (no TCP splicing), checked at build time
    launcher = re.search(r"^ENV RAY_SERVE_HAPROXY_BINARY_PATH=(\S+)$", dockerfile, re.M)[1]
    assert launcher.endswith("/bin/lmserve-haproxy")
    assert 'lmserve-haproxy = "deployments.cluster.haproxy:main"' in pyproject
    assert 'RUN test -x "${RAY_SERVE_HAPROXY_BINARY_PATH}"' in dockerfile
    readme = _readme()
    assert base in readme and f"torch {torch_pin}" in readme
    build_args = set(re.findall(r"--build-arg (\w+)=", readme))
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    assert build_args and build_args <= declared
    assert "docker build -f k8s/Dockerfile" in readme


@pytest.mark.parametrize("path", ["rayservice.yaml", "podmonitor.yaml", "keda-scaledobject.yaml"])
def test_manifests_parse(path):
    for doc in yaml.safe_load_all((K8S / path).read_text()):
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]


# ---- drain on Kubernetes (issue 40 item 7) ------------------------------------------------

def _replica_grace_s() -> float:
    """The longest `graceful_shutdown_timeout_s` of serve_config.yaml's deployments, as built."""
    from deployments.cli.preflight import preflight

    targets = preflight(str(ROOT / "serve_config.yaml"), kind="serve").targets
    return max(t.target._bound_deployment._deployment_config.graceful_shutdown_timeout_s for t in targets)


def test_every_rayservice_pod_drains_its_node_before_kubernetes_kills_it():
    """KubeRay's PID 1 is bash, which does not pass SIGTERM to `ray start --block`: the preStop
    hook does, and Ray's drain deadline covers the replicas' graceful shutdown, within the pod's
    grace period (the hook waits the drain + 10 s)."""
    replica_grace_s = _replica_grace_s()
    for template in _pod_templates(_rayservice()):
        spec = template["spec"]
        for c in spec["containers"]:
            assert c["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "deployments.cluster.prestop"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            drain_s = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
            assert drain_s > replica_grace_s, (drain_s, replica_grace_s)
            assert spec["terminationGracePeriodSeconds"] >= drain_s + 10


def test_the_keda_layout_runs_lmserve_serve_as_pid_1_in_the_high_throughput_mode():
    """It ran plain `serve run` (no HAProxy data path, no drain on SIGTERM)."""
    from deployments.cluster.env import RAY_HIGH_THROUGHPUT_ENV

    deployment = next(d for d in yaml.safe_load_all((K8S / "keda-scaledobject.yaml").read_text())
                      if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["args"][0].split("&&")[-1].split() == ["exec", "lmserve", "serve", "serve_config.yaml"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: env.get(k) for k in RAY_HIGH_THROUGHPUT_ENV} == RAY_HIGH_THROUGHPUT_ENV
    assert spec["terminationGracePeriodSeconds"] > _replica_grace_s()


def test_the_prestop_hook_sends_sigterm_to_ray_start_and_waits_for_it(tmp_path):
    import subprocess
    import sys
    import time

    from deployments.cluster import prestop

    # `ray start --block` as Ray's CLI runs it (`python .../bin/ray start ... --block`): on SIGTERM
    # it "drains" for a second, then exits
    fake_ray = tmp_path / "ray"
    drained = tmp_path / "drained"
    fake_ray.write_text("import signal, sys, time\n"
                        "def drain(*_):\n    time.sleep(1)\n"
                        f"    open({str(drained)!r}, 'w').close()\n    sys.exit(0)\n"
                        "signal.signal(signal.SIGTERM, drain)\nprint('up', flush=True)\ntime.sleep(60)\n")
    other = subprocess.Popen([sys.executable, str(fake_ray), "start", "--head"], stdout=subprocess.PIPE)  # no --block
    proc = subprocess.Popen([sys.executable, str(fake_ray), "start", "--head", "--block"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n" and other.stdout.readline() == b"up\n"
        assert prestop.is_ray_start_block(["/home/ray/anaconda3/bin/ray", "start", "--address=h:6379", "--block"])
        assert not prestop.is_ray_start_block(["python", "-m", "deployments.cluster.prestop"])
        started = time.monotonic()
        assert prestop.main(["--timeout-s", "30"]) == 0
        assert proc.poll() == 0 and drained.exists() and 1 <= time.monotonic() - started < 30
        assert other.poll() is None  # only the `--block` one
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()
