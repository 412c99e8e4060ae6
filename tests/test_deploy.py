"""Every file in deploy/ is checked by the tool that will read it (issue 13.7): Kubernetes
objects against Kubernetes' own schemas (kubernetes-validate, offline, strict: an unknown field
is an error, as `kubectl apply --validate=strict`), KubeRay objects against the openAPIV3Schema
of KubeRay's published CRDs (tests/data/kuberay, source and commit noted there), the Ray
cluster-launcher file against the schema Ray ships and Ray's own validate_config, supervisor
and training configs (also those inside ConfigMaps) through `thermowatch validate-config`. A
file no checker recognises fails the walk, so nothing in deploy/ goes unchecked.

The loaders' own tests (tests/supervisor/app/test_config.py, tests/trainer/test_config.py) load
every `*supervisor*.yaml` / `*train*.yaml` here too; this file adds everything else."""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import promql_parser
import kubernetes_validate
import pytest
import yaml

from thermowatch.cli import build_parser, main
from thermowatch.launch import validate_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30"  # the oldest Kubernetes minor still in upstream support when written
KUBERAY = ROOT / "tests" / "data" / "kuberay"
YALM = DEPLOY / "yalm-100b" / "train.yaml"

pytestmark = pytest.mark.timeout(90)


# --- checkers, one per kind of file ------------------------------------------------------------

def _strict(node):
    """KubeRay's CRD schema as the API server applies it with fieldValidation=Strict: an object
    with declared properties refuses any other key, unless it preserves unknown fields."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _kuberay_validator(kind: str) -> jsonschema.Draft7Validator:
    data = json.loads((KUBERAY / f"ray.io_{kind.lower()}s.v1.json").read_text())
    assert data["kind"] == kind and data["commit"] and data["source"].startswith("https://github.com/ray-project/kuberay/")
    return jsonschema.Draft7Validator(_strict(data["openAPIV3Schema"]))


def check_kuberay(doc: dict) -> None:
    assert doc["apiVersion"] == "ray.io/v1", doc["apiVersion"]
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _kuberay_validator(doc["kind"]).iter_errors(doc)]
    assert not errors, errors
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    # The pod templates once more, as the Pods Kubernetes will make of them.
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        check_kubernetes({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": group["template"]["spec"]})


def check_kubernetes(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def check_config_text(text: str, kind: str, tmp: Path) -> None:
    path = tmp / f"{kind}.yaml"
    path.write_text(text)
    lines = validate_config(str(path), kind=kind)
    assert lines[0].startswith(f"{path}: {'supervisor' if kind == 'supervisor' else 'training'} config OK")


def check_manifests(path: Path, tmp: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no objects"
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/"):
            check_kuberay(doc)
        else:
            check_kubernetes(doc)
        if doc["kind"] == "ConfigMap":  # configs inside: the same check as a file of their own
            for key, text in doc.get("data", {}).items():
                kind = "supervisor" if "supervisor" in key else "train" if "train" in key else None
                assert kind, f"{path}: ConfigMap key {key} holds a config no checker knows"
                check_config_text(text, kind, tmp)
    return docs


def check_ray_cluster(path: Path) -> None:
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config as ray_validate

    cfg = yaml.safe_load(path.read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)
    ray_validate(prepare_config(copy.deepcopy(cfg)))  # the launcher's own path: defaults filled, then checked


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def check_dockerfile(path: Path) -> None:
    known = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL"}
    ins = _instructions(path)
    assert {i for i, _ in ins} <= known, {i for i, _ in ins} - known
    assert [i for i, _ in ins if i != "ARG"][0] == "FROM"
    for op, arg in ins:
        if op == "COPY":  # every source is in the build context (the repository root)
            for src in shlex.split(arg)[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    users = [arg for op, arg in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = json.loads(dict(ins)["ENTRYPOINT"])
    assert entry[0] in scripts
    build_parser().parse_args(json.loads(dict(ins)["CMD"]))  # the default command parses (argparse exits 2 if not)


def check_systemd(path: Path) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(path.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    assert " serve " in unit["Service"]["ExecStart"]


def check_prometheus(path: Path) -> None:
    cfg = yaml.safe_load(path.read_text())
    assert [j["metrics_path"] for j in cfg["scrape_configs"]] == ["/metrics"]


_METRIC = re.compile(r"\b(thermowatch_[a-z_]+|up)\b")


def _daemon_metric_names(tmp: Path) -> set[str]:
    """Every metric family a real daemon's /metrics serves (a counter also by its _total samples)."""
    import io

    from prometheus_client.parser import text_string_to_metric_families

    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.serve.metrics import Counters, build_registry, render

    sup = Supervisor(SupervisorConfig(data_dir=tmp / "metrics-daemon"), notifier=ConsoleNotifier(io.StringIO()))
    try:
        text = render(build_registry(sup, Counters(), None)).decode()
    finally:
        sup.close()
    names = {"up"}  # Prometheus' own, per scrape target
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
    return names


