"""The ``cbatch`` command line (:mod:`cbatch.entrypoints.cli.main`)."""
