"""Flink job entry points; each runs with `flink run -py jobs/NAME.py` or `python -m jobs.NAME`."""