def check_alert_rules(path: Path, tmp: Path) -> list[dict]:
    """Prometheus alert rules (what `promtool check rules` checks of their shape, and that every
    metric they name is one the daemon serves)."""
    cfg = yaml.safe_load(path.read_text())
    rules = [r for g in cfg["groups"] for r in g["rules"]]
    assert rules and all(g["name"] for g in cfg["groups"])
    known = _daemon_metric_names(tmp)
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        assert re.fullmatch(r"[A-Z][A-Za-z]+", r["alert"]) and r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["expr"].count("(") == r["expr"].count(")"), r
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"]), r
        promql_parser.parse(r["expr"])  # PromQL as Prometheus parses it (raises on a syntax error)
        named = set(_METRIC.findall(r["expr"]))
        assert named and named <= known, (r["alert"], named - known)
    return rules


def check_dashboard(path: Path, tmp: Path) -> dict:
    """A Grafana dashboard: valid JSON, panels with Prometheus targets over metrics the daemon serves."""
    import json

    dash = json.loads(path.read_text())
    known = _daemon_metric_names(tmp)
    assert dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        for t in p["targets"]:
            promql_parser.parse(t["expr"])
            named = set(_METRIC.findall(t["expr"]))
            assert named and named <= known, (p["title"], named - known)
    return dash


def check_file(path: Path, tmp: Path) -> str:
    rel = path.relative_to(DEPLOY).as_posix()
    if path.suffix == ".md":
        assert path.read_text().strip()
        return "prose"
    if path.name == "Dockerfile":
        check_dockerfile(path)
        return "container image"
    if path.suffix == ".service":
        check_systemd(path)
        return "systemd unit"
    if rel.startswith("k8s/"):
        check_manifests(path, tmp)
        return "kubernetes"
    if rel == "ray-cluster.yaml":
        check_ray_cluster(path)
        return "ray cluster launcher"
    if rel.startswith("prometheus/") and path.suffix in (".yml", ".yaml"):
        check_alert_rules(path, tmp)
        return "alert rules"
    if rel.startswith("grafana/") and path.suffix == ".json":
        check_dashboard(path, tmp)
        return "grafana dashboard"
    if path.name.startswith("prometheus"):
        check_prometheus(path)
        return "prometheus"
    if path.suffix in (".yaml", ".yml") and ("supervisor" in path.name or "train" in path.name):
        kind = "supervisor" if "supervisor" in path.name else "train"
        validate_config(str(path), kind=kind)
        return f"{kind} config"
    raise AssertionError(f"deploy/{rel}: no checker knows this file; add one to tests/test_deploy.py")


# --- the walk ---------------------------------------------------------------------------------

def test_every_file_in_deploy_is_checked(tmp_path):
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file())
    kinds = {p.relative_to(DEPLOY).as_posix(): check_file(p, tmp_path) for p in files}
    assert set(kinds.values()) >= {"kubernetes", "ray cluster launcher", "container image", "supervisor config",
                                   "train config", "systemd unit", "prometheus", "alert rules",
                                   "grafana dashboard"}, kinds
    assert {"k8s/rayjob.yaml", "k8s/raycluster.yaml", "k8s/daemon.yaml", "yalm-100b/train.yaml"} <= set(kinds)


def test_the_kubernetes_objects_are_the_ones_a_cluster_team_needs(tmp_path):
    kinds = {(d["kind"], d["metadata"]["name"]) for p in sorted((DEPLOY / "k8s").glob("*.yaml"))
             for d in check_manifests(p, tmp_path)}
    assert {("RayJob", "yalm-100b"), ("RayCluster", "yalm-100b"), ("StatefulSet", "thermowatch"),
            ("Service", "thermowatch"), ("Service", "thermowatch-replicas"),
            ("PodDisruptionBudget", "thermowatch"), ("Secret", "thermowatch-secrets"), ("ConfigMap", "thermowatch-config"),
            ("PersistentVolumeClaim", "thermowatch-checkpoints"), ("StatefulSet", "postgres")} <= kinds


def _docs(name: str) -> dict[str, dict]:
    """kind -> the file's first object of that kind, and "kind/name" -> each object."""
    out: dict[str, dict] = {}
    for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()):
        out.setdefault(d["kind"], d)
        out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def _mounts(pod_spec: dict) -> dict[str, dict]:
    """mountPath -> the volume behind it, for the pod's first container."""
    vols = {v["name"]: v for v in pod_spec["volumes"]}
    return {m["mountPath"]: vols[m["name"]] for m in pod_spec["containers"][0]["volumeMounts"]}


