"""`myvllm deploy compose | k8s`: deployment files written from the processes `myvllm serve`
starts (services/entrypoints/topology.py), so a container runs exactly serve's command for its process,
with addresses and ports from its placement (compose service names, Kubernetes DNS names)."""
