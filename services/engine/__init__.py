"""The engine: requests, KV block accounting, the scheduler, grammars, and the one step loop
(`step_loop.StepLoop`) that drives an engine's ranks through a small `WorkerHandle` protocol.

Shared by the scheduler service (gRPC ranks, services/scheduler/) and the offline `LLM`
(in-process or spawned ranks, services/offline/); imports no service package."""
