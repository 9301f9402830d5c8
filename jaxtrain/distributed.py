"""Multi-process start-up: one program per host (or per GPU), joined by jax.distributed.

Must run before anything touches devices. Explicit flags win; otherwise a multi-process
job started by SLURM, Open MPI, a Cloud TPU pod or a Kubernetes JobSet is detected from its
environment and handed to jax's own cluster detection; a single process needs nothing.
"""

from __future__ import annotations

import os

import jax

from jaxtrain.errors import ConfigError

# Environment variables that mark a multi-process job, per launcher jax can detect.
_CLUSTER_MARKERS = {
    "SLURM": lambda env: int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env,
    "Open MPI": lambda env: int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1,
    "Cloud TPU pod": lambda env: "," in env.get("TPU_WORKER_HOSTNAMES", ""),
    # An indexed Job or JobSet pod; jax's detection needs the kubernetes package (jax[k8s]).
    "Kubernetes": lambda env: "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env,
}


def detected_cluster(env=os.environ) -> str | None:
    for name, present in _CLUSTER_MARKERS.items():
        if present(env):
            return name
    return None


def _on_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", jax.config.jax_platforms or "")
    return platforms.split(",")[0].strip() == "cpu"


def defaults() -> dict:
    """The `distributed` section of config.base_config(): in a multi-process job a process
    whose peer stops answering exits (non-zero) after heartbeat_timeout_s, so that the
    scheduler can restart the job (docs/multihost.md)."""
    return {"heartbeat_timeout_s": 60, "initialization_timeout_s": 300}


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int = 60,
               initialization_timeout_s: int = 300) -> str:
    """Joins the job's processes; returns how ('single process', 'flags', or the cluster).

    heartbeat_timeout_s: a process whose peer (or the coordinator) stops answering for this
    long exits non-zero, so that a dead rank ends the whole job and its scheduler can start
    it again, rather than the survivors waiting in a collective forever."""
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    cluster = None if explicit else detected_cluster()
    if not explicit and cluster is None:
        return "single process"
    if explicit and None in (coordinator, num_processes, process_id):
        raise ConfigError("--coordinator, --num_processes and --process_id go together")
    if _on_cpu():
        # XLA's CPU collectives across processes.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(initialization_timeout=initialization_timeout_s,
                    heartbeat_timeout_seconds=heartbeat_timeout_s)
    if explicit:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id,
                                   **timeouts)
        return "flags"
    jax.distributed.initialize(**timeouts)
    return cluster
