"""One process of a multi-process job for tests/test_checkpoint_shards.py: joins the job
(jax.distributed, gloo), builds a state sharded over every device of the job, and saves or
restores it in place with jaxtrain.checkpoint_shards. Its object-store client goes through
a proxy of its own (the test points each rank at one), so the test counts each process's
requests and bytes apart.

    python tests/shards_worker.py COORDINATOR PROCESSES RANK URL save|restore|both|kill STEP

`both` saves, then restores what it saved (a save writes, a restore only reads: the test
tells them apart by the method of the requests).
"""

import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def state(mesh):
    """The same numbers on any mesh: leaves sharded on their first axis over every device
    (fsdp), one replicated leaf (written once, by the process holding replica 0)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    shard, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())

    def leaf(seed, shape, dtype, sharding):
        values = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
        return jax.device_put(values, sharding)
    return {"params": {"w": leaf(0, (64, 96), jnp.float32, shard),
                       "e": leaf(1, (128, 32), jnp.bfloat16, shard)},
            "opt": {"mu": leaf(2, (64, 96), jnp.float32, shard),
                    "count": jax.device_put(jnp.arange(4, dtype=jnp.int32), whole)}}


def main(coordinator, processes, rank, url, action, step):
    jax.distributed.initialize(coordinator, int(processes), int(rank),
                               initialization_timeout=120, heartbeat_timeout_seconds=5)
    import numpy as np

    from jaxtrain import checkpoint_shards
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    expected = state(mesh)
    path = f"{url}/{step}"
    if action in ("save", "both", "kill"):
        if action == "kill" and int(rank) == 1:
            os._exit(9)  # dies before writing: the others wait at the barrier, in vain
        checkpoint_shards.save(path, expected, {"config": {"step": int(step)}}, f"s{step}")
        if action != "both":
            print(json.dumps({"saved": True}))
            return
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=x.sharding), expected)
    restored, problem = checkpoint_shards.restore(path, target, f"r{step}")
    same = problem is None and all(
        np.array_equal(np.asarray(a.addressable_data(i)), np.asarray(b.addressable_data(i)))
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected))
        for i in range(len(a.addressable_shards)))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(expected))
    print(json.dumps({"problem": problem, "bitwise": same, "state_bytes": state_bytes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
