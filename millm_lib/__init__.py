"""What every app shares and none owns: the error envelope, ids, JSON bodies, pagination, the
key check, endpoint names and limits, connection settings and the OpenAPI glue. It imports no
app and not the site (healthchecks keeps such pieces in `hc/lib/`)."""
