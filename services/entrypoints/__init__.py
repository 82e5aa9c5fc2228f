"""What starts or drives the services: the `myvllm` command (cli), the local launcher and its
supervisor, the topology a deployment is made of, the engine arguments, deploy file writers,
health checks and benchmarks. Nothing in the services imports this package."""
