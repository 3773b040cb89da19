"""``python -m cbatch ...`` is the ``cbatch`` command (for a virtualenv whose scripts are not
on PATH, and for scripts/run.sh)."""

from cbatch.entrypoints.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
