"""One process of a multi-process job for tests/storage/test_checkpoint_shards.py: joins the job
(jax.distributed, gloo), builds a state sharded over every device of the job, and saves or
restores it in place with jaxtrain.checkpoint_shards. Its object-store client goes through
a proxy of its own (the test points each rank at one), so the test counts each process's
requests and bytes apart.

    python tests/shards_worker.py COORDINATOR PROCESSES RANK URL save|restore|both|kill STEP
    python tests/shards_worker.py COORDINATOR PROCESSES RANK URL keep|run|resume 0

(keep, run and resume: the job through jaxtrain's Checkpoints, see `checkpoints`).

`both` saves, then restores what it saved (a save writes, a restore only reads: the test
tells them apart by the method of the requests).
"""

import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def state(mesh, seed: int = 0, rows: int = 64):
    """The same numbers on any mesh: leaves sharded on their first axis over every device
    (fsdp), one replicated leaf (written once, by the process holding replica 0); `seed`
    and `rows` give another state, larger with more rows."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    shard, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())

    def leaf(seed, shape, dtype, sharding):
        values = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
        return jax.device_put(values, sharding)
    return {"params": {"w": leaf(seed, (rows, 96), jnp.float32, shard),
                       "e": leaf(seed + 1, (2 * rows, 32), jnp.bfloat16, shard)},
            "opt": {"mu": leaf(seed + 2, (rows, 96), jnp.float32, shard),
                    "count": jax.device_put(jnp.arange(4, dtype=jnp.int32), whole)}}


def main(coordinator, processes, rank, url, action, step):
    # A short heartbeat ends the survivors of a killed rank soon; where no rank dies, a long
    # one keeps a job on a loaded 2-core machine (CI runs another test file beside this one)
    # from being ended for a late heartbeat.
    dies = action in ("kill", "run")
    jax.distributed.initialize(coordinator, int(processes), int(rank),
                               initialization_timeout=240,
                               heartbeat_timeout_seconds=5 if dies else 60)
    import numpy as np

    from jaxtrain import checkpoint_shards
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    if action in ("run", "keep", "resume"):
        return checkpoints(mesh, int(rank), url, action)
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


ROWS = 1024  # ~0.9 MB of state: the listing and the indices are small beside a share


def checkpoints(mesh, rank: int, url: str, action: str) -> None:
    """The job through jaxtrain.checkpoint.Checkpoints on `url`. keep: saves step 4 (marked
    healthy). run: the same, then rank 1 dies as step 8 is saved (before writing anything;
    the others are ended by the job's heartbeat). resume: restores the newest intact step
    and says whether it is bitwise the state saved."""
    import numpy as np

    from jaxtrain import storage
    from jaxtrain.checkpoint import Checkpoints
    lines = []
    tier = Checkpoints(storage.as_path(url), keep=3, log=lines.append)
    if action in ("run", "keep"):
        tier.save(4, state(mesh, 4, ROWS), {"step": 4})
        tier.wait()
        tier.mark_healthy(4)
        tier.wait()
        if action == "keep":
            tier.close()
            print(json.dumps({"saved": True}))
            return
        if rank == 1:
            os._exit(9)
        tier.save(8, state(mesh, 8, ROWS), {"step": 8})
        tier.wait()
        print(json.dumps({"survived": True}))
        return
    expected = state(mesh, 4, ROWS)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=x.sharding), expected)
    found = tier.newest_intact(target, lambda *_: None)
    if found is None:
        print(json.dumps({"step": None, "lines": lines}))
        return
    step, restored, saved, sums = found
    same = all(np.array_equal(np.asarray(a.addressable_data(i)), np.asarray(b.addressable_data(i)))
               for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected))
               for i in range(len(a.addressable_shards)))
    tier.close()
    print(json.dumps({"step": step, "bitwise": same, "saved": saved, "lines": lines,
                      "healthy": sorted(tier.healthy), "sums": sorted(sums["sum_of_squares"]),
                      "state_bytes": sum(x.nbytes for x in jax.tree.leaves(expected))}))


if __name__ == "__main__":
    main(*sys.argv[1:])
