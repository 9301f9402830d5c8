"""What a checkpoint costs a pod on object storage, per host: the facts of the in-place
remote tier (jaxtrain/checkpoint_shards.py) for a config on N devices.

A save writes each shard once, from the process holding its replica 0: every process
writes its index and at least one part (parts of <= PART_BYTES), process 0 the marker. A
restore on the mesh it was saved with reads the marker, every index, and on each process
the byte ranges its devices hold (one request per part it overlaps). Nothing is staged on
a host's disk. The state is what the run trains: float32 parameters and the optimizer's
state (a LoRA run's frozen base is read from its source, not checkpointed).
"""

from __future__ import annotations

import math

from jaxtrain.checkpoint_shards import PART_BYTES
from jaxtrain.models import ModelSpec
from jaxtrain.optim import OPTIMIZERS
from jaxtrain.plan import memory

F32 = 4


def checkpoint_io(cfg, sizes: dict[str, int], devices: int, host_devices: int) -> dict:
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 context=sizes["context"])
    per_param = F32 * (1 + OPTIMIZERS[cfg.optimizer.name].state_per_param)
    whole = memory.param_shards(spec, {axis: 1 for axis in sizes})["total_trained"]
    state = whole * per_param
    per_device = memory.param_shards(spec, sizes)["total_trained"] * per_param
    processes = max(1, math.ceil(devices / host_devices))
    copies = max(1, round(per_device * devices / state))  # replicas over data
    writers = max(1, math.ceil(processes / copies))
    written = state / writers  # by each process holding replica-0 shards
    parts = max(1, math.ceil(written / PART_BYTES))
    read = min(per_device * host_devices, state)
    return {"state_bytes": state, "processes": processes, "writer_processes": writers,
            "write_bytes_per_writer": written,
            "puts_per_checkpoint": writers * parts + (processes - writers) + processes + 1,
            "read_bytes_per_process": read,
            "gets_per_process_restore": 1 + processes + max(1, math.ceil(read / PART_BYTES)),
            "local_disk_bytes_per_host": 0}


def describe(io: dict, gb) -> list[str]:
    """The plan's lines for checkpoint_io's facts (`gb` formats bytes)."""
    return ["checkpoint on gs:// or s3:// (in place, per host):",
            f"  state {gb(io['state_bytes'])} over {io['processes']} hosts; a save: "
            f"{io['puts_per_checkpoint']:,} PUTs, {gb(io['write_bytes_per_writer'])} from "
            f"each of {io['writer_processes']} writing hosts",
            f"  a restore: {gb(io['read_bytes_per_process'])} + metadata per host in "
            f"{io['gets_per_process_restore']:,} GETs; on a host's disk: "
            f"{gb(io['local_disk_bytes_per_host'])}"]
