"""The Datasette plugin: the landing table's presentation, canned queries, charts, and the
change-point aggregate."""
