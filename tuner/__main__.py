"""``python -m tuner``: the same as the ``tuner`` console command."""

from tuner.cli.main import main

main()
