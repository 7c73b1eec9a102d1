"""`python -m xformer_cli ...`, as torchrun starts each process: the same as `xformer ...`."""

from xformer_cli.entry import main

main()
