"""``python -m egraft.cli``: the ``egraft`` command, for when its script is not on PATH."""

from egraft.cli import main

main()
