"""`myvllm serve`'s supervision (services/entrypoints/supervisor.py) on a tiny process that keeps exiting.
The real thing (a killed worker under serve) is in test_worker_faults.py."""

from __future__ import annotations

import sys
import time

import pytest

from services.entrypoints import supervisor
from services.entrypoints.supervisor import ServiceProcess, stop_all


def test_an_exiting_service_is_restarted_with_a_growing_backoff_and_a_log_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(supervisor, "INITIAL_BACKOFF_S", 0.05)
    service = ServiceProcess("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"])
    service.start()
    deadline = time.monotonic() + 30
    while service.restarts < 3:
        assert time.monotonic() < deadline, "never restarted three times"
        service.supervise()
        time.sleep(0.01)
    err = capsys.readouterr().err
    assert err.count("started flaky (pid ") == 4
    assert "flaky (pid " in err and "exited with code 3; restarting in 0.05s" in err
    assert "restarting in 0.1s" in err and "restarting in 0.2s" in err  # doubles each time
    stop_all([service], grace_s=5)


def test_a_service_reads_its_stdin_data_at_every_start(monkeypatch, capsys) -> None:
    """How serve's redis-server gets its password: on stdin, again at each restart."""
    monkeypatch.setattr(supervisor, "INITIAL_BACKOFF_S", 0.05)
    reader = "import sys; sys.exit(7 if sys.stdin.read() == 'requirepass x\\n' else 3)"
    service = ServiceProcess("reader", [sys.executable, "-c", reader], stdin_data=b"requirepass x\n")
    service.start()
    deadline = time.monotonic() + 30
    while service.restarts < 1 or service.exit_code is None:
        assert time.monotonic() < deadline, "never restarted"
        service.supervise()
        time.sleep(0.01)
    assert capsys.readouterr().err.count("exited with code 7") >= 1 and service.exit_code == 7
    stop_all([service], grace_s=5)


def test_stop_all_ends_a_running_service(capsys) -> None:
    service = ServiceProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    service.start()
    service.supervise()
    assert service.exit_code is None
    t0 = time.monotonic()
    stop_all([service], grace_s=10)
    assert service.exit_code is not None and time.monotonic() - t0 < 10
    assert "exited" not in capsys.readouterr().err  # a stop is not a crash to report


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16", "--no-enable-prefix-caching", "--async-scheduling"]])
def test_serve_forwards_each_flag_to_the_service_that_reads_it(flags: list[str]) -> None:
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", "--max-num-seqs", "4", "--engine-timeout", "7", *flags])
    worker, scheduler, gateway = (cmd for _, cmd, _ in _serve_commands(args, "/m", [[1]], [2], None))
    assert worker[worker.index("--model") + 1] == "/m" and "--max-num-seqs" not in worker
    assert scheduler[scheduler.index("--max-num-seqs") + 1] == "4"
    assert scheduler[scheduler.index("--engine-timeout") + 1] == "7.0"
    assert ("--dtype" in worker) == bool(flags) and "--dtype" not in scheduler
    assert ("--no-enable-prefix-caching" in scheduler) == ("--async-scheduling" in scheduler) == bool(flags)
    # Every forwarded command parses with that service's own CLI.
    for cmd in (worker, scheduler, gateway):
        build_parser().parse_args(cmd[cmd.index("services.entrypoints.cli") + 1:])


def test_serve_passes_the_pipeline_size_to_workers_and_scheduler() -> None:
    """-tp 2 -pp 2: four ranks per replica (stage-major), each worker and the scheduler told P."""
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands, _topology

    args = build_parser().parse_args(["serve", "-tp", "2", "-pp", "2"])
    assert _topology(args, None) == ("topology: 1 engine replica (data parallel), 4 worker ranks each "
                                     "(2 tensor parallel x 2 pipeline stages), 1 gateway")
    services = _serve_commands(args, "/m", [[11, 12, 13, 14]], [10], None)
    commands = {name: cmd for name, cmd, _ in services}
    assert [n for n in commands if n.startswith("worker")] == [f"worker-rank{r}" for r in range(4)]
    for name in ("worker-rank3", "scheduler"):
        assert commands[name][commands[name].index("--pipeline-parallel-size") + 1] == "2"
        assert commands[name][commands[name].index("--tensor-parallel-size") + 1] == "2"
        build_parser().parse_args(commands[name][commands[name].index("services.entrypoints.cli") + 1:])
    scheduler = commands["scheduler"]
    assert scheduler[scheduler.index("--workers") + 1] == ",".join(f"127.0.0.1:{p}" for p in (11, 12, 13, 14))


