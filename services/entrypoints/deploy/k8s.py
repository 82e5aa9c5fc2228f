"""Kubernetes manifests from serve's processes (services/entrypoints/topology.py's KubernetesPlacement names
every object and address).

The process model is serve's, one process per container:

- each engine replica r: its T x P worker ranks are StatefulSet `<name>-engine-<r>-worker`, pod
  ordinal = rank (stage-major, the scheduler's `--workers` order); its scheduler is StatefulSet
  `<name>-engine-<r>-scheduler` (one pod); a headless Service `<name>-engine-<r>` over both gives
  every pod a stable DNS name, published before the pod is ready, because the ranks meet at the
  scheduler's rendezvous store (and then each other, gloo / NCCL) before anything is ready, on
  ports no Service lists. The ranks' one pod template holds because serve's worker commands differ
  only in their port, and here every rank listens on the same one. The scheduler is not a
  container of the rank-0 pod: a StatefulSet's pods share one template, so a container in pod 0
  alone cannot be written without making ordinals stop being ranks or wrapping serve's command in
  a script; as its own pod it also restarts without rank 0's model load, and needs no GPU node;
- the gateway: a Deployment and a Service; redis (with several replicas): a Deployment and a
  Service, its password from the Secret;
- the internal token, API key and redis password: one Secret, `<name>-credentials`, which every
  pod reads its secrets from. The user creates it (USAGE), or `deploy k8s --api-key` /
  `--internal-token` writes it to credentials.yaml (the other secrets random): no placeholder
  is ever written, since a Secret applied unedited would hand every service a guessable secret
  (the services refuse one at start-up: services/common/secret_check.py).

Probes run what compose's healthchecks run (`python -m services.entrypoints.healthcheck`, which presents the
internal token); see `_engine_probes` for why liveness is a TCP check.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.auth import TOKEN_ENV
from services.common.redis_registry import REDIS_URL_ENV
from services.common.secret_check import check_service_secrets, join_api_keys
from services.entrypoints.topology import (
    API_KEY_ENV,
    EXIT_GRACE_S,
    GATEWAY,
    GROUP_PORT,
    REDIS,
    SCHEDULER,
    WORKER,
    KubernetesPlacement,
    ProcessSpec,
    Topology,
    healthcheck_command,
    redis_url,
)

REDIS_PASSWORD_ENV = "MYVLLM_REDIS_PASSWORD"
SECRET_FILE = "credentials.yaml"
# Each secret's key in the Secret, by the environment variable a process reads it from.
SECRET_KEYS = {TOKEN_ENV: "internal-token", API_KEY_ENV: "api-key", REDIS_PASSWORD_ENV: "redis-password"}
ENGINE_LABEL = "myvllm/engine-replica"
COMPONENT_LABEL = "app.kubernetes.io/component"
PROBE_PERIOD_S = 5
# Before the gateway's SIGTERM: time for its endpoint's removal to reach every Service proxy, so
# that new connections stop arriving before it drains.
GATEWAY_PRESTOP_S = 5
WAITING_QUERY = 'sum(vllm:num_requests_waiting{{model_name="{model}"}})'


@dataclass(frozen=True)
class K8sOptions:
    image: str
    device: str | None  # "cuda": each worker pod gets one nvidia.com/gpu
    shutdown_timeout_s: float  # the gateway's --shutdown-timeout (its drain on SIGTERM)
    startup_timeout_s: float  # serve's --startup-timeout: how long a service may take to become healthy
    served_model_name: str  # the model_name label of the gateway's vllm:* metrics
    worker_cpus: int = 2
    worker_memory: str = "4Gi"
    keda: bool = False
    prometheus_url: str = "http://prometheus-server.monitoring.svc:9090"
    keda_waiting_requests: int = 16  # replica r >= 1 runs while this many x r requests wait


def _escape(argv: Sequence[str], keep: str | None) -> list[str]:
    """Kubernetes expands `$(VAR)` in a container's command and reads `$$` as a literal `$`: a
    literal one in a flag is written `$$`; `keep` (the placement's own reference) stays as it is."""
    return [a if a == keep else a.replace("$", "$$") for a in argv]


class _Manifests:
    def __init__(self, specs: Sequence[ProcessSpec], topology: Topology, placement: KubernetesPlacement,
                 options: K8sOptions) -> None:
        self.specs, self.topology, self.placement, self.options = specs, topology, placement, options
        self.name = placement.name
        self.secret = f"{self.name}-credentials"
        self.redis = next((s for s in specs if s.role == REDIS), None)
        drain = math.ceil(options.shutdown_timeout_s)
        exit_grace = math.ceil(EXIT_GRACE_S)
        # serve stops the gateway first and lets it drain (--shutdown-timeout, then EXIT_GRACE_S to
        # exit) before it stops the engines; here all pods get SIGTERM at once on a delete, so an
        # engine pod waits out the gateway's whole grace period in preStop first.
        self.gateway_grace = GATEWAY_PRESTOP_S + drain + exit_grace
        self.engine_prestop = self.gateway_grace
        self.engine_grace = self.engine_prestop + exit_grace
        self.startup_failures = max(1, math.ceil(options.startup_timeout_s / PROBE_PERIOD_S))

    # ------------------------------------------------------------------ pieces

    def labels(self, component: str, replica: int | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "myvllm", "app.kubernetes.io/instance": self.name,
                  COMPONENT_LABEL: component}
        if replica is not None:
            labels[ENGINE_LABEL] = str(replica)
        return labels

    def metadata(self, name: str, component: str, replica: int | None = None) -> dict:
        return {"name": name, "labels": self.labels(component, replica)}

    def secret_env(self, name: str) -> dict:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": self.secret, "key": SECRET_KEYS[name]}}}

    def env(self, spec: ProcessSpec) -> list[dict]:
        env: list[dict] = []
        for name in spec.env:
            if name == REDIS_URL_ENV:
                # The URL is built from the Secret's password by Kubernetes ($(VAR) of an earlier entry).
                env += [self.secret_env(REDIS_PASSWORD_ENV),
                        {"name": REDIS_URL_ENV, "value": redis_url(self.redis.address, f"$({REDIS_PASSWORD_ENV})")}]
            else:
                env.append(self.secret_env(name))
        if spec.role == WORKER:
            # serve's ranks share one machine's cores (threads_per_rank divides them); a pod has its
            # own CPU request.
            env.append({"name": "MYVLLM_NUM_THREADS", "value": str(self.options.worker_cpus)})
        return env

    def resources(self, role: str) -> dict:
        requests = {WORKER: {"cpu": str(self.options.worker_cpus), "memory": self.options.worker_memory},
                    SCHEDULER: {"cpu": "1", "memory": "1Gi"}, GATEWAY: {"cpu": "1", "memory": "1Gi"},
                    REDIS: {"cpu": "100m", "memory": "128Mi"}}[role]
        # A worker's limits are its requests (Guaranteed QoS): its MYVLLM_NUM_THREADS threads get
        # the cores they were sized for, and its memory (weights + KV cache) is known up front.
        # The others get headroom above their requests for bursts (many streams, grammar compiles).
        limits = dict(requests) if role == WORKER else {
            SCHEDULER: {"cpu": "2", "memory": "2Gi"}, GATEWAY: {"cpu": "2", "memory": "2Gi"},
            REDIS: {"cpu": "500m", "memory": "256Mi"}}[role]
        if role == WORKER and self.options.device == "cuda":
            limits["nvidia.com/gpu"] = 1  # one GPU per rank, as serve's workers
        return {"requests": requests, "limits": limits}

    @staticmethod
    def prestop(seconds: int) -> dict:
        return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}

    def _engine_probes(self, spec: ProcessSpec) -> dict:
        """Startup and readiness: the service's own Health (what serve waits for, within
        --startup-timeout), run by services.entrypoints.healthcheck with the internal token. Not a `grpc:`
        probe: the services do not serve grpc.health.v1, and their token check refuses any
        call without the token. Liveness: the gRPC port accepts connections. Health itself would
        be wrong there: a scheduler whose worker died answers not-ok while it waits to set the
        restarted worker up again, which it does by itself; restarting it would only lose that."""
        check = {"exec": {"command": healthcheck_command(spec)}}
        return {
            "startupProbe": {**check, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": PROBE_PERIOD_S,
                             "failureThreshold": self.startup_failures},
            "readinessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": PROBE_PERIOD_S, "failureThreshold": 3},
            "livenessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10, "timeoutSeconds": PROBE_PERIOD_S,
                              "failureThreshold": 3},
        }

    def container(self, spec: ProcessSpec, port_name: str) -> dict:
        return {
            "name": spec.role,
            "image": self.options.image,
            "imagePullPolicy": "IfNotPresent",
            "command": _escape(spec.argv, None),
            "env": self.env(spec),
            "ports": [{"name": port_name, "containerPort": spec.port}],
            "resources": self.resources(spec.role),
        }

    def pod_spec(self, container: dict, grace_s: int) -> dict:
        # No service links: Kubernetes would add MYVLLM_*_PORT-style variables for every Service.
        return {"enableServiceLinks": False, "terminationGracePeriodSeconds": grace_s, "containers": [container]}

    # ------------------------------------------------------------------ objects

    def secret_object(self, values: dict[str, str]) -> dict:
        """The Secret with `values` (by the environment variable that reads each)."""
        data = {SECRET_KEYS[env]: value for env, value in values.items()}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": self.metadata(self.secret, "credentials"),
                "type": "Opaque", "stringData": data}

    def redis_objects(self) -> list[dict]:
        spec = self.redis
        container = self.container(spec, "redis")
        container["image"] = "redis:7"
        # redis-server replaces its process title, so the password does not stay in `ps`.
        container["command"] = _escape(spec.argv, self.placement.redis_password)
        container["env"] = [self.secret_env(REDIS_PASSWORD_ENV),
                            {**self.secret_env(REDIS_PASSWORD_ENV), "name": "REDISCLI_AUTH"}]  # for redis-cli
        container["readinessProbe"] = {"exec": {"command": healthcheck_command(spec)}, "periodSeconds": PROBE_PERIOD_S}
        container["livenessProbe"] = {"tcpSocket": {"port": "redis"}, "periodSeconds": 10}
        labels = self.labels(REDIS)
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.metadata(self.placement.redis, REDIS),
            # One instance at a time: replicas publish their load to the one the gateway reads.
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": self.pod_spec(container, math.ceil(EXIT_GRACE_S))}},
        }
        return [deployment, self.service(self.placement.redis, REDIS, [("redis", spec.port)])]

    def service(self, name: str, component: str, ports: list[tuple[str, int]], replica: int | None = None,
                headless: bool = False) -> dict:
        spec: dict = {}
        if headless:
            # Pod DNS names exist before the pods are ready: the ranks rendezvous before any is.
            spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
        selector = self.labels(component, replica)
        if headless:  # both of the replica's StatefulSets
            del selector[COMPONENT_LABEL]
        spec |= {"selector": selector,
                 # Numeric target ports: a named one would leave out (of the endpoints, and so of DNS)
                 # the pods without a port of that name, and a headless Service spans two kinds.
                 "ports": [{"name": port_name, "port": port, "targetPort": port} for port_name, port in ports]}
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.metadata(name, component, replica),
                "spec": spec}

    def stateful_set(self, name: str, role: str, replica: int, specs: list[ProcessSpec]) -> dict:
        container = self.container(specs[0], "grpc")
        if any(s.argv != specs[0].argv or s.env != specs[0].env for s in specs):
            # One pod template for every ordinal: it holds only while ranks differ in nothing but
            # their address (the scheduler tells each rank which it is).
            raise ValueError(f"{name}: the ranks' commands differ; one pod template cannot run them")
        if replica == 0 and role == SCHEDULER and self.topology.expert_parallel_group:
            container["ports"].append({"name": "group", "containerPort": GROUP_PORT})
        container |= self._engine_probes(specs[0])
        container["lifecycle"] = self.prestop(self.engine_prestop)
        labels = self.labels(role, replica)
        return {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": self.metadata(name, role, replica),
            "spec": {
                "serviceName": self.placement.engine_service(replica),
                "replicas": len(specs),
                # All ranks start together: none is set up until every one is there.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": self.pod_spec(container, self.engine_grace)},
            },
        }

    def engine_objects(self, replica: int) -> list[dict]:
        workers = [s for s in self.specs if s.role == WORKER and s.replica == replica]
        scheduler = [s for s in self.specs if s.role == SCHEDULER and s.replica == replica]
        ports = [(SCHEDULER, scheduler[0].port), (WORKER, workers[0].port)]
        if replica == 0 and self.topology.expert_parallel_group:
            ports.append(("group", GROUP_PORT))
        return [self.service(self.placement.engine_service(replica), "engine", ports, replica, headless=True),
                self.stateful_set(self.placement.worker_set(replica), WORKER, replica, workers),
                self.stateful_set(self.placement.scheduler_set(replica), SCHEDULER, replica, scheduler)]

    def gateway_objects(self) -> list[dict]:
        spec = next(s for s in self.specs if s.role == GATEWAY)
        container = self.container(spec, "http")
        container |= {
            "startupProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": PROBE_PERIOD_S,
                             "failureThreshold": self.startup_failures},
            # 503 while draining or while no scheduler answers: no traffic then.
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S,
                               "timeoutSeconds": 3, "failureThreshold": 2},
            # Not /health: it is 503 whenever no scheduler answers (a model still loading, an engine
            # restarting), which a restarted gateway would not change.
            "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
            "lifecycle": self.prestop(GATEWAY_PRESTOP_S),
        }
        labels = self.labels(GATEWAY)
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.port),
                       "prometheus.io/path": "/metrics"}
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.metadata(self.placement.gateway, GATEWAY),
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": annotations},
                                  "spec": self.pod_spec(container, self.gateway_grace)}},
        }
        return [deployment, self.service(self.placement.gateway, GATEWAY, [("http", spec.port)])]

    def disruption_budget(self) -> dict:
        """Voluntary evictions (node drains) take one engine pod at a time: any lost rank stops its
        replica, so at most one replica is down for them while the others serve."""
        selector = {"matchLabels": {k: v for k, v in self.labels("engine").items() if k != COMPONENT_LABEL},
                    "matchExpressions": [{"key": COMPONENT_LABEL, "operator": "In", "values": [SCHEDULER, WORKER]}]}
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": self.metadata(f"{self.name}-engines", "engine"),
                "spec": {"maxUnavailable": 1, "selector": selector}}

    def scaled_objects(self) -> list[dict]:
        """KEDA turns whole engine replicas on and off: replica 0 always runs; replica r >= 1 runs
        while the gateway's vllm:num_requests_waiting exceeds r x --keda-waiting-requests. Each of
        its StatefulSets is either whole or gone (min = max, idle 0): a partial TP group could
        not serve."""
        objects = []
        query = WAITING_QUERY.format(model=self.options.served_model_name)
        for replica in range(1, self.topology.data_parallel_size):
            waiting = str(replica * self.options.keda_waiting_requests)
            for target, size in ((self.placement.worker_set(replica), self.topology.ranks),
                                 (self.placement.scheduler_set(replica), 1)):
                objects.append({
                    "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                    "metadata": self.metadata(target, "engine", replica),
                    "spec": {
                        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": target},
                        "idleReplicaCount": 0, "minReplicaCount": size, "maxReplicaCount": size,
                        "cooldownPeriod": 300,
                        "triggers": [{"type": "prometheus", "metadata": {
                            "serverAddress": self.options.prometheus_url, "query": query,
                            "threshold": waiting, "activationThreshold": waiting}}],
                    },
                })
        return objects


