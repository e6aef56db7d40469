"""The verbs of `gpuscope` that no feature package owns, one module each.

Every verb module (here, or a feature's own: gpuscope.loadtest.cli, gpuscope.guard.cli, ...) has
`HELP`, optionally `DESCRIPTION`, `add_arguments(parser)` and `run(args) -> int`, and imports nothing
heavy at module level; `gpuscope.cli.VERBS` lists them. A new verb is one module and one line there.
"""
