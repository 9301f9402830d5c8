"""Reading what the metric sinks wrote, with the writers' own record formats: TensorBoard
event files (TFRecords of tensorboardX's Event protos) and W&B run files (.wandb: W&B's
LevelDB-style log of its Record protos)."""

import glob
import json
import pathlib
import struct


def tensorboard_scalars(directory) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every event file under `directory`."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(pathlib.Path(directory).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):  # length (8), its crc (4), payload, payload crc (4)
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def wandb_records(path):
    """The Record protos of one .wandb file: a 7-byte header, then 32 KiB blocks of chunks
    (crc 4, length 2, type 1: full, first, middle, last), as LevelDB's log."""
    from wandb.proto import wandb_internal_pb2

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def wandb_runs(wandb_dir) -> list[dict]:
    """Each local W&B run under `wandb_dir`, oldest first: its id, config and history rows
    ({key: value} with `_step`)."""
    runs = []
    for path in sorted(glob.glob(str(pathlib.Path(wandb_dir) / "*run-*" / "run-*.wandb"))):
        run = {"id": None, "config": {}, "history": []}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({u.key: json.loads(u.value_json)
                                      for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json)
                                      for u in record.config.update})
            elif kind == "history":
                run["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                       for i in record.history.item})
        runs.append(run)
    return runs


def metrics_rows(workdir) -> list[dict]:
    """WORKDIR/metrics.jsonl's rows."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def rows_by_step(rows) -> dict[int, dict]:
    """Rows merged per step (a step's val_loss or task scores may be a row of its own)."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    return merged