def test_the_rayjob_runs_the_example_config_on_the_shared_volume():
    job, cluster = _docs("rayjob.yaml")["RayJob"], _docs("raycluster.yaml")["RayCluster"]
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]  # one cluster spec, two ways to run it
    spec = cluster["spec"]
    tcfg = yaml.safe_load(YALM.read_text())
    head, workers = spec["headGroupSpec"]["template"]["spec"], spec["workerGroupSpecs"]
    # The entrypoint's config is the ConfigMap that rayjob.yaml's comment makes from the example.
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[:2] == ["thermowatch", "train"]
    cfg_dir, cfg_name = os.path.split(entry[2])
    assert _mounts(head)[cfg_dir]["configMap"]["name"] == "yalm-100b-train"
    assert f"--from-file={cfg_name}={YALM.relative_to(ROOT)}" in (DEPLOY / "k8s" / "rayjob.yaml").read_text()
    # 800 ranks = the GPUs of the worker group; the checkpoint dir is on the RWX claim everywhere.
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in workers)
    assert gpus == tcfg["world_size"] and tcfg["use_gpu"]
    for pod in [head, *(g["template"]["spec"] for g in workers)]:
        shared = [path for path, vol in _mounts(pod).items()
                  if vol.get("persistentVolumeClaim", {}).get("claimName") == "thermowatch-checkpoints"]
        assert shared and tcfg["checkpoint"]["dir"].startswith(shared[0] + "/")
    assert any(tcfg["data"]["path"].startswith(p) for p in _mounts(workers[0]["template"]["spec"]))
    pvc = {d["metadata"]["name"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "volumes.yaml").read_text())}
    assert pvc["thermowatch-checkpoints"]["spec"]["accessModes"] == ["ReadWriteMany"]
    env = {e["name"]: e for e in head["containers"][0]["env"]}
    assert env["THERMOWATCH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "thermowatch-trainer-token"


def test_the_daemon_reads_its_config_and_secrets_where_they_are_mounted(tmp_path):
    docs = _docs("daemon.yaml")
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    main_c = pod["containers"][0]
    args = main_c["args"]
    config_path = args[args.index("--config") + 1]
    mounts = _mounts(pod)
    assert mounts[os.path.dirname(config_path)]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    sup = yaml.safe_load(docs["ConfigMap"]["data"][os.path.basename(config_path)])
    secret_keys = set(docs["Secret"]["stringData"])
    for e in main_c["env"]:
        if e["name"].endswith("_FILE"):
            d, key = os.path.split(e["value"])
            assert mounts[d]["secret"]["secretName"] == docs["Secret"]["metadata"]["name"] and key in secret_keys
    assert main_c["ports"][0]["containerPort"] == sup["port"] and sup["host"] == "0.0.0.0"
    assert "--no-upgrade" in args and pod["initContainers"][0]["args"][:2] == ["db", "upgrade"]
    svc = docs["Service/thermowatch"]["spec"]
    assert svc["selector"] == docs["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    # The db-url the Secret holds by default points at postgres.yaml's Service.
    pg = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "postgres.yaml").read_text())}
    assert f"@{pg['Service']['metadata']['name']}:{pg['Service']['spec']['ports'][0]['port']}/" in docs["Secret"]["stringData"]["db-url"]


def test_the_daemon_runs_a_standby_that_clients_can_reach(tmp_path):
    """Issue 40 item 4: two replicas on PostgreSQL, never both evicted, each ready on /readyz and
    named by the headless Service, and the trainer given both names."""
    docs = _docs("daemon.yaml")
    sts = docs["StatefulSet/thermowatch"]["spec"]
    labels = sts["template"]["metadata"]["labels"]
    assert sts["replicas"] >= 2
    # A standby needs the one shared database: the Secret's URL is PostgreSQL (SQLite refuses a second daemon).
    assert docs["Secret"]["stringData"]["db-url"].startswith("postgresql")
    pdb = docs["PodDisruptionBudget/thermowatch"]["spec"]
    assert pdb["minAvailable"] == 1 < sts["replicas"] and pdb["selector"]["matchLabels"] == labels
    probe = sts["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"  # both replicas ready: see the manifest's comment for why not /readyz/leader
    headless = docs[f"Service/{sts['serviceName']}"]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == labels == docs["Service/thermowatch"]["spec"]["selector"]
    # The RayJob's trainer is given every replica by its stable name, and they parse as the CLI's --server does.
    from thermowatch.supervisor.operate.servers import parse_servers

    entry = shlex.split(_docs("rayjob.yaml")["RayJob"]["spec"]["entrypoint"])
    urls = parse_servers(entry[entry.index("--supervisor") + 1])
    port = docs["Service/thermowatch"]["spec"]["ports"][0]["port"]
    assert urls == tuple(f"http://thermowatch-{i}.{sts['serviceName']}.thermowatch.svc:{port}"
                         for i in range(sts["replicas"]))


def test_the_launcher_cluster_holds_the_example_run():
    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    tcfg = yaml.safe_load(YALM.read_text())
    workers = [t for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]]
    assert sum(t["min_workers"] * t["resources"]["GPU"] for t in workers) == tcfg["world_size"]
    mounted = {dst: ROOT / src for dst, src in cfg["file_mounts"].items()}
    assert (mounted["/etc/thermowatch"] / "train.yaml").resolve() == YALM.resolve()


