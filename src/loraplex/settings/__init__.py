"""Each command's settings, declared once: a frozen dataclass whose fields carry their type,
default, unit, help and check. The flags, the `--config` keys, the environment variables and the
docs tables are all made from it (`fields` declares, `command` makes the command, `docs` the
tables)."""
