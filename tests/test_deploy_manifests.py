
"""deploy/: the Kubernetes manifests, the Dockerfile, docker-compose.yaml and nginx.conf.

Nothing here needs a cluster, Docker or the network:
* every Kubernetes manifest is validated offline against the Kubernetes OpenAPI schemas bundled
  with ``kubernetes-validate``, in strict mode (an unknown or misspelt field fails), for the
  oldest and the newest Kubernetes version we support; the kustomizations are rendered with
  ``kubectl kustomize`` when kubectl is installed and the rendered objects validated too;
* the control-plane TOML (the ConfigMap) goes through the control plane's own loader and start
  checks, and every container command line through the real ``omni-proxy`` argument parser and
  config builders, so the deployment files cannot drift from the code;
* names, labels, selectors, ports, probes and the engine's prefix-cache settings are checked
  against each other;
* the Docker build context that .dockerignore leaves is enough to build the wheel;
* nginx.conf passes the real ``nginx -t`` and, run by the real nginx in front of three streaming
  upstreams, streams, spreads by least connections, keeps upstream connections alive and skips
  a dead upstream;
* docker-compose.yaml runs without Docker: every service as a local process on its own loopback
  address (real redis-server, control planes, data planes, simulators and nginx), started in
  dependency order with its own healthcheck, then OpenAI requests through nginx.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from controlplane.config import DEFAULT_HTTP_PORT
from tests.ports import reserved_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
KUSTOMIZATIONS = [K8S / "base", K8S / "overlays" / "example"]
# Applied beside the base; needs the Prometheus Operator's CRDs (its ServiceMonitor is checked by
# the tests below, not by the Kubernetes schemas, which do not know the kind).
MONITORING = K8S / "monitoring"
DASHBOARD = MONITORING / "omni-proxy-dashboard.json"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
COMPOSE = ROOT / "docker-compose.yaml"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
OUR_IMAGE = "omni-proxy"

# The oldest Kubernetes we support (autoscaling/v2 and policy/v1 are GA there) and the newest
# schemas the installed kubernetes-validate bundles.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}


# --------------------------------------------------------------------------------------------
# helpers

def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def all_docs() -> list[dict[str, Any]]:
    return [d for p in manifest_files() for d in load_docs(p)]


def find(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    docs = all_docs() if docs is None else docs
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def validate(doc: dict[str, Any], version: str, where: str) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
        check_service_monitor(doc, where)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata'].get('name')} does not validate against "
                    f"Kubernetes {version} (strict): {path}: {exc.message}")


def generated_objects(directory: Path) -> list[dict[str, Any]]:
    """The ConfigMaps and Secrets a kustomization's generators make (names without the hash)."""
    k = kustomization(directory)
    out = []
    for gen, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in k.get(gen, []):
            assert set(spec) <= {"name", "files", "literals", "behavior", "type", "options"}, spec
            data: dict[str, str] = {}
            for f in spec.get("files", []):
                key, _, path = f.rpartition("=")
                data[key or Path(path).name] = (directory / path).read_text()
            for lit in spec.get("literals", []):
                key, _, value = lit.partition("=")
                data[key] = value
            obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}}
            if spec.get("options", {}).get("labels"):
                obj["metadata"]["labels"] = spec["options"]["labels"]
            if kind == "Secret":
                obj["type"] = spec.get("type", "Opaque")
                obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
            else:
                obj["data"] = data
            out.append(obj)
    return out


