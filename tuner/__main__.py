"""``python -m tuner``: the same as the ``tuner`` console command."""

from tuner.cli.main import main

if __name__ == "__main__":
    main()
