"""The `xformer` command (import name `xformer_cli`): typer + rich over the `xformer` core."""
