"""``python -m pagedkv``: the ``pagedkv`` command."""

from pagedkv.entrypoints.cli import main

main()
