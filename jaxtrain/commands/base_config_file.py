"""The config file --config stands for when a command is given none (convert --from-hf,
train --workdir of an earlier run): base_config(), so that --config.KEY=VALUE overrides
still parse; the command then fills it from config.json or the run's record."""

from jaxtrain.config import base_config


def get_config():
    return base_config()