def secret_values(api_key: str | Sequence[str] | None, internal_token: str | None,
                  redis: bool) -> dict[str, str] | None:
    """The Secret's values when `deploy k8s` is given the API key or the internal token (checked
    as the services check them; the internal token and redis' password random unless given: hex,
    as the password goes into a URL); None: neither given, the user creates the Secret."""
    if not api_key and not internal_token:
        return None
    # (The full rule for the API key too: a cluster's API is meant to be reached.)
    check_service_secrets(internal_token=internal_token, api_key=api_key, strict_api_key=True)
    values = {TOKEN_ENV: internal_token or secrets.token_hex(32), API_KEY_ENV: join_api_keys(api_key) or ""}
    if redis:
        values[REDIS_PASSWORD_ENV] = secrets.token_hex(32)
    return values


def manifests(specs: Sequence[ProcessSpec], topology: Topology, placement: KubernetesPlacement,
              options: K8sOptions, secret: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """File name -> the objects it holds (`kubectl apply -f DIR` takes them in name order: a pod
    whose Secret is not there yet just waits for it). `secret`: the Secret's values
    (`secret_values`); None: no Secret file, the user creates it."""
    m = _Manifests(specs, topology, placement, options)
    files: dict[str, list[dict]] = {SECRET_FILE: [m.secret_object(secret)]} if secret is not None else {}
    if m.redis is not None:
        files["redis.yaml"] = m.redis_objects()
    for replica in range(topology.data_parallel_size):
        files[f"engine-{replica}.yaml"] = m.engine_objects(replica)
    files["gateway.yaml"] = m.gateway_objects()
    files["disruption-budget.yaml"] = [m.disruption_budget()]
    if options.keda and topology.data_parallel_size > 1:
        files["keda.yaml"] = m.scaled_objects()
    return files


USAGE = """\
First create the Secret the pods read (they wait for it; never commit its values), e.g.
  kubectl create secret generic {secret} --from-literal=internal-token=$(openssl rand -hex 32) \\
    --from-literal=api-key=$(openssl rand -hex 32) --from-literal=redis-password=$(openssl rand -hex 32)
(or let `myvllm deploy k8s --api-key KEY` write it to credentials.yaml), then: kubectl apply -f {path}/"""
# credentials.yaml's, instead: it is that Secret.
SECRET_USAGE = """\
The Secret the pods read, written because --api-key / --internal-token was given (the other secrets
random): it holds this deployment's secrets; apply it with the rest (kubectl apply -f {path}/), never
commit it."""
