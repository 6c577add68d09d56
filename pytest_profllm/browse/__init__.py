"""The Datasette plugin: the landing table's presentation, canned queries, charts, our
prepared pages (templates/, static/), and the change-point aggregate.

Datasette's entry point is this package, not plugin.py: Datasette finds a plugin's templates/
and static/ folders beside the module it registers, and only a package has folders beside it.
The hooks themselves are plugin.py's (every public name there; pluggy registers the ones
marked as hooks).
"""

from pytest_profllm.browse.plugin import *  # noqa: F403
