"""python -m jaxtrain.main --config configs/NAME.py [--config.KEY=VALUE ...] [--workdir DIR]

The documented entry point of a training run, kept as it always was: the same as
`jaxtrain train` (jaxtrain/commands/train.py).
"""

from jaxtrain import hostmem

if __name__ == "__main__":
    # Before the train command's imports (tensorstore, absl, ml_collections: ~0.7 s), which
    # the re-executed process would only import again.
    hostmem.restart_with_huge_pages()
    from jaxtrain.commands import train

    train.main()