def test_the_checkers_refuse_a_typo(tmp_path):
    """Each checker above can fail: one misspelt field in each kind of file."""
    dep = copy.deepcopy(_docs("daemon.yaml")["StatefulSet"])
    dep["spec"]["replica"] = dep["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        check_kubernetes(dep)
    job = copy.deepcopy(_docs("rayjob.yaml")["RayJob"])
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplica"] = 100
    with pytest.raises(AssertionError, match="minReplica"):
        check_kuberay(job)
    job = copy.deepcopy(_docs("rayjob.yaml")["RayJob"])
    job["spec"]["backoffLimit"] = "3"
    with pytest.raises(AssertionError, match="backoffLimit: '3' is not of type 'integer'"):
        check_kuberay(job)
    text = (DEPLOY / "ray-cluster.yaml").read_text().replace("    min_workers: 100", "    min_worker: 100")
    (tmp_path / "ray-cluster.yaml").write_text(text)
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        check_ray_cluster(tmp_path / "ray-cluster.yaml")
    cm = _docs("daemon.yaml")["ConfigMap"]["data"]["supervisor.yaml"].replace("lr_factor", "lr_facter")
    with pytest.raises(Exception, match="policy.lr_facter: unknown key"):
        check_config_text(cm, "supervisor", tmp_path)


def test_validate_config_accepts_the_100b_example(capsys):
    assert main(["validate-config", str(YALM)]) == 0
    out = capsys.readouterr().out
    assert f"{YALM}: training config OK" in out
    assert "800 ranks (GPU, NCCL), ZeRO stage 3" in out and "80 layers, d_model 10240" in out
    assert re.search(r"~10[0-9]\.\dB parameters", out)
    assert "curriculum from batch 800 x seq 256 over 30B tokens" in out and "every 250 steps" in out


def test_validate_config_exits_2_naming_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "train.yaml"
    bad.write_text(YALM.read_text().replace("  n_head: 128", "  n_heads: 128"))
    assert main(["validate-config", str(bad)]) == 2
    assert f"{bad}: model.n_heads: unknown key; did you mean 'n_head'?" in capsys.readouterr().err
    bad.write_text(YALM.read_text().replace("global_batch: 1600", "global_batch: 1000"))
    assert main(["validate-config", str(bad)]) == 2
    assert f"{bad}: data.global_batch=1000 is not divisible by world_size=800" in capsys.readouterr().err
    sup = tmp_path / "sup.yaml"
    sup.write_text("port: 8765\npolicy: {lr_factor: half}\n")
    assert main(["validate-config", str(sup)]) == 2
    assert f"{sup}: policy.lr_factor: expected a number, got 'half'" in capsys.readouterr().err
    assert main(["validate-config", str(DEPLOY / "supervisor.example.yaml")]) == 0
    assert "supervisor config OK" in capsys.readouterr().out
    odd = tmp_path / "odd.yaml"
    odd.write_text("colour: blue\n")
    assert main(["validate-config", str(odd)]) == 2
    assert "pass --kind supervisor or --kind train" in capsys.readouterr().err
    assert main(["validate-config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err


def test_a_rule_on_a_metric_the_daemon_does_not_serve_is_refused(tmp_path):
    bad = tmp_path / "rules.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: Typo\n        expr: thermowatch_judge_upp == 0\n"
                   "        labels: {severity: critical}\n        annotations: {summary: s}\n")
    with pytest.raises(AssertionError, match="thermowatch_judge_upp"):
        check_alert_rules(bad, tmp_path)


def test_a_rule_that_is_no_promql_is_refused(tmp_path):
    bad = tmp_path / "rules.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: Broken\n        expr: thermowatch_judge_up == == 0\n"
                   "        labels: {severity: critical}\n        annotations: {summary: s}\n")
    with pytest.raises(ValueError):  # promql_parser's syntax error
        check_alert_rules(bad, tmp_path)
