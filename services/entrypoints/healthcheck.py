"""`python -m services.entrypoints.healthcheck KIND ADDRESS`: exit 0 when the service is healthy.

Used by docker-compose healthchecks (KIND is worker, scheduler or gateway).
"""

from __future__ import annotations

import sys

from services.entrypoints.launcher import _grpc_healthy, _http_healthy


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("worker", "scheduler", "gateway"):
        print("usage: python -m services.entrypoints.healthcheck worker|scheduler|gateway ADDRESS", file=sys.stderr)
        return 2
    kind, address = argv
    ok = _http_healthy(f"http://{address}/health") if kind == "gateway" else _grpc_healthy(address, kind)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
