"""``python -m errands``: the same command line as the ``errands`` script."""

from .cli import main

if __name__ == "__main__":
    main()
