"""Many solves on Ray: `mosos sweep` and the service's Ray backend (needs the `ray` extra).

Ray is imported only when a command runs, through `cluster.runtime.import_ray`,
which turns a missing installation into a message that says what to install.
"""
