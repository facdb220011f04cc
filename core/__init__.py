"""The bottom layer: what every other package shares and nothing else.

- `core.messages`: one pydantic model per wire message (sample, spec, trigger, version
  record, dead letter, adapter-version broadcast, change envelope).
- `core.sources`: source kinds (kafka, postgres, mongodb) registered by URI scheme.
- `core.errors`: the one exception base class and the exit codes of every command.
- `core.settings`: the one settings object, every shared STREAMTUNE_* variable (pydantic-settings).
- `core.defaults`: paths, addresses and topic names used when nothing else is given.
- `core.batching`: tokenization and padding of training examples.

`core` imports nothing from `streamtune`, `jobs`, `operators`, `connectors` or `udfs`
(checked by import-linter, see pyproject.toml).
"""