def kustomize_bin() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(directory: Path) -> list[dict[str, Any]]:
    cmd = kustomize_bin()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed: the kustomizations are not rendered "
                    "(their resources and generators are still validated one by one)")
    out = subprocess.run([*cmd, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def image_ref(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name, tag


def controlplane_config_from_text(text: str):
    """The control plane's own loader and start checks on a TOML text (the ConfigMap's)."""
    from controlplane.cli import check_config
    from controlplane.config import ControlPlaneConfig

    cfg = ControlPlaneConfig.from_dict(tomllib.loads(text))
    check_config(cfg)
    return cfg


def parse_command(argv: list[str]):
    """Parse a container's command line with the real ``omni-proxy`` parser."""
    from omni_proxy.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"omni-proxy does not accept {shlex.join(argv)}")


# --------------------------------------------------------------------------------------------
# Kubernetes: schemas

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_kubernetes_schema(path: Path, version: str) -> None:
    docs = load_docs(path)
    assert docs, f"{path} holds no object"
    for doc in docs:
        validate(doc, version, str(path.relative_to(ROOT)))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", [*KUSTOMIZATIONS, MONITORING], ids=lambda p: str(p.relative_to(K8S)))
def test_generated_configmaps_and_secrets_validate(directory: Path, version: str) -> None:
    for obj in generated_objects(directory):
        validate(obj, version, f"{directory.relative_to(ROOT)} generator")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_rendered_kustomization_validates(directory: Path) -> None:
    docs = render(directory)
    k = kustomization(directory)
    namespace = k.get("namespace") or kustomization(K8S / "base")["namespace"]
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "StatefulSet", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler"} <= kinds
    for doc in docs:
        for version in K8S_VERSIONS:
            validate(doc, version, f"kustomize build {directory.relative_to(ROOT)}")
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            assert meta["name"] == namespace
        elif doc["kind"] not in CLUSTER_SCOPED:
            assert meta.get("namespace") == namespace, f"{doc['kind']}/{meta['name']} is not in {namespace}"
    # the generated ConfigMap (hash-suffixed name) is the one the control plane mounts
    cp = find("Deployment", "omni-proxy-controlplane", docs)
    volume = next(v for v in cp["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    cm = find("ConfigMap", volume["configMap"]["name"], docs)
    controlplane_config_from_text(cm["data"]["controlplane.toml"])
    # our image: the overlay's registry, the package version
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                name, tag = image_ref(c["image"])
                assert tag and tag != "latest", c["image"]
                if name.rsplit("/", 1)[-1] == OUR_IMAGE:
                    assert tag == VERSION, f"{c['image']}: our image's tag must be the package version {VERSION}"


def test_strict_validation_catches_mistakes() -> None:
    """The negative control: the validator really refuses unknown fields and wrong types."""
    dp = find("Deployment", "omni-proxy-dataplane")
    typo = json.loads(json.dumps(dp))
    container(typo)["readinesProbe"] = container(typo).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSIONS[0], strict=True)
    wrong_type = json.loads(json.dumps(dp))
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSIONS[0], strict=True)


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed: set[Path] = set()
    for directory in (*KUSTOMIZATIONS, MONITORING):
        k = kustomization(directory)
        unknown = set(k) - {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator",
                            "secretGenerator", "images", "patches"}
        assert not unknown, f"{directory}: fields this test does not know to check: {unknown}"
        for res in k["resources"]:
            path = (directory / res).resolve()
            assert path.exists(), f"{directory}/kustomization.yaml names a missing resource {res}"
            listed.add(path)
        for gen in k.get("configMapGenerator", []):
            for f in gen.get("files", []):
                assert (directory / f.rpartition("=")[2]).exists()
    unlisted = [p for p in manifest_files() if p.resolve() not in listed]
    assert not unlisted, f"manifests no kustomization applies: {unlisted}"


def test_no_manifest_names_a_namespace() -> None:
    """Namespaces are set by kustomize (`namespace:`), so an overlay can move everything."""
    for path in manifest_files():
        for doc in load_docs(path):
            assert "namespace" not in doc["metadata"], f"{path}: {doc['kind']}/{doc['metadata']['name']}"
    assert kustomization(K8S / "base")["namespace"] == "omni-proxy"


# --------------------------------------------------------------------------------------------
# Kubernetes: the pieces fit together

def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def test_labels_selectors_and_ports_agree() -> None:
    docs = all_docs()
    for w in workloads(docs):
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{w['metadata']['name']}: selector not in pod labels"
        assert w["metadata"]["labels"].items() >= selector.items()
        for c in w["spec"]["template"]["spec"]["containers"]:
            named = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                p = c.get(probe)
                if p is None:
                    continue
                port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
                if isinstance(port, str):
                    assert port in named, f"{w['metadata']['name']}: {probe} port {port} is not a container port"
    for svc in (d for d in docs if d["kind"] == "Service"):
        targets = [w for w in workloads(docs)
                   if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        named = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"Service {svc['metadata']['name']}: {port['targetPort']}"
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        find("Service", sts["spec"]["serviceName"], docs)
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert [w for w in workloads(docs) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        find(ref["kind"], ref["name"], docs)


def test_images_are_pinned_and_ours_carries_the_package_version() -> None:
    for w in workloads(all_docs()):
        for c in w["spec"]["template"]["spec"]["containers"]:
            name, tag = image_ref(c["image"])
            assert tag and tag != "latest", f"{w['metadata']['name']}: {c['image']} must name a version"
            if name == OUR_IMAGE:
                assert tag == VERSION, f"{c['image']}: the tag must be the package version {VERSION}"
    for directory in KUSTOMIZATIONS:
        for img in kustomization(directory).get("images", []):
            if img["name"] == OUR_IMAGE:
                assert img["newTag"] == VERSION
    assert image_ref(yaml.safe_load(COMPOSE.read_text())["x-omni"]["image"]) == (OUR_IMAGE, VERSION)


def test_redis() -> None:
    sts = find("StatefulSet", "omni-proxy-redis")
    c = container(sts)
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes", "Redis must persist with an append-only file"
    data_dir = args[args.index("--dir") + 1]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == data_dir)
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims, "the AOF directory must be on the PersistentVolumeClaim"
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    svc = find("Service", "omni-proxy-redis")
    assert [p["port"] for p in svc["spec"]["ports"]] == [6379]


def test_controlplane() -> None:
    docs = all_docs()
    dep = find("Deployment", "omni-proxy-controlplane", docs)
    assert dep["spec"]["replicas"] >= 2
    pdb = find("PodDisruptionBudget", "omni-proxy-controlplane", docs)
    assert pdb["spec"]["minAvailable"] == 1
    c = container(dep)
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    key = env_of(c)["OMNI_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "omni-proxy-engine-api-key", "key": "engine-api-key"}

    # the command line and the mounted TOML, through the real parser, loader and start checks
    args = parse_command(c["args"])
    assert args.command == "controlplane"
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    cm_name = volume["configMap"]["name"]
    gen = next(g for g in generated_objects(K8S / "base") if g["metadata"]["name"] == cm_name)
    config_path = Path(args.config)
    assert config_path.parent == Path(mount["mountPath"]) and config_path.name in gen["data"]
    from controlplane.cli import check_config, config_from_args

    args.config = str(K8S / "base" / config_path.name)
    cfg = config_from_args(args)
    check_config(cfg)

    # what the Services and the other workloads assume about it
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.listen == f"0.0.0.0:{ports['grpc']}"
    assert cfg.http_host == "0.0.0.0" and cfg.http_port == ports["http"]
    assert cfg.http_port == DEFAULT_HTTP_PORT, "the manifests use the documented default metrics port"
    assert cfg.state.backend == "redis", "several replicas must share their state through Redis"
    redis_svc = find("Service", "omni-proxy-redis", docs)
    assert cfg.state.redis_url == f"redis://{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}/0"
    svc = find("Service", "omni-proxy-controlplane", docs)
    # the session socket (data planes reach it at the port they dialled gRPC on, plus this one)
    assert cfg.session_listen == f"0.0.0.0:{ports['session']}"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": ports["grpc"], "http": ports["http"],
                                                                   "session": ports["session"]}
    headless = find("Service", "omni-proxy-controlplane-headless", docs)
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"grpc": ports["grpc"],
                                                                        "session": ports["session"]}
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["http"])


def test_dataplane(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = all_docs()
    dep = find("Deployment", "omni-proxy-dataplane", docs)
    c = container(dep)
    args = parse_command(c["args"])
    assert args.command == "dataplane" and args.host == "0.0.0.0"
    from dataplane.cli import config_from_args

    # the engine key: the Secret in $OMNI_ENGINE_API_KEY, read by the data plane itself
    assert env_of(c)["OMNI_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "omni-proxy-engine-api-key", "key": "engine-api-key"}
    monkeypatch.setenv("OMNI_ENGINE_API_KEY", "key")
    cfg = config_from_args(args)
    assert cfg.upstream.engine_api_key == "key"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["http"]
    cp_svc = find("Service", "omni-proxy-controlplane", docs)
    grpc_port = next(p["port"] for p in cp_svc["spec"]["ports"] if p["name"] == "grpc")
    assert args.controlplane == f"{cp_svc['metadata']['name']}:{grpc_port}"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["cpu"], "a CPU autoscaler needs a CPU request"
    hpa = find("HorizontalPodAutoscaler", "omni-proxy-dataplane", docs)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in dep["spec"], "the autoscaler owns the replica count; apply must not reset it"
    svc = find("Service", "omni-proxy-dataplane", docs)
    assert svc["spec"]["type"] in ("ClusterIP", "LoadBalancer")


def test_no_secret_on_a_command_line() -> None:
    """Keys and tokens reach every process through its environment or a file, never a flag (which
    any user of the node reads in `ps`): no argument names a secret-valued variable or a key flag."""
    for w in workloads(all_docs()):
        for c in w["spec"]["template"]["spec"]["containers"]:
            secret_vars = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            argv = [*c.get("command", []), *c.get("args", [])]
            for a in argv:
                assert not any(f"$({v})" in a for v in secret_vars), f"{w['metadata']['name']}: {a}"
                assert not re.search(r"--[\w-]*(api-key|token|password|secret)\b(?!-file)", a), \
                    f"{w['metadata']['name']}: a secret on the command line: {a}"


def engines(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The example's engines by their OMNI_ROLE."""
    out = {}
    for w in workloads(docs):
        if w["metadata"]["labels"].get("app.kubernetes.io/component") == "engine":
            out[env_of(container(w))["OMNI_ROLE"]["value"]] = w
    return out


def test_example_engines_are_a_nixl_pd_pair_the_control_plane_places() -> None:
    """A prefill and a decode engine whose NixlConnector settings are the real-vLLM tests' (one
    source: tests/vllm_harness/recipe.py), whose kv_role gives the role they register with, and
    whose side channel D can reach; the control plane's flow is the one NixlConnector needs."""
    from engine_plugins.vllm_plugin.agent import EngineFacts, Settings, role_for

    from tests.vllm_harness.recipe import nixl_config

    docs = all_docs()
    pair = engines(docs)
    assert set(pair) == {"prefill", "decode"}, set(pair)
    cfg = controlplane_config_from_text((K8S / "base" / "controlplane.toml").read_text())
    assert cfg.pd_flow == "sequential", "NixlConnector pulls: P first, then D with P's kv_transfer_params"
    for role, engine in pair.items():
        c = container(engine)
        args, env = c["args"], env_of(c)
        transfer = args[args.index("--kv-transfer-config") + 1]
        kv_role = json.loads(transfer)["kv_role"]
        assert transfer == nixl_config(kv_role), "the tests' NixlConnector settings (tests/vllm_harness/recipe.py)"
        derived = role_for(Settings(controlplanes=["cp"]), EngineFacts(host="", port=0, models=[], kv_role=kv_role))
        assert derived == role, f"{engine['metadata']['name']}: OMNI_ROLE {role} but kv_role {kv_role} means {derived}"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)", "P hands this address to D"
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["nixl"]
        assert env["VLLM_PLUGINS"]["value"] == "omni_proxy"
        pdb = find("PodDisruptionBudget", engine["metadata"]["name"], docs)
        assert pdb["spec"]["selector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
        assert pdb["spec"].get("maxUnavailable") == 1, "a drain may take an engine: minAvailable would block it"
        check_engine_matches_the_control_plane(engine, docs)


def check_engine_matches_the_control_plane(engine: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    c = container(engine)
    args, env = c["args"], env_of(c)
    cfg = controlplane_config_from_text((K8S / "base" / "controlplane.toml").read_text())
    assert "--enable-prefix-caching" in args
    assert int(args[args.index("--block-size") + 1]) == cfg.kv_cache.block_size
    assert args[args.index("--prefix-caching-hash-algo") + 1] == cfg.kv_cache.hash_algo
    assert env["PYTHONHASHSEED"]["value"] == str(cfg.kv_cache.hash_seed)
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert kv["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    # registration settings for the omni-proxy vLLM plugin
    cp_svc = find("Service", "omni-proxy-controlplane", docs)
    grpc_port = next(p["port"] for p in cp_svc["spec"]["ports"] if p["name"] == "grpc")
    assert env["OMNI_CONTROLPLANE"]["value"] == f"{cp_svc['metadata']['name']}:{grpc_port}"
    assert env["OMNI_ROLE"]["value"] in ("both", "prefill", "decode")
    assert env["OMNI_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{ports['http']}"
    assert env["OMNI_KV_EVENTS"]["value"] == f"tcp://$(POD_IP):{ports['kv-events']}"
    assert "OMNI_TOKEN" in env
    names = list(env)
    assert names.index("POD_IP") < names.index("OMNI_ADVERTISE_URL"), "$(POD_IP) must be defined first"
    # what the engine would register is a worker the control plane accepts
    from controlplane.config import WorkerSpec

    WorkerSpec.from_dict({"url": "http://10.1.2.3:8000", "role": env["OMNI_ROLE"]["value"],
                          "kv_events": env["OMNI_KV_EVENTS"]["value"].replace("$(POD_IP)", "10.1.2.3"),
                          "kv_replay": env["OMNI_KV_REPLAY"]["value"].replace("$(POD_IP)", "10.1.2.3")})
    api_key = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert api_key == {"name": "omni-proxy-engine-api-key", "key": "engine-api-key"}
    assert c["resources"]["limits"]["nvidia.com/gpu"]
    # what the control plane itself checks when the plugin registers (its [kv_cache] refusal)
    from controlplane.services import hashing_mismatch
    from protos import omni_proxy_pb2 as pb

    kvc = cfg.kv_cache
    facts = pb.EngineFacts(block_size=int(args[args.index("--block-size") + 1]), prefix_caching=True,
                           hash_algo=args[args.index("--prefix-caching-hash-algo") + 1],
                           hash_seed=env["PYTHONHASHSEED"]["value"], hash_seed_set=True)
    kv = pb.KVHashConfig(enabled=True, block_size=kvc.block_size, algo=kvc.hash_algo, seed=kvc.hash_seed or "",
                         seed_set=kvc.hash_seed is not None)
    assert hashing_mismatch(facts, kv) == "", hashing_mismatch(facts, kv)


# --------------------------------------------------------------------------------------------
# Monitoring: the ServiceMonitor and the Grafana dashboard

SERVICE_MONITOR_FIELDS = {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
                          "sampleLimit"}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings",
                   "metricRelabelings", "bearerTokenSecret", "tlsConfig"}


def check_service_monitor(doc: dict[str, Any], where: str) -> None:
    """The Kubernetes schemas do not know the Prometheus Operator's kinds: the fields this one
    uses, spelled as the CRD spells them (monitoring.coreos.com/v1)."""
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, f"{where}: {set(doc)}"
    spec = doc["spec"]
    assert set(spec) <= SERVICE_MONITOR_FIELDS and spec.get("endpoints"), f"{where}: {set(spec)}"
    assert set(spec["selector"]) <= {"matchLabels", "matchExpressions"}, where
    for e in spec["selector"].get("matchExpressions", []):
        assert set(e) <= {"key", "operator", "values"} and e["operator"] in ("In", "NotIn", "Exists", "DoesNotExist")
    for ep in spec["endpoints"]:
        assert set(ep) <= ENDPOINT_FIELDS and isinstance(ep["port"], str), f"{where}: {ep}"
        for key in ("interval", "scrapeTimeout"):
            assert key not in ep or re.fullmatch(r"\d+(ms|s|m)", ep[key]), f"{where}: {key} {ep[key]}"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_service_monitor_scrapes_every_plane() -> None:
    """The ServiceMonitor selects the data-plane and control-plane Services, each through a port
    that serves /metrics, and nothing else."""
    (sm,) = load_docs(MONITORING / "servicemonitor.yaml")
    check_service_monitor(sm, "monitoring/servicemonitor.yaml")
    services = [d for d in all_docs() if d["kind"] == "Service"]
    chosen = {s["metadata"]["name"] for s in services if _selects(sm["spec"]["selector"], s["metadata"]["labels"])}
    assert {"omni-proxy-dataplane", "omni-proxy-controlplane"} <= chosen
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        scraped = {s["metadata"]["name"] for s in services if s["metadata"]["name"] in chosen
                   and ep["port"] in {p["name"] for p in s["spec"]["ports"]}}
        assert scraped == {"omni-proxy-dataplane", "omni-proxy-controlplane"}, scraped
    cp = container(find("Deployment", "omni-proxy-controlplane"))
    cfg = controlplane_config_from_text((K8S / "base" / "controlplane.toml").read_text())
    assert {p["name"]: p["containerPort"] for p in cp["ports"]}["http"] == cfg.http_port, "/metrics is on http_port"


def test_rendered_monitoring_kustomization() -> None:
    docs = render(MONITORING)
    assert {d["kind"] for d in docs} == {"ServiceMonitor", "ConfigMap"}
    for doc in docs:
        for version in K8S_VERSIONS:
            validate(doc, version, "kustomize build deploy/kubernetes/monitoring")
        assert doc["metadata"]["namespace"] == kustomization(K8S / "base")["namespace"]
    cm = find("ConfigMap", "omni-proxy-grafana-dashboard", docs)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())


METRIC_CONSTRUCTORS = re.compile(
    r"\b(Gauge|Counter|Histogram|Summary|GaugeMetricFamily|CounterMetricFamily|HistogramMetricFamily|"
    r"SummaryMetricFamily|_Family|_Counters)\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\"")


def exported_metric_names() -> set[str]:
    """Every sample name the processes' /metrics can carry, from the code's prometheus_client
    definitions: a counter `x` is scraped as `x_total`, a histogram as `x_bucket`/`x_sum`/`x_count`
    (the data plane's `_Family` is either), plus prometheus_client's process collector."""
    from prometheus_client import ProcessCollector

    names: set[str] = set()
    for package in ("dataplane", "controlplane", "metaserver", "omni_runtime", "engine_api", "kvhash"):
        for path in (ROOT / package).rglob("*.py"):
            for kind, name in METRIC_CONSTRUCTORS.findall(path.read_text()):
                counter = {f"{name}_total", f"{name}_created"}
                histogram = {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
                names |= {"Gauge": {name}, "GaugeMetricFamily": {name}, "Counter": counter,
                          "CounterMetricFamily": counter, "_Counters": counter, "Histogram": histogram,
                          "HistogramMetricFamily": histogram, "Summary": histogram - {f"{name}_bucket"},
                          "SummaryMetricFamily": histogram - {f"{name}_bucket"},
                          "_Family": counter | histogram}[kind]
    for metric in ProcessCollector(registry=None, pid=lambda: "self").collect():
        names |= {s.name for s in metric.samples}
    assert len(names) > 40, sorted(names)
    return names


PROMQL_WORDS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "topk", "bottomk",
                "clamp_min", "clamp_max", "abs", "delta", "deriv", "offset", "bool", "vector", "scalar", "time",
                "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "inf", "nan"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once label matchers, label
    lists after by/without, range selectors, strings and numbers are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)                        # strings
    e = re.sub(r"\{[^}]*\}", " ", e)                                    # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)                                   # range selectors
    e = re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b", " ", e)               # numbers
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e))
    return {w for w in words if w.lower() not in PROMQL_WORDS}


def test_grafana_dashboard_queries_name_exported_metrics() -> None:
    """The dashboard is valid JSON with panels and queries, and every query reads only metrics
    this project's processes export (a renamed or removed metric fails here)."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["panels"]
    exported = exported_metric_names()
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for title, expr in exprs:
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced {expr}"
        names = promql_metrics(expr)
        assert names, f"{title}: no metric in {expr}"
        unknown = sorted(names - exported)
        assert not unknown, f"{title}: {expr} names metrics no process exports: {unknown}"
    assert (promql_metrics('sum by (le) (rate(omni_placement_seconds_bucket{job="x"}[5m]))')
            == {"omni_placement_seconds_bucket"})
    assert "omni_dp_requests_total" in exported and "omni_worker_healthy" in exported
    assert "omni_worker_healthy_total" not in exported and "omni_dp_made_up_total" not in exported


# --------------------------------------------------------------------------------------------
# Dockerfile

def dockerfile_instructions(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    text = path.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_conventions() -> None:
    ins = dockerfile_instructions()
    froms = [rest.split()[0] for op, rest in ins if op == "FROM"]
    assert froms and all(re.fullmatch(r"python:3\.11-slim(-\w+)?", f) for f in froms), froms
    assert not any(op == "ADD" for op, _ in ins), "COPY, not ADD (no remote downloads)"
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    for tool in ("curl", "wget", "git clone", "apt-get"):
        assert tool not in runs, f"nothing but PyPI at build time: {tool}"
    user = [rest for op, rest in ins if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root"), "the image must run as a non-root user"
    uid = int(user[-1].split(":")[0])
    for w in workloads(all_docs()):
        if image_ref(container(w)["image"])[0] == OUR_IMAGE:
            assert w["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
    assert json.loads(next(rest for op, rest in reversed(ins) if op == "ENTRYPOINT")) == ["omni-proxy"]
    exposed = {int(p) for op, rest in ins if op == "EXPOSE" for p in rest.split()}
    ports = {p["containerPort"] for w in workloads(all_docs()) if image_ref(container(w)["image"])[0] == OUR_IMAGE
             for p in container(w)["ports"]}
    assert ports <= exposed


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as Docker reads it: the last matching rule wins; `!` includes again; a rule
    matching a folder applies to everything below it."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = os.path.normpath(pattern).lstrip("/")
        rx = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                rx += ".*"
                i += 2
            elif pattern[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(rx + r"\Z")))
    return rules


def docker_context_files() -> list[str]:
    rules = dockerignore_rules()

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        result = False
        for negate, rx in rules:
            if any(rx.match(p) for p in prefixes):
                result = not negate
        return result

    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "node_modules")]
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if not excluded(rel):
                files.append(rel)
    return files


def test_docker_context_builds_the_package(tmp_path: Path) -> None:
    """What .dockerignore lets into the build context is enough for the Dockerfile's `pip wheel`:
    the wheel built from exactly those files holds every package and the omni-proxy command."""
    files = docker_context_files()
    assert "pyproject.toml" in files and "Dockerfile" not in files
    assert not [f for f in files if f.startswith(("tests/", ".git/", "bench/", "docs/")) or "__pycache__" in f]
    assert "README.md" in files, "pyproject.toml's readme must be in the context"
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        sources = {str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts}
        missing = sources - set(files)
        assert not missing, f"the build context lacks {sorted(missing)[:5]}"
    # build the wheel from exactly those files, offline, with this environment's setuptools
    import importlib.util

    from packaging.version import Version

    try:
        import setuptools
    except ImportError:
        pytest.skip("no setuptools here: the wheel is not built (the context was checked file by file)")
    needed = PYPROJECT["build-system"]["requires"][0].partition(">=")[2]
    if Version(setuptools.__version__) < Version(needed or "0") or (
            Version(setuptools.__version__) < Version("70.1") and importlib.util.find_spec("wheel") is None):
        pytest.skip(f"setuptools {setuptools.__version__} cannot build the wheel offline here (needs >= {needed}, "
                    "and the wheel package below 70.1); the context was checked file by file")
    context = tmp_path / "context"
    for rel in files:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next((tmp_path / "wheels").glob("omni_proxy-*.whl"))
    assert wheel.name.startswith(f"omni_proxy-{VERSION}-")
    names = zipfile.ZipFile(wheel).namelist()
    for package in packages:
        assert f"{package}/__init__.py" in names, f"the image would lack the package {package}"
    assert "protos/omni_proxy_pb2.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "omni-proxy = omni_proxy.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_proxy_image_has_the_otel_extra() -> None:
    """The data plane's --otel-endpoint works in the image: the wheels and the install carry the
    `otel` extra (its packages are in the wheel directory the install reads, offline)."""
    runs = [rest for op, rest in dockerfile_instructions() if op == "RUN"]
    assert any("pip wheel" in r and "/src[otel]" in r for r in runs), runs
    assert any("pip install" in r and "--no-index" in r and "omni-proxy[otel]" in r for r in runs), runs
    assert "otel" in PYPROJECT["project"]["optional-dependencies"]


VLLM_DOCKERFILE = DEPLOY / "docker" / "vllm-plugin.Dockerfile"
ENGINE_IMAGE = "omni-proxy-vllm"


def test_vllm_plugin_image(tmp_path: Path) -> None:
    """deploy/docker/vllm-plugin.Dockerfile: vLLM's official image plus the plugin's own wheel
    (built in a python stage from packaging/vllm-plugin, out of the same build context as our
    image), VLLM_PLUGINS=omni_proxy; the engines of the manifests run this image."""
    ins = dockerfile_instructions(VLLM_DOCKERFILE)
    args = dict(rest.split("=", 1) for op, rest in ins if op == "ARG" and "=" in rest)
    base = args["VLLM_IMAGE"]
    name, tag = image_ref(base)
    assert name == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", tag), base
    froms = [rest.split()[0] for op, rest in ins if op == "FROM"]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", froms[0]) and froms[-1] == "${VLLM_IMAGE}", froms
    runs = [rest for op, rest in ins if op == "RUN"]
    assert any("pip wheel --no-deps" in r and "/src/packaging/vllm-plugin" in r for r in runs), runs
    assert any("pip install" in r and "omni_proxy_vllm_plugin-" in r for r in runs), runs
    assert not any(t in " ".join(runs) for t in ("curl", "wget", "git clone", "omni-proxy==")), runs
    assert ("ENV", "VLLM_PLUGINS=omni_proxy") in ins
    last_stage = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    assert not [op for op, _ in last_stage if op in ("ENTRYPOINT", "CMD", "USER")], "vLLM's entry point and user stay"
    # the build context (.dockerignore) holds the plugin's pyproject and builds its wheel
    files = docker_context_files()
    assert "packaging/vllm-plugin/pyproject.toml" in files
    context = tmp_path / "context"
    for rel in files:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "--wheel-dir", str(tmp_path / "wheels"), str(context / "packaging" / "vllm-plugin")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next((tmp_path / "wheels").glob("omni_proxy_vllm_plugin-*.whl"))
    assert wheel.name.startswith(f"omni_proxy_vllm_plugin-{VERSION}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "engine_plugins/vllm_plugin/agent.py" in names
    assert "omni_runtime/retry.py" in names          # the agent's backoff
    # every engine of the manifests runs this image, at the package version
    engines = [w for w in workloads(all_docs())
               if w["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    assert engines
    for w in engines:
        assert image_ref(container(w)["image"]) == (ENGINE_IMAGE, VERSION), container(w)["image"]


# --------------------------------------------------------------------------------------------
# docker-compose.yaml

def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_argv(service: dict[str, Any]) -> list[str]:
    """The service's command with compose's ${VAR:-default} interpolated."""
    return [re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1], m[2]), a) for a in service["command"]]


def test_compose_structure() -> None:
    doc = compose()
    services = doc["services"]
    names = set(services)
    dataplanes = sorted(n for n in names if n.startswith("dataplane-"))
    controlplanes = sorted(n for n in names if n.startswith("controlplane-"))
    sims = sorted(n for n in names if n.startswith("sim-"))
    assert {"redis", "nginx"} <= names
    assert len(controlplanes) == 2 and len(dataplanes) == 3 and sims
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        name_, tag = image_ref(svc["image"])
        assert tag and tag != "latest", f"{name}: {svc['image']}"
        if name_ == OUR_IMAGE:
            assert tag == VERSION and svc["build"]["context"] == "."
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for dep in svc.get("depends_on", {}):
            assert dep in names, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in doc.get("volumes", {}), f"{name}: undeclared volume {src}"
    assert services["nginx"]["ports"] == ["127.0.0.1:8080:8080"]
    assert "--appendonly" in services["redis"]["command"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_compose_commands_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command line goes through the real parser and config builders; the control plane's
    workers are the simulators; data planes name the control planes."""
    from controlplane.cli import check_config, config_from_args as cp_config
    from dataplane.cli import config_from_args as dp_config
    from simulator.cli import config_from_args as sim_config

    services = compose()["services"]
    cp_cfgs = []
    for name in (n for n in services if n.startswith("controlplane-")):
        svc = services[name]
        args = parse_command(compose_argv(svc))
        assert args.command == "controlplane"
        mount = next(v for v in svc["volumes"] if v.split(":")[1] == args.config)
        args.config = str(ROOT / mount.split(":")[0])
        cfg = cp_config(args)
        check_config(cfg)
        assert cfg.state.backend == "redis" and cfg.state.redis_url.startswith("redis://redis:6379")
        assert cfg.http_port == DEFAULT_HTTP_PORT and cfg.listen.endswith(":50051")
        cp_cfgs.append(cfg)
    cfg = cp_cfgs[0]
    workers = {w.url: w for w in cfg.workers}
    sims = {}
    for name in (n for n in services if n.startswith("sim-")):
        svc = services[name]
        args = parse_command(compose_argv(svc))
        assert args.command == "sim" and args.host == name, "a sim binds its service name (its dial-back address)"
        env = svc["environment"]
        monkeypatch.setenv("PYTHONHASHSEED", env["PYTHONHASHSEED"])
        sim = sim_config(args)
        sims[name] = sim
        worker = workers.get(f"http://{name}:{args.port}")
        assert worker is not None, f"{name} is not among the control plane's workers"
        assert worker.role.value == args.role
        assert worker.kv_events == sim.kv_events_endpoint.replace("*", name)
        assert worker.kv_replay == sim.kv_events_replay_endpoint.replace("*", name)
        assert sim.block_size == cfg.kv_cache.block_size
        assert sim.prefix_caching_hash_algo == cfg.kv_cache.hash_algo
        assert env["PYTHONHASHSEED"] == str(cfg.kv_cache.hash_seed)
        assert sim.api_key
        assert env["SIM_HOST"] == name
    assert len(sims) == len(workers)
    controlplanes = {f"{n}:50051" for n in services if n.startswith("controlplane-")}
    used = set()
    for name in (n for n in services if n.startswith("dataplane-")):
        args = parse_command(compose_argv(services[name]))
        assert args.command == "dataplane" and args.host == "0.0.0.0" and args.port == 8000
        assert args.controlplane in controlplanes
        used.add(args.controlplane)
        dp = dp_config(args)
        assert dp.upstream.engine_api_key == next(iter(sims.values())).api_key, "one engine key everywhere"
        deps = services[name]["depends_on"]
        assert deps[args.controlplane.split(":")[0]]["condition"] == "service_healthy"
    assert used == controlplanes, "every control-plane replica serves some data plane"
    # nginx sends to exactly the data planes
    upstream = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", NGINX_CONF.read_text(), re.M)
    assert sorted(upstream) == sorted((n, "8000") for n in services if n.startswith("dataplane-"))
    assert set(services["nginx"]["depends_on"]) == {n for n in services if n.startswith("dataplane-")}


# --------------------------------------------------------------------------------------------
# nginx

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/bin/nginx") if os.path.exists(p)), None)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (scripts/install_services.sh installs it: "
                          "apt-get install nginx); nginx.conf is not checked")


def localised_conf(tmp: Path, upstream_ports: list[int], listen_port: int) -> Path:
    """deploy/nginx/nginx.conf with the compose host names replaced by loopback ports and its
    temporary files under ``tmp``; everything else as written."""
    text = NGINX_CONF.read_text()
    servers = re.findall(r"server\s+dataplane-\d+:8000", text)
    assert len(servers) == len(upstream_ports)
    for server, port in zip(servers, upstream_ports, strict=False):
        text = text.replace(server, f"server 127.0.0.1:{port}", 1)
    text, n = re.subn(r"listen\s+8080;", f"listen 127.0.0.1:{listen_port};", text)
    assert n == 1
    temp = "".join(f"    {d}_temp_path {tmp / d};\n" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = text.replace("http {\n", "http {\n" + temp, 1)
    conf = tmp / "nginx.conf"
    conf.write_text(text)
    return conf


def nginx_argv(tmp: Path, conf: Path, *extra: str) -> list[str]:
    return [NGINX, "-p", f"{tmp}/", "-c", str(conf), "-e", "stderr", "-g", f"pid {tmp}/nginx.pid;", *extra]


@needs_nginx
def test_nginx_conf_syntax(tmp_path: Path) -> None:
    conf = localised_conf(tmp_path, [reserved_port() for _ in range(3)], reserved_port())
    out = subprocess.run(nginx_argv(tmp_path, conf, "-t"), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"nginx -t:\n{out.stderr}"
    assert "syntax is ok" in out.stderr
    text = NGINX_CONF.read_text()
    for directive in ("least_conn;", "keepalive 64;", "proxy_buffering off;", "proxy_http_version 1.1;",
                      'proxy_set_header Connection "";', "proxy_read_timeout 3600s;"):
        assert directive in text, directive


@needs_nginx
async def test_nginx_streams_balances_and_fails_over(tmp_path: Path) -> None:
    """The real nginx with this config in front of three streaming upstreams: each stream's first
    chunk reaches the client while its upstream still holds the stream, held streams spread 2/2/2
    (least_conn over one shared zone: without it this fails), upstream connections are reused
    (HTTP/1.1 keep-alive: without `keepalive` this fails), and a dead upstream is skipped.
    (nginx 1.22 passes these small chunks on even with proxy_buffering on; the directive itself is
    checked in test_nginx_conf_syntax.)"""
    seen: list[tuple[int, str, tuple[int, int], str | None, str]] = []  # upstream, peer, version, rid, connection
    gates: list[asyncio.Event] = []

    def make_app(index: int) -> web.Application:
        async def stream(request: web.Request) -> web.StreamResponse:
            host, port = request.transport.get_extra_info("peername")[:2]
            peer = f"{host}:{port}"
            seen.append((index, peer, tuple(request.version), request.headers.get("X-Request-Id"),
                         request.headers.get("Connection", "")))
            body = await request.json()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: {index}\n\n".encode())
            if body.get("hold"):
                gate = asyncio.Event()
                gates.append(gate)
                await asyncio.wait_for(gate.wait(), 30)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        return app

    runners, ports = [], []
    for i in range(3):
        runner = web.AppRunner(make_app(i))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
    listen = reserved_port()        # nginx must be told its port
    conf = localised_conf(tmp_path, ports, listen)
    log = open(tmp_path / "nginx.out", "wb")
    proc = subprocess.Popen(nginx_argv(tmp_path, conf, "-g", "daemon off;"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{listen}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                try:
                    async with http.get(f"{url}/nginx-health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.poll() is None, (tmp_path / "nginx.out").read_text()
                await asyncio.sleep(0.05)

            # six streams held open one after another: the first chunk of each arrives while its
            # upstream still holds the stream, and least_conn puts two on each upstream
            held = []
            for n in range(6):
                resp = await http.post(f"{url}/v1/completions", json={"hold": True},
                                       headers={"X-Request-Id": f"rid-{n}"})
                assert resp.status == 200
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
                assert first.startswith(b"data: "), first
                held.append(resp)
            assert len(gates) == 6, "every stream is still held upstream: nginx passed the chunk unbuffered"
            counts = [sum(1 for s in seen if s[0] == i) for i in range(3)]
            assert counts == [2, 2, 2], f"least_conn should spread held streams evenly, got {counts}"
            for gate in gates:
                gate.set()
            for resp in held:
                rest = await asyncio.wait_for(resp.read(), 10)
                assert rest.endswith(b"data: [DONE]\n\n")
                resp.release()
            assert [s[3] for s in seen] == [f"rid-{n}" for n in range(6)], "X-Request-Id passes unchanged"
            assert all(s[2] == (1, 1) and s[4].lower() != "close" for s in seen), "HTTP/1.1 keep-alive upstream"

            # short requests one after another reuse upstream connections
            before = len(seen)
            for _ in range(12):
                async with http.post(f"{url}/v1/completions", json={}) as r:
                    assert r.status == 200
                    await r.read()
            peers = {s[1] for s in seen}
            assert len(peers) < len(seen), f"{len(seen)} requests used {len(peers)} upstream connections"
            assert len({s[1] for s in seen[before:]} - {s[1] for s in seen[:before]}) < 12

            # one upstream dies: every request still succeeds on the others
            await runners.pop().cleanup()
            before = len(seen)
            for _ in range(9):
                async with http.post(f"{url}/v1/completions", json={}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            assert {s[0] for s in seen[before:]} <= {0, 1}
    finally:
        for gate in gates:
            gate.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()
        for runner in runners:
            await runner.cleanup()


def test_install_services_installs_nginx() -> None:
    """CI gets nginx from the OS packages, so the nginx tests above run there instead of skipping."""
    text = (ROOT / "scripts" / "install_services.sh").read_text()
    assert re.search(r'SERVICES="[^"]*\bnginx:nginx\b', text), "scripts/install_services.sh must install nginx"


# --------------------------------------------------------------------------------------------
# docker-compose.yaml, run without Docker

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@needs_nginx
@pytest.mark.skipif(not os.path.exists(REDIS_SERVER), reason="redis-server is not installed "
                    "(scripts/install_services.sh installs it)")
@pytest.mark.timeout(240)
async def test_compose_demo_runs_as_processes(tmp_path: Path) -> None:
    """docker-compose.yaml's services as local processes: each service gets its own loopback
    address (127.x.y.n, so every service keeps its compose ports), its command line, environment,
    mounted config and healthcheck as written, with only the service names and wildcard binds
    replaced by those addresses. Redis, both control planes, the three data planes, the
    simulators and nginx must come up healthy in compose's dependency order, and OpenAI requests
    through nginx must succeed on every data plane."""
    import random

    doc = compose()
    services = doc["services"]
    net = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
    ip = {name: f"{net}.{i + 1}" for i, name in enumerate(sorted(services))}

    def hosts(text: str, own: str) -> str:
        text = text.replace("0.0.0.0", own).replace("tcp://*:", f"tcp://{own}:").replace("127.0.0.1", own)
        return re.sub(r"(?<=//)([\w-]+)(?=:)", lambda m: ip.get(m[1], m[1]), text)

    def argv_of(name: str) -> list[str]:
        out = []
        for a in compose_argv(services[name]):
            m = re.fullmatch(r"([\w-]+):(\d+)", a)
            if a in ip:
                a = ip[a]
            elif m and m[1] in ip:
                a = f"{ip[m[1]]}:{m[2]}"
            out.append(hosts(a, ip[name]))
        return out

    def env_of_service(name: str) -> dict[str, str]:
        env = {k: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1], m[2]), str(v))
               for k, v in (services[name].get("environment") or {}).items()}
        if "SIM_HOST" in env:
            env["SIM_HOST"] = ip[env["SIM_HOST"]]
        return {**os.environ, **env}

    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True, cwd=tmp_path)

    def healthcheck(name: str) -> list[str]:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        if test[1] == "redis-cli":
            return [shutil.which("redis-cli") or "/usr/bin/redis-cli", "-h", ip[name], *test[2:]]
        assert test[1] == "python"
        return [sys.executable, *[hosts(a, ip[name]) for a in test[2:]]]

    async def healthy(name: str, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        argv = healthcheck(name) if "healthcheck" in services[name] else None
        while True:
            if procs[name].poll() is not None:
                log = (logs / f"{name}.log").read_text()[-3000:]
                pytest.fail(f"{name} exited with {procs[name].returncode}:\n{log}")
            if argv is None:
                return
            check = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                         env=env_of_service(name))
            if await check.wait() == 0:
                return
            if loop.time() > deadline:
                pytest.fail(f"{name} not healthy after {timeout}s:\n{(logs / f'{name}.log').read_text()[-3000:]}")
            await asyncio.sleep(0.3)

    async def up(name: str) -> None:
        for dep, how in (services[name].get("depends_on") or {}).items():
            assert how["condition"] == "service_healthy"
            await healthy(dep)
        svc = services[name]
        if name == "redis":
            data = tmp_path / "redis"
            data.mkdir()
            argv = [REDIS_SERVER, *svc["command"][1:], "--bind", ip[name], "--port", "6379", "--dir", str(data),
                    "--protected-mode", "no", "--daemonize", "no"]
            start(name, argv)
        elif name == "nginx":
            text = NGINX_CONF.read_text()
            text = re.sub(r"(?<=server )([\w-]+)(?=:)", lambda m: ip[m[1]], text)
            text = text.replace("listen 8080;", f"listen {ip[name]}:8080;")
            temp = "".join(f"    {d}_temp_path {tmp_path / d};\n" for d in ("client_body", "proxy", "fastcgi",
                                                                                 "uwsgi", "scgi"))
            conf = tmp_path / "nginx.conf"
            conf.write_text(text.replace("http {\n", "http {\n" + temp, 1))
            start(name, nginx_argv(tmp_path, conf, "-g", "daemon off;"))
        else:
            argv = argv_of(name)
            if argv[0] == "controlplane":
                # the mounted config, with the service names replaced
                config = argv[argv.index("--config") + 1]
                mount = next(v for v in svc["volumes"] if v.split(":")[1] == config)
                local = tmp_path / f"{name}.toml"
                local.write_text(hosts((ROOT / mount.split(":")[0]).read_text(), ip[name]))
                argv[argv.index("--config") + 1] = str(local)
            start(name, [sys.executable, "-m", "omni_proxy", *argv], env_of_service(name))

    order = ["redis", *sorted(n for n in services if n.startswith("sim-")),
             *sorted(n for n in services if n.startswith("controlplane-")),
             *sorted(n for n in services if n.startswith("dataplane-")), "nginx"]
    assert sorted(order) == sorted(services)
    try:
        for name in order:
            await up(name)
        for name in order:
            await healthy(name)
        url = f"http://{ip['nginx']}:8080"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/models") as r:
                assert r.status == 200, await r.text()
                assert [m["id"] for m in (await r.json())["data"]] == ["sim-model"]

            async def one(i: int) -> None:
                stream = i % 3 == 1
                if i % 2:
                    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]}
                else:
                    path, body = "/v1/completions", {"prompt": f"request {i} " + "tokens " * (i * 7)}
                body.update(model="sim-model", max_tokens=8, stream=stream)
                async with http.post(url + path, json=body) as r:
                    text = await r.text()
                    assert r.status == 200, text
                    assert ("data: [DONE]" in text) if stream else json.loads(text)["choices"]

            await asyncio.gather(*(one(i) for i in range(30)))
            used = {}
            for name in (n for n in services if n.startswith("sim-")):
                async with http.get(f"http://{ip[name]}:8000/sim/requests") as r:
                    used[name] = len((await r.json())["requests"])
            assert sum(used.values()) >= 30 and sum(1 for n in used.values() if n) >= 2, used
            for name in (n for n in services if n.startswith("controlplane-")):
                async with http.get(f"http://{ip[name]}:{DEFAULT_HTTP_PORT}/metrics") as r:
                    metrics = await r.text()
                for worker in used:
                    assert f'"{worker}"' in metrics, f"{name} does not know {worker}"
        access = (logs / "nginx.log").read_text()
        for name in (n for n in services if n.startswith("dataplane-")):
            assert f"upstream={ip[name]}:8000" in access, f"nginx sent nothing to {name}"
    finally:
        for name in reversed(order):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name in reversed(order):
            proc = procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
