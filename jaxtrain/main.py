"""python -m jaxtrain.main --config configs/NAME.py [--config.KEY=VALUE ...] [--workdir DIR]"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file from configs/.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<config name>).")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0, for "
                                   "multi-process runs (else detected from SLURM, Open MPI, "
                                   "TPU pods, GKE)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank.")
flags.mark_flags_as_required(["config"])


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from jaxtrain import distributed

    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    from jaxtrain.checkpoint import CheckpointError
    from jaxtrain.config import ConfigError
    from jaxtrain.data import DataError
    from jaxtrain.train.loop import TrainingStopped, run

    config_name = pathlib.Path(config_flags.get_config_filename(flags.FLAGS["config"])).stem
    workdir = pathlib.Path(_WORKDIR.value or f"runs/{config_name}")
    try:
        run(_CONFIG.value, workdir)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:
        print(f"jaxtrain: stopped: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    from jaxtrain import hostmem
    from jaxtrain.cli import parse_flags

    hostmem.restart_with_huge_pages()

    app.run(main, flags_parser=parse_flags)
