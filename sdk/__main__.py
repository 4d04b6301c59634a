"""``python -m formcast``: the same command line as the ``formcast`` script."""

from formcast.cli import main

if __name__ == "__main__":
    main()
