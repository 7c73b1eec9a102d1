"""The recipe: its schema (schema.py, the [model] table in model_table.py), the strict reading
of tables into dataclasses (strict.py), the TOML loader with `--set` overrides (loading.py) and
the names of attention sites (sites.py). Imports only the leaves of the package.
"""
