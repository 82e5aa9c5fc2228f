"""The project's import structure (README "Layout"), read from the source with `ast`:

- no import circle among the project's modules (imports under TYPE_CHECKING or inside a function
  count: a circle is a circle whenever it is taken), nor among the worker's sub-packages;
- the services (gateway, scheduler, worker) import none of each other; the gateway reaches the
  engines through the gRPC client (services/client) and nothing else outside the shared layers;
- the shared layers (common, text, engine) import no service and no front package (client,
  offline, entrypoints);
- the gRPC client imports only the common layer; the offline `LLM` (services/offline) no
  process-level service (gateway, scheduler) and no entry point;
- nothing outside services/entrypoints imports it, and its benchmarks drive the engine through
  the public entry points only (the offline `LLM`, the client, the command line, common settings).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler", "worker")
SHARED = ("common", "text", "engine")
# The one import across those lines the design keeps: the gateway talks to schedulers through the
# gRPC client (services/client).
ALLOWED = {("gateway", "client")}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / "services").rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from pkg import mod` counts as pkg.mod)."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(filter(None, (known(alias.name) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in mods else known(base))
        found.discard(None)
        found.discard(name)
        graph[name] = found
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = _imports(_modules())


def test_the_walker_sees_imports_of_every_kind() -> None:
    """Guard against a walker that finds nothing: known edges, one of each import form."""
    assert "services.client.grpc_client" in GRAPH["services.gateway.context"]        # from x.y import Name
    assert "services.common.proto.myvllm_pb2" not in GRAPH                   # generated code left out
    assert "services.worker.attention.triton_kernels" in GRAPH["services.worker.attention.triton_backend"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    assert _circles(GRAPH) == []


def _crossings(may_import: dict[str, tuple[str, ...]]) -> list[str]:
    """Imports from a package listed in `may_import` to a project package outside its list."""
    wrong = []
    for module, targets in GRAPH.items():
        own = _package(module)
        if own not in may_import:
            continue
        for target in targets:
            other = _package(target)
            if other != own and other not in may_import[own] and (own, other) not in ALLOWED:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_services_import_no_other_service_and_shared_layers_no_service() -> None:
    shared_and_proto = SHARED + ("",)  # ("" = the services package itself)
    assert _crossings({**{s: shared_and_proto for s in SERVICES},
                       **{s: shared_and_proto for s in SHARED}}) == []


def test_the_fronts_depend_downwards_only() -> None:
    assert _crossings({"client": ("common", ""),
                       "offline": ("common", "text", "engine", "worker", "client", "")}) == []
    outside = [f"{m} -> {t}" for m, ts in GRAPH.items() if _package(m) != "entrypoints"
               for t in ts if _package(t) == "entrypoints"]
    assert outside == []


def test_the_benchmarks_use_public_entry_points() -> None:
    bench = "services.entrypoints.bench"
    public = ("services.offline", "services.client", "services.common", "services.text", "services.entrypoints")
    wrong = [f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith(bench) for t in ts
             if not t.startswith(public)]
    assert wrong == []


def test_the_worker_sub_packages_form_no_loop() -> None:
    """services/worker/<sub>/ folders (attention, cpu, models, ...) import one another one way."""
    def sub(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "worker" else None

    folders: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        if sub(module) is not None:
            folders.setdefault(sub(module), set()).update(
                t for t in map(sub, targets) if t is not None and t != sub(module))
    assert _circles(folders) == []


def test_the_workers_cpu_kernels_import_neither_attention_nor_models() -> None:
    """services/worker/cpu/ is the C kernels and their build, used by attention/ and models/: it
    imports neither, so the folders form no loop."""
    wrong = [(m, t) for m, ts in GRAPH.items() if m.startswith("services.worker.cpu")
             for t in ts if t.startswith(("services.worker.attention", "services.worker.models"))]
    assert wrong == []
