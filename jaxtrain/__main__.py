"""python -m jaxtrain COMMAND ...: the same as the `jaxtrain` console script."""

from jaxtrain.commands import main

if __name__ == "__main__":
    main()
