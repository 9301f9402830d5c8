"""python -m jaxtrain.main --config configs/NAME.py [--config.KEY=VALUE ...] [--workdir DIR]

The documented entry point of a training run, kept as it always was: the same as
`jaxtrain train` (jaxtrain/commands/train.py).
"""

from jaxtrain.commands import train

if __name__ == "__main__":
    train.main()