def test_serve_starts_data_and_tensor_parallel_topologies() -> None:
    """--data-parallel-size 2 --tensor-parallel-size 2: a redis, two replicas of two worker ranks
    and a scheduler naming both (in rank order), one gateway naming both schedulers and redis."""
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    services = _serve_commands(args, "/m", [[11, 12], [21, 22]], [10, 20], 6379)
    names = [name for name, _, _ in services]
    assert names == ["redis", "worker-0-rank0", "worker-0-rank1", "scheduler-0", "worker-1-rank0", "worker-1-rank1",
                     "scheduler-1", "gateway"]
    commands = {name: cmd for name, cmd, _ in services}
    assert commands["scheduler-1"][commands["scheduler-1"].index("--workers") + 1] == "127.0.0.1:21,127.0.0.1:22"
    # The Redis URL (with the password serve makes) goes by environment, never on a command line;
    # the password reaches redis-server on stdin (`-`).
    secret_url = "redis://:pw-not-in-argv@127.0.0.1:6379/0"
    with_secret = {name: cmd for name, cmd, _ in _serve_commands(args, "/m", [[11, 12], [21, 22]], [10, 20], 6379,
                                                                   secret_url)}
    assert not any("pw-not-in-argv" in arg for cmd in with_secret.values() for arg in cmd)
    assert commands["redis"][1] == "-"
    assert "--redis" not in commands["scheduler-0"]
    assert commands["scheduler-0"][commands["scheduler-0"].index("--engine-id") + 1] == "replica-0"
    worker = commands["worker-0-rank1"]
    assert worker[worker.index("--tensor-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in commands["scheduler-0"]  # one stage: the default
    gateway = commands["gateway"]
    assert gateway[gateway.index("--scheduler") + 1] == "127.0.0.1:10,127.0.0.1:20"
    assert "--redis" not in gateway
    for name in names[1:]:  # every myvllm command parses with its service's own CLI
        build_parser().parse_args(commands[name][commands[name].index("services.entrypoints.cli") + 1:])


@pytest.mark.parametrize(("command", "foreign_flag"), [
    (["worker", "--port", "1"], ["--max-num-seqs", "4"]),
    (["worker", "--port", "1"], ["--engine-timeout", "3"]),
    (["scheduler", "--port", "1", "--workers", "w:2"], ["--dtype", "bfloat16"]),
    (["scheduler", "--port", "1", "--workers", "w:2"], ["--model", "/m"]),
])
def test_each_service_refuses_flags_it_does_not_read(command: list[str], foreign_flag: list[str], capsys) -> None:
    from services.entrypoints.cli import build_parser

    build_parser().parse_args(command)
    with pytest.raises(SystemExit):
        build_parser().parse_args(command + foreign_flag)
    assert "unrecognized arguments" in capsys.readouterr().err



def test_serve_forwards_gateway_flags_but_never_credentials() -> None:
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", "--max-migrations", "5", "--api-key", "secret-key",
                                      "--internal-token", "secret-token"])
    gateway = _serve_commands(args, "/m", [[1]], [2], None)[-1][1]
    assert gateway[gateway.index("--max-migrations") + 1] == "5"
    assert not {"secret-key", "secret-token", "--api-key", "--internal-token"} & set(gateway)


def test_serve_makes_an_expert_parallel_group_of_its_replicas() -> None:
    """-dp 2 --enable-expert-parallel: both flags reach every worker and scheduler, each scheduler
    gets its DP rank and the group's rendezvous address; without the flag, none of that."""
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", "-dp", "2", "--enable-expert-parallel"])
    commands = {name: cmd for name, cmd, _ in _serve_commands(args, "/m", [[11], [21]], [10, 20], 6379,
                                                              group_port=5555)}
    for rank in (0, 1):
        scheduler, worker = commands[f"scheduler-{rank}"], commands[f"worker-{rank}"]
        assert scheduler[scheduler.index("--data-parallel-rank") + 1] == str(rank)
        assert scheduler[scheduler.index("--data-parallel-address") + 1] == "127.0.0.1:5555"
        for cmd in (scheduler, worker):
            assert cmd[cmd.index("--data-parallel-size") + 1] == "2" and "--enable-expert-parallel" in cmd
            build_parser().parse_args(cmd[cmd.index("services.entrypoints.cli") + 1:])
    dense = build_parser().parse_args(["serve", "-dp", "2"])
    scheduler = dict((n, c) for n, c, _ in _serve_commands(dense, "/m", [[11], [21]], [10, 20], 6379))["scheduler-1"]
    assert "--data-parallel-rank" not in scheduler and "--enable-expert-parallel" not in scheduler


def test_a_service_group_restarts_every_member_when_one_exits(monkeypatch, capsys) -> None:
    """An expert-parallel group's services share one process group: one exits, all restart."""
    monkeypatch.setattr(supervisor, "INITIAL_BACKOFF_S", 0.05)
    steady = ServiceProcess("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    flaky = ServiceProcess("flaky", [sys.executable, "-c", "import sys; sys.exit(5)"])
    group = supervisor.ServiceGroup("test group", [steady, flaky])
    for member in group.members:
        member.start()
    first_steady = steady.proc.pid
    deadline = time.monotonic() + 30
    while group.restarts < 1:
        assert time.monotonic() < deadline, "never restarted"
        group.supervise()
        time.sleep(0.01)
    assert steady.proc.pid != first_steady and steady.exit_code is None  # stopped and started again
    err = capsys.readouterr().err
    assert "flaky (pid" in err and "exited with code 5; stopping the test group (2 services)" in err
    stop_all(group.members, grace_s=5)
